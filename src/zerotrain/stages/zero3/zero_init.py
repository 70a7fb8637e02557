"""``zero.Init``: parameters partitioned as modules are constructed (``GatheredParameters``,
``register_external_parameter`` and the per-parameter methods are in ``gathered.py``,
re-exported here).

Note: partition at construction
    Under ``zero.Init`` every module's parameters are partitioned as soon as that module's
    ``__init__`` returns: rank 0's values are broadcast (one collective per module), each rank
    keeps its chunk (``partition.py``) and the full tensor is freed, so no rank ever holds
    the whole model. A parent that re-initialises a child's weights afterwards with
    ``torch.nn.init`` (nanoGPT's ``self.apply(self._init_weights)``, for example) still gets
    exactly the values of plain construction: inside the context those functions gather a
    partitioned parameter, initialise it in full with the same random stream, and partition
    it again. Every rank must build the same modules in the same order.

Note: skip_init's memory
    ``to_empty`` leaves a ``skip_init`` module's parameters as whatever memory it got, for
    the caller to initialise; DeepSpeed broadcasts rank 0's bytes. A model that never
    initialises them (DeepSpeed's own ``TestParamPartitioningSkipInit``) trained from
    leftover heap bytes, which in bf16 read as values near the dtype's limits, inf or NaN:
    some runs stopped at a NaN gradient, others not. zerotrain partitions zeros instead:
    the same on every rank and in every run, finite, and what a later initialisation
    overwrites anyway (inside the context ``torch.nn.init`` gathers, writes the full value
    and partitions it again, Note: partition at construction).

Note: the same weights through transformers' ZeRO-3 path
    ``from_config``/``from_pretrained`` under a DeepSpeed ZeRO-3 config enter transformers'
    ``no_init_weights`` (torch's init functions become no-ops) before ``zero.Init``, then
    initialise every module once more on rank 0 after construction. Skipping torch's
    default inits during construction leaves the random stream where a plain
    construction's is not, so every randomly initialised weight came out different. Inside
    ``Init`` those functions are torch's again, so the construction draws what a plain one
    draws and the later rank-0 initialisation continues from the same point: the weights
    equal a plain ``from_config`` with the same seed.

Note: a load draws nothing
    ``from_pretrained`` without DeepSpeed builds the model on the meta device: the
    construction draws nothing from torch's random streams, and after the load only the
    keys missing from the checkpoint are initialised (drawing in transformers' module
    order). Under ZeRO-3 it builds under ``zero.Init`` instead, inside ``no_init_weights``
    and ``no_tie_weights``. Running the inits there (as for ``from_config``, Note above)
    advanced the stream, so whatever the script drew next (a LoRA adapter's initial
    values, dropout masks, the data order) differed from the plain run's; it also marked
    every module initialised, so a missing key kept a construction-time value instead of
    being initialised after the load. For such a load ``Init`` leaves transformers' no-op
    inits in place (the values are broadcast from rank 0 and then overwritten by the
    checkpoint, or initialised as missing keys after it, as DeepSpeed does), and it puts
    the CPU generator and every CUDA generator back as they were on entry, so a draw made
    during construction some other way (``torch.randn`` in an ``__init__``) is undone too:
    the stream is where a plain load leaves it.
"""
from __future__ import annotations

import functools
import os
import threading
from typing import Any, Mapping, Optional

import torch
from torch import nn

from ...comm import Communicator, init_distributed
from ...errors import StateError
from . import partition as P
from .gathered import attach_param_methods, global_rank
# the names importers find here (the stage, the factory, zero/): gathered.py holds them
from .gathered import GatheredParameters, register_external_parameter, unpartition  # noqa: F401
from .writes import (PartitionedWrites, bound_initializers, loading_pretrained,
                     per_module_initializers, skipped_by_transformers)

_state = threading.local()
_MISSING = object()


