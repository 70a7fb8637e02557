"""``get_accelerator()``: DeepSpeed's device abstraction, for CUDA and for the CPU.

Scripts written for DeepSpeed ask the accelerator for the device name, the memory in use,
or to synchronise (``get_accelerator().device_name(local_rank)``). zerotrain runs on CUDA
when it is available and on the CPU otherwise (the same rule ``init_distributed`` uses to
pick NCCL or gloo); ``DS_ACCELERATOR=cpu`` or ``cuda`` overrides the choice, as in
DeepSpeed. On the CPU the answers are DeepSpeed's CPU accelerator's: the device name is
``"cpu"``, ``set_device`` and ``synchronize`` do nothing, memory is the process's resident
set size.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Optional

import torch

__all__ = ["Accelerator", "get_accelerator", "is_current_accelerator_supported",
           "set_accelerator"]

_ACCELERATOR_ENV = "DS_ACCELERATOR"


class Accelerator:
    """The methods DeepSpeed scripts call on ``get_accelerator()``, for ``cuda`` or ``cpu``.

    Memory figures are bytes. ``device_index`` arguments are CUDA device numbers and are
    ignored on the CPU.
    """

    def __init__(self, name: str) -> None:
        if name not in ("cuda", "cpu"):
            raise ValueError(f"{_ACCELERATOR_ENV}={name!r}: zerotrain supports 'cuda' and "
                             "'cpu'")
        if name == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"{_ACCELERATOR_ENV}=cuda but torch.cuda.is_available() is "
                               "False")
        self._name = name
        self._cuda = name == "cuda"
        self._peak_rss = 0

    # ---------------------------------------------------------------- identity
    def __repr__(self) -> str:
        return f"Accelerator({self._name!r})"

    def is_available(self) -> bool:
        return True

    def device_name(self, device_index: Optional[int] = None) -> str:
        """``"cuda"``/``"cuda:<i>"``, or ``"cpu"`` whatever the index."""
        if self._cuda and device_index is not None:
            return f"cuda:{device_index}"
        return self._name

    def device(self, device_index: Optional[int] = None) -> Any:
        return torch.cuda.device(device_index) if self._cuda else None

    def current_device(self) -> int:
        if self._cuda:
            return torch.cuda.current_device()
        return int(os.environ.get("LOCAL_RANK", 0))

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        """CUDA: the visible GPUs. CPU: ``LOCAL_SIZE`` (the ranks a launcher started on this
        node) when set, as DeepSpeed's CPU accelerator counts, else 1."""
        if self._cuda:
            return torch.cuda.device_count()
        local_size = os.environ.get("LOCAL_SIZE", "")
        if local_size.strip().isdigit() and int(local_size) > 0:
            return int(local_size)
        return 1

    def communication_backend_name(self) -> str:
        return "nccl" if self._cuda else "gloo"

    def is_synchronized_device(self) -> bool:
        return not self._cuda

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    # ---------------------------------------------------------------- execution
    def synchronize(self, device_index: Optional[int] = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def Stream(self, *args, **kwargs):  # noqa: N802 - DeepSpeed's name
        return torch.cuda.Stream(*args, **kwargs) if self._cuda else None

    def stream(self, stream: Any):
        return torch.cuda.stream(stream) if self._cuda else contextlib.nullcontext()

    def current_stream(self, device_index: Optional[int] = None):
        return torch.cuda.current_stream(device_index) if self._cuda else None

    def default_stream(self, device_index: Optional[int] = None):
        return torch.cuda.default_stream(device_index) if self._cuda else None

    def Event(self, **kwargs):  # noqa: N802 - DeepSpeed's name
        return torch.cuda.Event(**kwargs) if self._cuda else None

    def lazy_call(self, callback):
        return torch.cuda._lazy_call(callback) if self._cuda else callback()

    def range_push(self, msg: str) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_pop()

    # ---------------------------------------------------------------- random numbers
    def random(self):
        return torch.random

    def manual_seed(self, seed: int) -> None:
        if self._cuda:
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        if self._cuda:
            torch.cuda.manual_seed_all(seed)
        else:
            torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def get_rng_state(self, device_index: Optional[int] = None) -> torch.Tensor:
        if self._cuda:
            return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: Optional[int] = None) -> None:
        if self._cuda:
            torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)
        else:
            torch.set_rng_state(new_state)

    def default_generator(self, device_index: int):
        return torch.cuda.default_generators[device_index] if self._cuda \
            else torch.default_generator

    # ---------------------------------------------------------------- memory (bytes)
    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else self._rss()

    def max_memory_allocated(self, device_index: Optional[int] = None) -> int:
        if self._cuda:
            return torch.cuda.max_memory_allocated(device_index)
        self._rss()
        return self._peak_rss

    def reset_max_memory_allocated(self, device_index: Optional[int] = None) -> None:
        self.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._cuda else self._rss()

    def max_memory_reserved(self, device_index: Optional[int] = None) -> int:
        if self._cuda:
            return torch.cuda.max_memory_reserved(device_index)
        return self.max_memory_allocated()

    memory_cached = memory_reserved
    max_memory_cached = max_memory_reserved

    def reset_max_memory_cached(self, device_index: Optional[int] = None) -> None:
        self.reset_peak_memory_stats(device_index)

    def reset_peak_memory_stats(self, device_index: Optional[int] = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)
        else:
            self._peak_rss = 0

    def memory_stats(self, device_index: Optional[int] = None) -> dict:
        if self._cuda:
            return torch.cuda.memory_stats(device_index)
        return {"allocated_bytes.all.current": self._rss(),
                "allocated_bytes.all.peak": self._peak_rss}

    def total_memory(self, device_index: Optional[int] = None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: Optional[int] = None) -> int:
        if self._cuda:
            return torch.cuda.mem_get_info(device_index)[0]
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    def _rss(self) -> int:
        """This process's resident set size (what DeepSpeed reports on the CPU)."""
        try:
            with open("/proc/self/statm", encoding="ascii") as f:
                rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            import resource
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self._peak_rss = max(self._peak_rss, rss)
        return rss

    # ---------------------------------------------------------------- dtypes and tensors
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return self._cuda

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32, torch.bfloat16] if self.is_bf16_supported() else [torch.float32]
        return dtypes + ([torch.float16] if self._cuda else [])

    def is_triton_supported(self) -> bool:
        return False

    def amp(self):
        return torch.amp

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()


_CURRENT: list[Accelerator] = []   # chosen once per process, as DeepSpeed does


def get_accelerator() -> Accelerator:
    """The process's accelerator: ``DS_ACCELERATOR`` if set, else CUDA when available,
    else the CPU."""
    if not _CURRENT:
        name = os.environ.get(_ACCELERATOR_ENV) or (
            "cuda" if torch.cuda.is_available() else "cpu")
        _CURRENT.append(Accelerator(name))
    return _CURRENT[0]


def set_accelerator(accelerator: Accelerator) -> None:
    """Replace the process's accelerator (DeepSpeed's ``set_accelerator``)."""
    _CURRENT[:] = [accelerator]


def is_current_accelerator_supported() -> bool:
    """DeepSpeed's check that the accelerator in use is one it supports: zerotrain's two
    (``cuda``, ``cpu``) always are."""
    return get_accelerator().device_name() in ("cuda", "cpu")
