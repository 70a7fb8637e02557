"""``zerotrain.initialize``: from a model and a DeepSpeed config to a running engine.

The order matters and is written down here:
1. the process group (``init_distributed``), because the batch-size triangle needs the world
   size;
2. the config, validated the same way on every rank, before any collective (an
   ``activation_checkpointing`` section configures ``zerotrain.checkpointing``), then the
   node layout (``topology.py``), exchanged once so the ledger can tell cross-node bytes;
3. the module on its device and dtype;
4. a fingerprint exchange, so ranks that disagree fail with a message instead of a hang;
5. rank 0's parameters broadcast, so every rank starts from the same weights;
6. with ``tensor_parallel.autotp_size`` T > 1, the mesh and the model's layers split over
   it (``tp/``), after the broadcast so every rank cuts its slice from the same weights;
   the stage then shards over the data-parallel ranks only (at stage 3 it partitions
   the slices: ``tp/zero3.py``); with sequence parallelism (an mpu from
   ``register_with_transformers``, or ``sequence_parallel_size``) the sequence mesh, the
   stage sharding over every rank and averaging over the N/S data-parallel ones;
7. the stage, which shards the optimizer and installs the gradient hooks;
8. the scheduler and the data loader, which need the stage's optimizer and the
   data-parallel world size;
9. with ``compile.enabled``, ``engine.compile``: last, because what is compiled depends on
   the stage's hooks (per unit at stage 3, docs/compile.md).
"""
from __future__ import annotations

import argparse
import datetime
import logging
import math
import os
import sys
import types
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from .. import recompute
from ..comm import (DEFAULT_TIMEOUT, Communicator, group_backends, init_distributed,
                   select_device, set_group_timeout)
from ..comm.mesh import build_mesh
from .compile import refuse_precompiled
from .autocast import check_reduction as check_autocast_reduction
from ..config import (ZeroTrainConfig, ZeroTrainConfigWarning, load_config, read_config_dict,
                     unimplemented_message)
from .sequence import sequence_parallel_of, use_sequence_mesh
from ..dataloader import DistributedLoader
from .engine import ZeroEngine
from .fingerprint import check_same_across_ranks, fingerprint
from .optimizer_choice import (no_optimizer, optimizer_factory,
                               refuse_fp32_cpu_adam_states,
                               refuse_offloaded_client_optimizer, scheduler_for,
                               trainable_groups)
from .ownership import claim_of, close_stage, open_stage_of
from .resume import auto_resume
from ..errors import ConfigError
from ..muon import setup as muon_setup
from ..optim import check_client_optimizer
from ..core.precision import PrecisionPolicy
from .full_params import register_engine
from ..stages.factory import adopt, build_stage, stage_class
from ..tp import TensorParallelPlan, TensorParallelStage, check_recorded, parallelize
from ..tp.zero3 import check_stage3
from ..stages.zero3.partition import is_partitioned
from ..stages.zero3.zero_init import unpartition

