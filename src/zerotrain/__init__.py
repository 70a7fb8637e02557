"""zerotrain: ZeRO sharded data-parallel training for PyTorch, in pure Python.

Speaks DeepSpeed's config and API: ``engine, optimizer, loader, scheduler =
zerotrain.initialize(model=..., model_parameters=..., config=...)``.
"""
from __future__ import annotations

from . import accelerator, checkpointing, comm, moe, ops, pipe, utils, zero
from .accelerator import get_accelerator
from .comm import init_distributed
from .dataloader import RepeatingLoader
from .engine import ZeroEngine
from .errors import ConfigError, NonFiniteGradientError, RankMismatchError, ZeroTrainError
from .engine.build import add_config_arguments, initialize
from .core.log import setup_logger
from .core.memory import see_memory_usage
from .tp import tp_model_init
from .utils import log_dist, logger

__version__ = "0.1.0"

# The DeepSpeed release whose config, engine API and checkpoint format zerotrain follows (the
# DeepSpeed checkpoints in tests/fixtures were written by it). Under ``zerotrain.as_deepspeed``
# ``deepspeed.__version__`` reports it, so a script's version check takes DeepSpeed's branch.
DEEPSPEED_VERSION = "0.19.8"

# DeepSpeed scripts refer to the engine class by this name.
DeepSpeedEngine = ZeroEngine

setup_logger()

__all__ = [
    "ConfigError", "DEEPSPEED_VERSION", "DeepSpeedEngine", "NonFiniteGradientError", "RankMismatchError",
    "RepeatingLoader", "ZeroEngine", "ZeroTrainError", "__version__", "accelerator",
    "add_config_arguments", "checkpointing", "comm", "get_accelerator", "init_distributed",
    "initialize", "log_dist", "logger", "moe", "ops", "pipe", "see_memory_usage",
    "tp_model_init", "utils", "zero",
]
