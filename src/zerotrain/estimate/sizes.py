"""Reading and writing the sizes people type: ``7B`` parameters, ``80GB`` of memory.

Counts use decimal suffixes (K = 10^3, M = 10^6, B = 10^9, T = 10^12), as model names do
(``Llama-2-7b``). Byte sizes accept decimal units (KB, MB, GB, TB: powers of 1000, as GPU
vendors and the ZeRO paper count) and binary ones (KiB, MiB, GiB, TiB: powers of 1024, as
``free -g`` and DeepSpeed's estimator count). A bare byte size without a unit is refused:
"80" could mean bytes or gigabytes, and guessing wrong is off by a factor of 10^9.
"""
from __future__ import annotations

import math
import re

__all__ = ["MAX_BYTES", "MAX_PARAMS", "format_count", "format_gb", "parse_bytes",
           "parse_count"]

# Sane bounds for what people type: a thousand times the largest models and machines
# there are, and small enough that every figure derived from them stays exact enough and
# finite (1e308T would be inf, and ``round(inf)`` raises).
MAX_PARAMS = 10**15   # 1000T parameters
MAX_BYTES = 10**18    # 1 EB of memory

_COUNT_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_BYTE_UNITS = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
_NUMBER = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]*)?(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.I)


def _split(text: str) -> tuple[float, str]:
    """(number, upper-cased suffix) of ``text``, or ValueError when it is not that shape."""
    match = _NUMBER.match(str(text))
    if not match:
        raise ValueError(f"{text!r} is not a number with an optional unit")
    value = float(match.group(1).replace("_", ""))
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not finite")
    return value, match.group(2).upper()


def parse_count(text: str) -> int:
    """A parameter count: ``7B`` -> 7_000_000_000, ``1.3b``, ``350M``, ``125k``, ``7e9``.

    Raises ValueError (naming the accepted suffixes) for anything else, and for counts < 1
    or above ``MAX_PARAMS``.
    """
    value, suffix = _split(text)
    if suffix not in _COUNT_SUFFIX:
        raise ValueError(f"{text!r}: unknown suffix {suffix!r}; use K, M, B or T "
                         "(e.g. 7B, 1.3B, 350M)")
    scaled = value * _COUNT_SUFFIX[suffix]
    if scaled > MAX_PARAMS:
        raise ValueError(f"{text!r} is more than {format_count(MAX_PARAMS)} parameters")
    count = round(scaled)
    if count < 1:
        raise ValueError(f"{text!r} is less than one parameter")
    return count


def parse_bytes(text: str) -> int:
    """A memory size in bytes: ``80GB`` -> 80 * 10^9, ``512GiB`` -> 512 * 2^30, ``1.5TB``.

    Raises ValueError for a missing or unknown unit and for sizes <= 0 or above
    ``MAX_BYTES``.
    """
    value, unit = _split(text)
    if unit == "":
        raise ValueError(f"{text!r} has no unit; write e.g. 80GB (10^9 bytes) or 80GiB "
                         "(2^30 bytes)")
    if unit not in _BYTE_UNITS:
        known = ", ".join(u if len(u) == 2 or u == "B" else u[0] + "iB" for u in _BYTE_UNITS)
        raise ValueError(f"{text!r}: unknown unit {unit!r}; use one of {known}")
    scaled = value * _BYTE_UNITS[unit]
    if scaled > MAX_BYTES:
        raise ValueError(f"{text!r} is more than {MAX_BYTES // 10**18} EB (10^18 bytes)")
    size = round(scaled)
    if size <= 0:
        raise ValueError(f"{text!r} must be more than 0 bytes")
    return size


def format_gb(nbytes: float) -> str:
    """Decimal gigabytes with at most two decimals and no trailing zeros: 26.25, 38.5, 112."""
    text = f"{nbytes / 1e9:.2f}".rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


def format_count(count: int) -> str:
    """``7000000000`` -> ``7B``, ``124439808`` -> ``124.44M``: the way models are named."""
    for suffix, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if count >= scale:
            return f"{count / scale:.2f}".rstrip("0").rstrip(".") + suffix
    return str(count)