def _contradicting_single_rank_pg_error(dp_world_size: int, explicit_process_group: Any,
                                        env: Optional[Mapping[str, Any]] = None
                                        ) -> Optional[str]:
    """The error for a one-rank group under a launcher that started several processes
    (DeepSpeed's name), else None. A size-1 process group made before ``zero.Init`` (a
    library initialising torch.distributed first) would have every rank keep whole
    parameters: no partitioning, each rank out of memory with a model that fits sharded.
    A group passed explicitly is taken as meant; a missing or malformed ``WORLD_SIZE``
    is not a launcher's."""
    if dp_world_size != 1 or explicit_process_group is not None:
        return None
    env = os.environ if env is None else env
    try:
        launched = int(env.get("WORLD_SIZE", "0") or "0")
    except (TypeError, ValueError):
        return None
    if launched <= 1:
        return None
    return (f"zero.Init: the process group has 1 rank but the launcher started "
            f"WORLD_SIZE={launched} processes, so every rank would keep whole parameters; "
            "torch.distributed was initialised with a one-rank group before zero.Init "
            "(call deepspeed.init_distributed() before building the model, or pass "
            "data_parallel_group= if one rank is meant)")


def _all_module_classes() -> set[type]:
    seen: set[type] = set()
    stack = [nn.Module]
    while stack:
        cls = stack.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.add(sub)
                stack.append(sub)
    return seen


class Init:
    """Partition parameters as modules are constructed (``deepspeed.zero.Init``)."""

    def __init__(self, module: Optional[nn.Module] = None, data_parallel_group=None,
                 mem_efficient_linear: bool = True, remote_device: Optional[str] = None,
                 pin_memory: bool = False, config_dict_or_path: Any = None,
                 config: Any = None, enabled: bool = True, dtype: Optional[torch.dtype] = None,
                 mpu: Any = None, **_: Any) -> None:
        if remote_device not in (None, "cpu"):
            raise ValueError(
                f"zero.Init(remote_device={remote_device!r}): only None (partitions stay on "
                "the device the module is built on) and 'cpu' are supported; to keep "
                "parameter shards in files during training use zero_optimization."
                "offload_param {device: nvme}")
        if pin_memory and remote_device != "cpu":
            raise ValueError("zero.Init(pin_memory=True) pins partitions kept on the host: "
                             "it needs remote_device='cpu'")
        if pin_memory and not torch.cuda.is_available():
            raise ValueError("zero.Init(pin_memory=True) needs CUDA: pinned host memory "
                             "serves copies to a GPU, and none is available")
        self.enabled = enabled
        self.group = data_parallel_group
        self.remote_device = remote_device
        self.pin_memory = pin_memory
        self.dtype = dtype
        self._patched: list[tuple[Any, str, Any]] = []
        self._rng: Optional[tuple[torch.Tensor, list[torch.Tensor]]] = None
        self.comm: Optional[Communicator] = None
        if module is not None and enabled:  # DeepSpeed's form: partition an existing model
            with self:
                self._partition_module(module)

    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        init_distributed(verbose=False)
        self.comm = Communicator(self.group)
        contradiction = _contradicting_single_rank_pg_error(self.comm.world_size, self.group)
        if contradiction is not None:
            raise StateError(contradiction)
        for cls in _all_module_classes() | {nn.Module}:
            if "__init__" in cls.__dict__:
                self._patch(cls, "__init__", self._wrap_init(cls.__dict__["__init__"]))
        wrap = self._wrap_init
        patch = self._patch

        def init_subclass(cls, **kwargs):  # classes defined inside the context
            super(nn.Module, cls).__init_subclass__(**kwargs)
            if "__init__" in cls.__dict__:
                patch(cls, "__init__", wrap(cls.__dict__["__init__"]))
        self._patch(nn.Module, "__init_subclass__", classmethod(init_subclass))
        if loading_pretrained():   # Note: a load draws nothing
            self._rng = _random_state()
        else:
            for owner, name, original in list(skipped_by_transformers()):  # Note: the same
                self._patch(owner, name, original)                         # weights...
        for owner, name, original in list(bound_initializers()):  # Note: every init path
            self._patch(owner, name, self._wrap_initializer(original))
        for owner, name, original in list(per_module_initializers()):
            self._patch(owner, name, self._wrap_module_step(original))
        self._writes = PartitionedWrites(self._run_on_full)
        self._writes.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        self._writes.__exit__(*exc)
        for owner, name, original in reversed(self._patched):
            if isinstance(owner, dict):
                owner[name] = original
            elif original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._patched.clear()
        if self._rng is not None:
            _restore_random_state(self._rng)
            self._rng = None

    def _patch(self, owner: Any, name: str, replacement: Any) -> None:
        if isinstance(owner, dict):   # transformers' table of init functions
            self._patched.append((owner, name, owner[name]))
            owner[name] = replacement
            return
        self._patched.append((owner, name, owner.__dict__.get(name, _MISSING)
                              if isinstance(owner, type) else getattr(owner, name)))
        setattr(owner, name, replacement)

    def _run_on_full(self, param: torch.Tensor, fn) -> None:
        """Run ``fn`` on ``param``'s full value; every rank keeps rank 0's result."""
        with GatheredParameters([param], modifier_rank=0):
            fn(param.data)

    def _wrap_init(self, original):
        @functools.wraps(original)
        def init(module: nn.Module, *args, **kwargs):
            depth = getattr(_state, "depth", {})
            _state.depth = depth
            depth[id(module)] = depth.get(id(module), 0) + 1
            try:
                original(module, *args, **kwargs)
            finally:
                depth[id(module)] -= 1
            if depth[id(module)] == 0:
                del depth[id(module)]
                self._partition_module(module)
        return init

    def _wrap_module_step(self, original):
        """transformers' per-module init step, run on the module's own parameters gathered
        (every rank keeps rank 0's values), so writes through an index reach the full value."""
        @functools.wraps(original)
        def step(model, module: nn.Module, *args, **kwargs):
            params = [p for p in module.parameters(recurse=False) if P.is_partitioned(p)]
            if not params:
                return original(model, module, *args, **kwargs)
            with GatheredParameters(params, modifier_rank=0):
                result = original(model, module, *args, **kwargs)
            for param in params:
                self._writes.register(param)
            return result
        return step

    def _wrap_initializer(self, original):
        @functools.wraps(original)
        def initializer(tensor: torch.Tensor, *args, **kwargs):
            if not P.is_partitioned(tensor):
                return original(tensor, *args, **kwargs)
            with GatheredParameters([tensor], modifier_rank=0):
                original(tensor, *args, **kwargs)
            self._writes.register(tensor)
            return tensor
        return initializer

    def _partition_module(self, module: nn.Module) -> None:
        """Broadcast rank 0's new parameters of ``module`` as one tensor, keep chunks."""
        fresh = [p for p in module.parameters() if not P.is_partitioned(p)]
        if not fresh:
            return
        if any(p.is_meta for p in fresh):
            self._partition_after_to_empty(module)
            return
        if self.dtype is not None:
            for p in fresh:
                if p.is_floating_point():
                    p.data = p.data.to(self.dtype)
        assert self.comm is not None   # __enter__ made it: modules are partitioned inside
        rank, world = self.comm.rank, self.comm.world_size
        if world > 1:   # on the communicator's device: NCCL takes only CUDA tensors
            flat = torch.cat([p.detach().reshape(-1).to(self.comm.device) for p in fresh])
            self.comm.broadcast(flat, src=global_rank(self.comm, 0), label="zero.Init")
            offset = 0
            for p in fresh:
                p.data.copy_(flat[offset: offset + p.numel()].view_as(p))
                offset += p.numel()
            del flat
        for p in fresh:
            chunk = P.chunk_of(p.data, rank, world)
            if self.remote_device == "cpu":
                chunk = chunk.pin_memory() if self.pin_memory else chunk.cpu()
            P.partition(p, rank, world, chunk=chunk)
            attach_param_methods(p)
            self._writes.register(p)


    def _partition_after_to_empty(self, module: nn.Module) -> None:
        """A module built on the meta device has no values to partition yet:
        ``torch.nn.utils.skip_init`` builds it there and then calls ``to_empty(device=...)``.
        Partition right after that call, as DeepSpeed does (Note: skip_init's memory)."""
        if "to_empty" in module.__dict__:
            return

        def to_empty(*args: Any, **kwargs: Any) -> nn.Module:
            del module.to_empty
            out = type(module).to_empty(module, *args, **kwargs)
            with torch.no_grad():
                for p in module.parameters():
                    if not P.is_partitioned(p):
                        p.zero_()
            self._partition_module(module)
            return out
        # an attribute of this module that shadows the method until its one call
        setattr(module, "to_empty", to_empty)


def _random_state() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """torch's CPU generator state and every CUDA device's (none without CUDA)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return torch.get_rng_state(), cuda


def _restore_random_state(state: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda:
        torch.cuda.set_rng_state_all(cuda)
