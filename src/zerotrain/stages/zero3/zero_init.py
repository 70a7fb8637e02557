"""``zero.Init``, ``zero.GatheredParameters`` and ``register_external_parameter``.

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
import weakref
from typing import Any, Iterable, Mapping, Optional, Union

import torch
from torch import nn

from ...comm import Communicator, init_distributed
from ...errors import StateError
from . import partition as P
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

    def _run_on_full(self, param: nn.Parameter, fn) -> None:
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
        rank, world = self.comm.rank, self.comm.world_size
        if world > 1:   # on the communicator's device: NCCL takes only CUDA tensors
            flat = torch.cat([p.detach().reshape(-1).to(self.comm.device) for p in fresh])
            self.comm.broadcast(flat, src=_global_rank(self.comm, 0), label="zero.Init")
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
        module.to_empty = to_empty


def _random_state() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """torch's CPU generator state and every CUDA device's (none without CUDA)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return torch.get_rng_state(), cuda


def _restore_random_state(state: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda:
        torch.cuda.set_rng_state_all(cuda)


def _global_rank(comm: Communicator, group_rank: int) -> int:
    if comm.group is None:
        return group_rank
    return torch.distributed.get_global_rank(comm.group, group_rank)


class GatheredParameters:
    """Full parameters inside the block (``deepspeed.zero.GatheredParameters``).

    For partitioned (stage 3) parameters every rank must enter: each parameter is
    all-gathered, and on exit, when ``modifier_rank`` is given, that rank's values are
    broadcast and written back into every rank's shard (and fp32 master). Parameters that
    are not partitioned (stages 0-2) are left alone, so the same code runs at every stage.
    """

    def __init__(self, params: Union[nn.Parameter, Iterable[nn.Parameter]],
                 modifier_rank: Optional[int] = None, fwd_module: Any = None,
                 enabled: bool = True) -> None:
        params = [params] if isinstance(params, torch.Tensor) else list(params or [])
        unique = {id(p): p for p in params}
        self.params = [p for p in unique.values() if P.is_partitioned(p)]
        self.modifier_rank = modifier_rank
        self.enabled = enabled and bool(self.params)
        self._gathered: list[nn.Parameter] = []

    def __enter__(self) -> "GatheredParameters":
        if not self.enabled:
            return self
        self.comm = Communicator()
        for p in self.params:
            if p.numel() == p.ds_numel:  # already whole (its unit is gathered)
                continue
            p.data = _gather_full(p, _shard_comm(p, self.comm), _compute_device(p))
            self._gathered.append(p)
        P.mark(self._gathered, P.ZeroParamStatus.AVAILABLE)
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        if self.modifier_rank is not None and exc[0] is None:
            for p in self.params:
                full = p.data.to(self.comm.device).contiguous()
                self.comm.broadcast(full, src=_global_rank(self.comm, self.modifier_rank))
                shard = _shard_comm(p, self.comm)
                chunk = P.chunk_of(full, shard.rank, shard.world_size)
                k = _frozen_index(p)
                if k is not None:   # int8 frozen chunk: quantized again (zero3/frozen.py)
                    frozen = p.ds_unit.frozen
                    full = frozen.round_trip(k, full, shard.world_size)
                    frozen.store(k, chunk)
                else:
                    p.ds_tensor.copy_(chunk)
                    master = getattr(p, "ds_master", None)
                    if master is not None:
                        master.copy_(chunk)
                p.data.copy_(full.view_as(p.data))   # the value every rank now decodes
                if getattr(p, "ds_unit", None) is not None:
                    p.ds_unit.shards_changed()
        for p in self._gathered:
            p.data = P.empty_placeholder(p)
        P.mark(self._gathered, P.ZeroParamStatus.NOT_AVAILABLE)
        self._gathered.clear()


class _Gathered:
    """The handle ``all_gather_coalesced`` returns: the gathers are done when it returns
    (they are synchronous here), so ``wait`` has nothing left to wait for."""

    def wait(self, handle_dependency: bool = True) -> None:
        """Nothing in flight (see the class)."""


def all_gather_coalesced(params: Iterable[nn.Parameter], safe_mode: bool = False,
                         quantize: bool = False) -> _Gathered:
    """DeepSpeed's ``param.all_gather_coalesced(params)``: every released partitioned
    parameter of ``params`` gets its full value in ``.data`` and stays whole until
    ``param.partition()`` (or its unit's next release). Collective: every rank passes the
    same parameters. ``safe_mode`` and ``quantize`` are DeepSpeed's options with nothing
    to change here (the chunks go over as they are kept)."""
    comm = Communicator()
    gathered = []
    for p in {id(p): p for p in params}.values():
        if not P.is_partitioned(p) or p.numel() == p.ds_numel:
            continue
        p.data = _gather_full(p, _shard_comm(p, comm), _compute_device(p))
        gathered.append(p)
    P.mark(gathered, P.ZeroParamStatus.AVAILABLE)
    return _Gathered()


def release(params: Iterable[nn.Parameter]) -> None:
    """DeepSpeed's ``param.partition(params)``: drop the full value of each gathered
    parameter (its chunk stays the value; a change made to the full value is not kept:
    write through ``zero.GatheredParameters(..., modifier_rank=...)``)."""
    released = [p for p in params if P.is_partitioned(p) and p.numel() == p.ds_numel
                and p.ds_numel > 0]
    for p in released:
        p.data = P.empty_placeholder(p)
    P.mark(released, P.ZeroParamStatus.NOT_AVAILABLE)


def attach_param_methods(p: nn.Parameter) -> None:
    """Give a partitioned parameter DeepSpeed's per-parameter methods: ``all_gather()``,
    ``all_gather_coalesced(params)``, ``partition(param_list=None)`` and ``ds_summary()``,
    and its usage records as they stand before a stage uses it (no module is using it, it
    is no external parameter: Note "usage records" in ``usage.py``). The methods hold the
    parameter weakly: a parameter keeping itself alive through its own attributes would
    wait for the cycle collector to free its memory."""
    ref = weakref.ref(p)
    p.all_gather = functools.partial(_gather_one, ref)
    p.all_gather_coalesced = all_gather_coalesced
    p.partition = functools.partial(_release_one, ref)
    p.ds_summary = functools.partial(_summary, ref)
    if not hasattr(p, "ds_active_sub_modules"):
        p.ds_active_sub_modules = set()
    if not hasattr(p, "is_external_param"):
        p.is_external_param = False


def _summary(ref: "weakref.ref[nn.Parameter]", use_debug_name: bool = False) -> dict:
    """DeepSpeed's ``param.ds_summary()``: what error messages print about a parameter."""
    p = ref()
    ds_tensor = getattr(p, "ds_tensor", None)
    return {"id": p.ds_id, "status": p.ds_status.name, "numel": p.numel(),
            "ds_numel": p.ds_numel, "shape": tuple(p.shape), "ds_shape": tuple(p.ds_shape),
            "requires_grad": p.requires_grad,
            "grad_shape": tuple(p.grad.shape) if p.grad is not None else None,
            "persist": bool(getattr(p, "ds_persist", False)),
            "active_sub_modules": p.ds_active_sub_modules,
            "ds_tensor.shape": ds_tensor.shape if ds_tensor is not None else None}


def _gather_one(ref: "weakref.ref[nn.Parameter]",
                param_list: Optional[Iterable[nn.Parameter]] = None,
                **_options: Any) -> _Gathered:
    return all_gather_coalesced([ref()] if param_list is None else param_list)


def _release_one(ref: "weakref.ref[nn.Parameter]",
                 param_list: Optional[Iterable[nn.Parameter]] = None, **_options: Any) -> None:
    release([ref()] if param_list is None else param_list)


def unpartition(params: Iterable[nn.Parameter], comm: Communicator) -> int:
    """Give parameters partitioned by ``zero.Init`` their full values back, for good.

    Stages 0-2 train full parameters: a model built under ``zero.Init`` and then handed to
    one of them (a script whose config moved from stage 3 to stage 2) gets the values plain
    construction would have given. Collective over ``comm`` (every rank, same order);
    returns how many parameters were made whole."""
    whole = 0
    for p in params:
        if not P.is_partitioned(p):
            continue
        if p.ds_tensor.numel() != P.chunk_numel(p.ds_numel, comm.world_size):
            raise StateError(
                f"a parameter of shape {tuple(p.ds_shape)} was partitioned by zero.Init over "
                f"a group other than the {comm.world_size} data-parallel ranks: build the "
                "model outside zero.Init to train it at stages 0-2")
        p.data = _gather_full(p, comm, p.ds_tensor.device)
        p.ds_tensor = None
        p.ds_status = P.ZeroParamStatus.AVAILABLE
        whole += 1
    return whole


def _frozen_index(p: nn.Parameter) -> Optional[int]:
    """``p``'s place among its unit's int8 frozen chunks, or None."""
    unit = getattr(p, "ds_unit", None)
    return unit.frozen_index(p) if unit is not None else None


def _gather_full(p: nn.Parameter, comm: Communicator, device: torch.device) -> torch.Tensor:
    """A partitioned parameter's full value on ``device``, all-gathered from every rank's
    chunk over ``comm`` (collective; offloaded chunks live on the host)."""
    chunk = _chunk_values(p).to(comm.device).contiguous()
    out = torch.empty(comm.world_size * chunk.numel(), dtype=chunk.dtype, device=chunk.device)
    comm.all_gather(out, chunk)
    return P.fill_full(p, out).to(device=device, dtype=p.dtype).clone()


def _chunk_values(p: nn.Parameter) -> torch.Tensor:
    """This rank's chunk of ``p`` in its dtype (decoded when kept as int8)."""
    k = _frozen_index(p)
    return p.ds_tensor if k is None else p.ds_unit.frozen.values(k, p.dtype)


def _shard_comm(p: nn.Parameter, world: Communicator) -> Communicator:
    """The group a parameter's chunks are spread over: its unit's (MiCS: a shard group)."""
    unit = getattr(p, "ds_unit", None)
    return unit.comm if unit is not None else world


def _compute_device(p: nn.Parameter) -> torch.device:
    """Where a partitioned parameter is used: its unit's device once a stage owns it."""
    unit = getattr(p, "ds_unit", None)
    return unit.device if unit is not None else p.ds_tensor.device


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Declare that ``module``'s forward uses ``parameter`` owned by another module.

    Must be called before ``initialize``; tied parameters (the same Parameter registered on
    two modules) are found without it. It also shows in DeepSpeed's registry,
    ``module._external_params`` (Note "usage records" in ``usage.py``).
    """
    registry = getattr(module, "_external_params", None)
    if not isinstance(registry, dict):
        registry = module._external_params = {}
    registry[id(parameter)] = parameter
    external = getattr(module, "_zerotrain_external_params", None)
    if external is None:
        external = []
        module._zerotrain_external_params = external
    if not any(p is parameter for p in external):
        external.append(parameter)