logger = logging.getLogger(__name__)


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add exactly DeepSpeed's arguments: ``--deepspeed``, ``--deepspeed_config`` and the
    deprecated ``--deepscale``, ``--deepscale_config``.

    No ``--local_rank``: scripts written for DeepSpeed define it themselves, and adding it
    again would make argparse fail; the engine reads the local rank from ``LOCAL_RANK``.
    """
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable DeepSpeed (a flag for user code; zerotrain ignores it)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="DeepSpeed-format JSON configuration file")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="deprecated spelling of --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="deprecated spelling of --deepspeed_config")
    return parser


def initialize(args: Any = None, model: Optional[nn.Module] = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None,
               lr_scheduler: Any = None, distributed_port: int = 29500, mpu: Any = None,
               dist_init_required: Optional[bool] = None, collate_fn: Any = None,
               config: Any = None, config_params: Any = None):
    """Build the engine; returns ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    Same signature and meaning as ``deepspeed.initialize``. ``config`` is a dict or a JSON
    path (``config_params`` is its older name, ``args.deepspeed_config`` another source).
    ``optimizer`` may be a torch optimizer over the model's parameters (it is re-targeted
    at this rank's shards) or None to build the config's ``optimizer`` section.
    ``lr_scheduler`` may be a scheduler object or a callable taking the optimizer.
    """
    if model is None:
        raise ConfigError("model", "initialize() needs model=")
    refuse_precompiled(model)
    sp_given = sequence_parallel_of(mpu)   # ConfigError for an mpu it cannot use
    source = _config_source(args, config, config_params)
    timeout = _comms_timeout(source)
    adopted = dist.is_initialized()
    init_distributed(distributed_port=distributed_port, verbose=False,
                     timeout=timeout or DEFAULT_TIMEOUT)
    if adopted and timeout is not None:   # a group made before us: give it our timeout
        set_group_timeout(timeout)
    cfg = load_config(source, world_size=dist.get_world_size(), warn_unimplemented=False,
                      sequence_parallel=sp_given)
    if (cfg.unimplemented_keys or cfg.ignored_keys) and dist.get_rank() == 0:  # once per job
        warnings.warn(unimplemented_message(cfg.unimplemented_keys, cfg.ignored_keys),
                      ZeroTrainConfigWarning, stacklevel=_user_stacklevel())
    if (not cfg.zero_optimization.ignore_unused_parameters and dist.get_rank() == 0
            and stage_class(cfg.zero_optimization.stage).partitions_parameters):
        warnings.warn("zero_optimization.ignore_unused_parameters false has no effect at stage "
                      "3 (the unused-parameter check runs at stages 0-2, where DeepSpeed's "
                      "runs too)", ZeroTrainConfigWarning, stacklevel=_user_stacklevel())
    device = _device()   # before the communicator: it reads the current CUDA device
    comm = Communicator(debug=cfg.debug)
    comm = comm.with_topology(comm.discover_topology())   # nodes, from torchrun's env
    # torch_autocast: every gradient reduced in the parameters' dtype (engine/autocast.py,
    # Note "what is honoured"), whatever communication_data_type says, as DeepSpeed's does
    policy = PrecisionPolicy.from_names(
        cfg.precision, cfg.grad_accum_dtype,
        None if cfg.torch_autocast.enabled else cfg.comm_dtype, cfg.master_dtype)
    check_recorded(model, cfg.tensor_parallel.size, policy.param_dtype)   # tp_model_init
    cfg = _check_sections(cfg, optimizer, lr_scheduler)
    held = open_stage_of(model)
    if held is not None:   # Note: one open engine per model (engine/ownership.py)
        if dist.get_rank() == 0:
            warnings.warn(f"this model (parameter {held[0]!r}) is trained by an open zerotrain "
                          "engine: initialize() closes that engine and takes the model over; "
                          "the earlier engine refuses further training",
                          ZeroTrainConfigWarning, stacklevel=_user_stacklevel())
        release_model(model)
    if optimizer is not None:
        refuse_offloaded_client_optimizer(cfg, optimizer)   # before, as in DeepSpeed
        refuse_fp32_cpu_adam_states(cfg, optimizer)
        check_client_optimizer(optimizer, allow_untested=cfg.zero_allow_untested_optimizer)
    inference = optimizer is None and cfg.optimizer is None   # an engine for forward only
    if "activation_checkpointing" in cfg.raw:  # as deepspeed.checkpointing.configure would
        recompute.configure(None, deepspeed_config=cfg)

    check_autocast_reduction(cfg, model)   # torch_autocast: before anything is built
    adopt(cfg.zero_optimization.stage, model, comm)   # stages 0-2 train full parameters
    model = _place_module(model, device, policy.param_dtype)
    check_same_across_ranks(comm, fingerprint(model, cfg))
    if comm.world_size > 1:  # partitioned parameters were broadcast by zero.Init
        for tensor in [p for p in model.parameters() if not is_partitioned(p)] + list(
                model.buffers()):
            comm.broadcast(tensor.data, src=0)
        comm.ledger.reset()

    if cfg.tensor_parallel.size > 1 and model_parameters is not None:
        model_parameters = list(model_parameters)   # its split parameters are replaced
    plan = _split_tensor_parallel(model, cfg, comm, optimizer, model_parameters)
    stage_comm = comm if plan is None else plan.mesh.dp   # ZeRO over data parallel only
    # Ulysses: ZeRO over every rank, gradients averaged over the N/S data-parallel ones
    average_over = use_sequence_mesh(mpu, cfg.sequence_parallel_size, comm)
    muon = None if inference else muon_setup.check_and_tag(cfg, optimizer, model)
    groups = [] if inference else trainable_groups(model, optimizer, model_parameters, muon)
    names = {id(p): n for n, p in model.named_parameters()}
    stage = build_stage(
        cfg.zero_optimization.stage, module=model,
        groups=[([names[id(p)] for p in g["params"]], g["params"]) for g in groups],
        comm=stage_comm, policy=policy, zero_config=cfg.zero_optimization,
        make_optimizer=(no_optimizer if inference
                        else optimizer_factory(cfg, optimizer, groups, device)),
        average_over=average_over)
    muon_setup.bind(stage, model)   # Muon's matrices in the shards (muon/sharded.py)
    if plan is not None:
        stage = TensorParallelStage(stage, plan, model)

    scheduler = scheduler_for(cfg, lr_scheduler, stage.optimizer)
    loader = None
    if training_data is not None:
        loader = DistributedLoader(training_data,
                                   micro_batch_size=cfg.train_micro_batch_size_per_gpu,
                                   rank=stage_comm.rank, world_size=stage_comm.world_size,
                                   collate_fn=collate_fn)
    engine = ZeroEngine(model, config=cfg, comm=comm, stage=stage, policy=policy,
                        lr_scheduler=scheduler, training_dataloader=loader)
    register_engine(engine, model.parameters())   # for zerotrain.utils.safe_get_full_*
    auto_resume(engine, cfg)
    if cfg.compile.enabled:
        engine.compile(backend=cfg.compile.backend, fallback=cfg.compile.fallback,
                       **cfg.compile.kwargs)
    return engine, None if inference else engine.optimizer, loader, scheduler


# ---------------------------------------------------------------------- helpers
def _split_tensor_parallel(model: nn.Module, cfg: ZeroTrainConfig, comm: Communicator,
                           optimizer, model_parameters) -> "Optional[TensorParallelPlan]":
    """With ``tensor_parallel.autotp_size`` T > 1: the mesh, and the model's layers split
    over it (``tp/apply.py``), after rank 0's weights were broadcast so every rank cuts
    its slice from the same tensors. The client optimizer's and ``model_parameters``'
    references to a split parameter are moved to its slice. None without it."""
    size = cfg.tensor_parallel.size
    if size == 1:
        return None
    if stage_class(cfg.zero_optimization.stage).partitions_parameters:
        check_stage3(cfg.zero_optimization, model, size)   # tp/zero3.py: cut, then stage 3
        if any(is_partitioned(p) for p in model.parameters()):
            # a zero.Init model (partitioned over the world) is made whole, then cut; stage
            # 3 then partitions the slices over the data-parallel group (each rank holds the
            # whole model in between, as at stages 0-2 under zero.Init)
            unpartition(model.parameters(), comm)
    before = dict(model.named_parameters())
    plan = parallelize(model, build_mesh(comm, size), cfg.tensor_parallel)
    after = dict(model.named_parameters())
    moved = {id(p): after[n] for n, p in before.items() if after.get(n) is not p}
    holders = ([g for g in optimizer.param_groups] if optimizer is not None else []) + (
        [g for g in model_parameters if isinstance(g, dict)]
        if isinstance(model_parameters, list) else [])
    for group in holders:
        group["params"] = [moved.get(id(p), p) for p in group["params"]]
    if isinstance(model_parameters, list):
        model_parameters[:] = [moved.get(id(p), p) if isinstance(p, torch.Tensor) else p
                               for p in model_parameters]
    return plan


def _user_stacklevel() -> int:
    """``stacklevel`` for a warning issued here that names the first caller frame outside
    zerotrain and the Hugging Face Trainer (which calls initialize() for the user)."""
    files = [getattr(sys.modules.get(n), "__file__", None)
             for n in ("zerotrain", "transformers", "accelerate")]
    dirs = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in files if f)
    frame: Optional[types.FrameType] = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(dirs):
        frame, level = frame.f_back, level + 1
    return level


def _config_source(args, config, config_params):
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    given = [c for c in (config, config_params, from_args) if c is not None]
    if len(given) > 1:
        raise ConfigError("config", "the config was given more than once (config=, "
                          "config_params= and args.deepspeed_config); pass exactly one")
    if not given:
        raise ConfigError("config", "no config: pass config= (a dict or a JSON path) or "
                          "--deepspeed_config")
    return given[0]


def _comms_timeout(source) -> Optional[datetime.timedelta]:
    """``comms_timeout`` (seconds) for the process group, read before full validation; None
    when the config does not set it (invalid values are reported by load_config right
    after)."""
    value = read_config_dict(source).get("comms_timeout")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(
            value) and 0 < value <= 31_536_000:
        return datetime.timedelta(seconds=value)
    return None


def _check_sections(cfg: ZeroTrainConfig, optimizer, lr_scheduler) -> ZeroTrainConfig:
    """The config with the sections ``initialize``'s arguments replace: a client optimizer
    or scheduler wins over the config's section, as in DeepSpeed, with a warning naming
    the section set aside."""
    ignored = [name for name, client, section in (
        ("optimizer", optimizer, cfg.optimizer), ("scheduler", lr_scheduler, cfg.scheduler))
        if client is not None and section is not None]
    if ignored and dist.get_rank() == 0:
        warnings.warn("the config's " + " and ".join(repr(n) for n in ignored)
                      + (" sections are" if len(ignored) > 1 else " section is")
                      + " not used: initialize() was given "
                      + " and ".join(f"{n}=" if n == "optimizer" else "lr_scheduler="
                                     for n in ignored) + ", which take precedence",
                      ZeroTrainConfigWarning, stacklevel=_user_stacklevel())
    if ignored:
        cfg = cfg.model_copy(update={n: None for n in ignored})
    if optimizer is None and cfg.optimizer is None and (
            lr_scheduler is not None or cfg.scheduler is not None):
        raise ConfigError("optimizer", "missing, but a scheduler needs one: add an "
                          "'optimizer' section to the config or pass initialize(optimizer=...)")
    return cfg


def release_model(model: nn.Module) -> bool:
    """Close the open engine that trains ``model``, if any, so that a new one can
    (collective when it closes one: every rank calls it). True when one was closed."""
    held = open_stage_of(model)
    if held is None:
        return False
    claimed = claim_of(held[1])
    engine = claimed.holder() if claimed is not None else None
    if engine is not None:
        engine.close()   # waits for its asynchronous save too
    else:
        held[1].settle()
        close_stage(held[1], model)
    return True


def _device() -> torch.device:
    """This rank's training device (Note: the training device, in ``comm/setup.py``); a group the
    user created without ``set_device`` would leave every rank on ``cuda:0``, so set it."""
    device = select_device(group_backends())
    if device.type == "cuda" and torch.cuda.current_device() != device.index:
        torch.cuda.set_device(device)
    return device


def _place_module(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Move to the device, cast floating parameters and buffers, make parameters contiguous.

    Parameters partitioned by ``zero.Init`` keep their chunks; the stage moves and casts
    those as it builds its shards.
    """
    model = model.to(device=device)
    if dtype != torch.float32:
        model = model.to(dtype=dtype)
    for p in model.parameters():
        if not p.is_contiguous():
            p.data = p.data.contiguous()
    return model
