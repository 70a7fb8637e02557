"""The ``zerotrain`` logger: INFO to stderr on global rank 0, as DeepSpeed's logger does.

A handler is added only when the application has configured none for ``zerotrain``, so an
application that sets up logging itself keeps full control.
"""
from __future__ import annotations

import logging
import os

ALL_RANKS = "zerotrain_all_ranks"   # a record with this attribute set logs on every rank


class _RankZeroFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return (record.levelno >= logging.WARNING or os.environ.get("RANK", "0") == "0"
                or getattr(record, ALL_RANKS, False))


def setup_logger() -> logging.Logger:
    logger = logging.getLogger("zerotrain")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[zerotrain %(levelname)s] %(message)s"))
        handler.addFilter(_RankZeroFilter())
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger
