"""Predict the peak memory of one training step on a rank by running the real engine on
fake tensors.

Why a trace and not a formula: a formula drifts from the engine (bucket sizes, the stage-3
prefetch window, the persistence threshold, the flat buffers and their padding, what
autograd saves). Here ``zerotrain.initialize`` and one forward, backward and optimizer step
run for real, in this one process, as rank 0 of a world of N over torch's fake process
group (collectives return at once), under ``FakeTensorMode`` (no memory is allocated, a
storage still reports its bytes); :class:`~zerotrain.estimate.peak.PeakTracker` adds up the
live storages after every operation. The same :func:`run_step` measured with real tensors
on N gloo ranks is what the suite compares the prediction with (tests/dist/test_planner.py).

The fake process group carries no data, and the communicator knows it (Note "a traced
world" in ``comm/communicator.py``): an ``all_gather_object`` answers this rank's object for
every rank, and the checks that compare ranks (the step fingerprint, the stage-3 gather
headers) have nobody to disagree with. One thing is adapted for fake tensors, local to
:func:`fake_world`: ``Module.to`` that changes nothing returns the module as it is (torch
swaps fake parameters otherwise, which the fake mode's own references forbid); the model is
built in the training dtype so that no cast is left to do.

Note: the backend's own buffers
    A fake collective completes at once and allocates nothing, but a real backend may hold
    memory of its own while a collective is in flight. Gloo (the host) runs a
    reduce-scatter as an all-reduce of a copy of the whole input and cuts this rank's part
    out of it when the work is waited for: a second buffer of the gradient bucket's size,
    alive from the launch to the wait. At stages 1-3 that copy is what made the traced peak
    of a CPU run up to 11% low (the staging bucket, its copy and the backward's own
    products alive together). ``StepSpec.backend="gloo"`` makes the fake world's
    reduce-scatter hold such a copy until its wait; NCCL (the default) reduces in place
    from the input, and what it allocates itself is not the caching allocator's.
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Optional

import torch

from .estimate.peak import PeakTracker

__all__ = ["BACKENDS", "PlanError", "StepSpec", "StepPeak", "build_model",
           "counting_gloo_copies", "ds_config_for", "fit", "plan_peak", "predict_engine_peak",
           "run_step"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_HOST_PREFIXES = ("host_", "nvme_")
BACKENDS = ("nccl", "gloo")


class PlanError(RuntimeError):
    """The step could not be traced (a model the fake tensors cannot run)."""


@dataclass(frozen=True)
class StepSpec:
    """One training configuration: the model (a config.json path or ``module:callable``),
    the batch shape, the world and the ZeRO options."""

    model: str
    micro_batch: int = 1
    seq_len: int = 128
    gpus: int = 1
    nodes: int = 1
    stage: int = 3
    offload: str = "none"          # none | cpu | nvme (the optimizer state)
    dtype: str = "bf16"
    activation_checkpointing: bool = False
    gradient_accumulation: int = 1
    backend: str = "nccl"          # nccl | gloo (Note: the backend's own buffers)

    @property
    def world(self) -> int:
        return self.gpus * self.nodes


@dataclass
class StepPeak:
    """The peak of one step on one rank: bytes, the phase it happened in, and what was
    alive then by category (model states by the stage's own categories; the rest by the
    phase that made it: activations in forward, temporaries in backward or step)."""

    spec: StepSpec
    peak_bytes: int
    where: str
    breakdown: dict[str, int] = field(default_factory=dict)
    phase_peaks: dict[str, int] = field(default_factory=dict)

    @property
    def host_bytes(self) -> int:
        """Bytes at the peak in host-side categories (offloaded state)."""
        return sum(v for k, v in self.breakdown.items() if k.startswith(_HOST_PREFIXES))

    @property
    def device_bytes(self) -> int:
        return self.peak_bytes - self.host_bytes

    def to_json(self) -> dict:
        s = self.spec
        return {"model": s.model, "world_size": s.world, "stage": s.stage,
                "offload": s.offload, "dtype": s.dtype, "micro_batch": s.micro_batch,
                "seq_len": s.seq_len, "activation_checkpointing": s.activation_checkpointing,
                "gradient_accumulation": s.gradient_accumulation, "backend": s.backend,
                "peak_bytes_per_rank": self.device_bytes,
                "peak_host_bytes_per_node": self.host_bytes * s.gpus,
                "peak_at": self.where, "breakdown": dict(self.breakdown),
                "phase_peaks": dict(self.phase_peaks)}


# --------------------------------------------------------------------------- the model
def _hf_config(path: str):
    import transformers

    with open(path, encoding="utf-8") as handle:
        raw = json.load(handle)
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ValueError(f"{path}: not a Hugging Face config.json (no 'model_type' key)")
    raw = dict(raw)
    model_type = raw.pop("model_type")
    try:
        return transformers.AutoConfig.for_model(model_type, **raw)
    except ValueError as exc:
        raise ValueError(f"{path}: transformers does not know model_type "
                         f"{model_type!r} ({exc})") from None


def build_model(spec: StepSpec) -> torch.nn.Module:
    """The model of ``spec.model`` in the training dtype, on the current device context
    (the planner builds it under ``FakeTensorMode``). A config.json gives the causal-LM
    head where transformers has one and the masked-LM head otherwise (BERT)."""
    dtype = _DTYPES[spec.dtype]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        if os.path.isdir(spec.model):
            return build_model(replace(spec, model=os.path.join(spec.model, "config.json")))
        if spec.model.endswith(".json") or os.path.isfile(spec.model):
            import transformers

            config = _hf_config(spec.model)
            for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForMaskedLM):
                try:
                    return auto.from_config(config)
                except ValueError:
                    continue
            raise ValueError(f"{spec.model}: no causal-LM or masked-LM head for "
                             f"{type(config).__name__}")
        if ":" in spec.model:
            from .estimate.models import _load_callable

            return _load_callable(spec.model)()
        raise ValueError(f"{spec.model!r} is neither a config.json file nor module:callable")
    finally:
        torch.set_default_dtype(previous)


def _vocab(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    return int(getattr(config, "vocab_size", 0) or 256)


def ds_config_for(spec: StepSpec) -> dict:
    """The DeepSpeed config of ``spec`` (what ``--write`` saves)."""
    zero: dict[str, Any] = {"stage": spec.stage}
    if spec.offload != "none":
        zero["offload_optimizer"] = ({"device": "cpu"} if spec.offload == "cpu" else
                                     {"device": "nvme", "nvme_path": "/local_nvme"})
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": spec.micro_batch,
        "gradient_accumulation_steps": spec.gradient_accumulation,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    }
    if spec.dtype in ("bf16", "fp16"):
        config[spec.dtype] = {"enabled": True}
    return config


# --------------------------------------------------------------------------- one step
# Two steps: the optimizer's moments appear in the first step, so the second step (and every
# later one) carries them through its forward and backward; the peak of training is the
# second step's, never lower than the first's.
STEPS = 2


def run_step(spec: StepSpec, model: torch.nn.Module, tracker: PeakTracker,
             config: Optional[dict] = None) -> tuple[Any, dict[str, int]]:
    """``initialize``, then :data:`STEPS` forward, backward and optimizer steps under
    ``tracker``; returns the engine and the peak bytes within each phase. The process group
    must exist."""
    from .initialize import initialize

    if spec.activation_checkpointing:
        if not hasattr(model, "gradient_checkpointing_enable"):
            raise ValueError(f"{spec.model}: activation checkpointing needs a model with "
                             "gradient_checkpointing_enable() (a transformers model)")
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):   # transformers >= 5.x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    vocab = _vocab(model)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (spec.micro_batch, spec.seq_len), generator=gen)
    with tracker:
        tracker.add_existing(list(model.parameters()) + list(model.buffers()))
        tracker.phase = "initialize"
        engine, *_ = initialize(model=model, config=config or ds_config_for(spec))
        for _ in range(STEPS):
            tracker.phase = "forward"
            out = engine(input_ids=ids, labels=ids)
            loss = out.loss if hasattr(out, "loss") else out
            del out
            tracker.phase = "forward end"   # what the forward leaves for backward
            tracker._record()
            tracker.phase = "backward"
            engine.backward(loss)
            del loss
            tracker.phase = "step"
            engine.step()
        tracker.phase = "after"
    return engine, dict(tracker.phase_peaks)


def breakdown_at_peak(tracker: PeakTracker, engine: Any) -> dict[str, int]:
    """The storages alive at the peak by category (the engine's categories for what it
    still holds, the phase that made it for the rest)."""
    held = dict(engine.stage.tensors_by_category())
    held.setdefault("parameters", [])
    held["parameters"] = list(engine.module.parameters()) + list(held["parameters"])
    held["buffers"] = list(engine.module.buffers())
    known = tracker.category_of(held)
    names = {"forward": "activations", "forward end": "activations",
             "backward": "temporaries (backward)",
             "step": "temporaries (step)", "initialize": "temporaries (initialize)",
             "before": "model as built"}
    out: dict[str, int] = {}
    for key, (nbytes, phase) in tracker.at_peak.items():
        category = known.get(key) or names.get(phase, phase)
        out[category] = out.get(category, 0) + nbytes
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


# --------------------------------------------------------------------------- fake world
class _HeldCopy:
    """A collective's work that keeps the backend's copy of its input until it is waited
    for (Note: the backend's own buffers)."""

    __slots__ = ("_work", "_copy")

    def __init__(self, work: Any, held: torch.Tensor) -> None:
        self._work, self._copy = work, held

    def wait(self, *args, **kwargs):
        done = self._work.wait(*args, **kwargs)
        self._copy = None
        return done

    def is_completed(self) -> bool:
        return self._work.is_completed()


def _copying_reduce_scatter(reduce_scatter: Callable) -> Callable:
    """``reduce_scatter`` as gloo runs it: on a copy of the input, alive until the wait."""
    def launch(output, input, group=None, async_op=False, **kwargs):
        held = input.clone()
        work = reduce_scatter(output, input, group=group, async_op=async_op, **kwargs)
        return _HeldCopy(work, held) if async_op else work
    return launch


class _CountedCopy:
    """A real gloo reduce-scatter's work, its copy of the input counted by a tracker from
    the launch until the wait begins (from there the tracker sees the buffer itself: the
    wait cuts this rank's part out of it)."""

    __slots__ = ("_work", "_tracker", "_key")

    def __init__(self, work: Any, tracker: PeakTracker, nbytes: int) -> None:
        self._work, self._tracker, self._key = work, tracker, ("gloo copy", id(self))
        tracker.hold(self._key, nbytes)

    def wait(self, *args, **kwargs):
        self._tracker.release(self._key)
        return self._work.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        return self._work.is_completed()


@contextlib.contextmanager
def counting_gloo_copies(tracker: PeakTracker) -> Iterator[None]:
    """For a measurement on real gloo ranks: count each asynchronous reduce-scatter's copy
    of its input (Note: the backend's own buffers), which gloo makes in C++ where no
    dispatch mode sees it, from its launch. Measured by the process's resident memory: a
    200 MB reduce-scatter on 2 gloo ranks adds 200 MB at the launch, freed with its work."""
    from .comm import communicator

    saved = communicator._reduce_scatter

    def launch(output, input, group=None, async_op=False, **kwargs):
        work = saved(output, input, group=group, async_op=async_op, **kwargs)
        if not async_op:
            return work
        return _CountedCopy(work, tracker, input.numel() * input.element_size())
    communicator._reduce_scatter = launch
    try:
        yield
    finally:
        communicator._reduce_scatter = saved


@contextlib.contextmanager
def fake_world(rank: int, world: int, backend: str = "nccl") -> Iterator[Any]:
    """Rank ``rank`` of ``world`` over torch's fake process group, under ``FakeTensorMode``
    (both undone on exit), its collectives holding what ``backend``'s would (Note: the
    backend's own buffers); yields the mode."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .comm import communicator

    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    if dist.is_initialized():
        raise RuntimeError("the planner needs a process without a process group (it runs "
                           "rank 0 of a fake one)")
    saved_apply, saved_scatter = torch.nn.Module._apply, communicator._reduce_scatter

    def apply(self, fn: Callable, recurse: bool = True):
        with torch.no_grad():
            if all(fn(t) is t for t in list(self.parameters()) + list(self.buffers())):
                return self
        return saved_apply(self, fn, recurse)

    env = {k: os.environ.get(k) for k in ("LOCAL_WORLD_SIZE", "GROUP_RANK", "LOCAL_RANK")}
    os.environ.update(LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", LOCAL_RANK=str(rank))
    torch.nn.Module._apply = apply
    if backend == "gloo":
        communicator._reduce_scatter = _copying_reduce_scatter(saved_scatter)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            yield mode
    finally:
        dist.destroy_process_group()
        torch.nn.Module._apply = saved_apply
        communicator._reduce_scatter = saved_scatter
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _FakeTracker(PeakTracker):
    """A :class:`PeakTracker` for fake tensors: a scalar read (``.item()``: the gradient
    norm, the overflow check) has no data to read, so it answers 1.0 (0 for integers, False
    for booleans): no overflow, a unit norm. The step's allocations are assumed not to depend
    on those values (docs/BENCHMARKS.md says how close fake and real steps come)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            dtype = args[0].dtype
            return False if dtype is torch.bool else (1.0 if dtype.is_floating_point else 0)
        return super().__torch_dispatch__(func, types, args, kwargs)


def plan_peak(spec: StepSpec) -> StepPeak:
    """The predicted peak of one step of ``spec`` on rank 0 (no memory allocated)."""
    tracker = _FakeTracker()
    with fake_world(0, spec.world, spec.backend):
        model = build_model(spec)
        try:
            engine, phases = run_step(spec, model, tracker)
        except (ValueError, OSError):
            raise
        except Exception as exc:   # noqa: BLE001 - any failure of the traced step
            raise PlanError(f"{spec.model}: the step could not be traced on fake tensors "
                            f"({type(exc).__name__}: {str(exc).splitlines()[0][:300]}); "
                            "a model whose shapes depend on its data (mixture-of-experts "
                            "routing, nonzero) cannot be traced") from exc
        breakdown = breakdown_at_peak(tracker, engine)
        with contextlib.suppress(Exception):
            engine.destroy()
    return StepPeak(spec, tracker.peak, tracker.where, breakdown, phases)


# --------------------------------------------------------------------------- --fit
# Fastest first: no offload before offload (a host step), no recomputation before
# activation checkpointing (a third more compute), a larger micro-batch before a smaller
# one (fuller kernels, fewer steps), then the lowest stage (stage 3 gathers parameters
# twice a step; stages 0-2 move the same bytes, the lower with less bookkeeping).
def candidates(base: StepSpec, global_micro: int) -> Iterator[StepSpec]:
    """Configurations in the order they are tried, each keeping ``micro_batch *
    gradient_accumulation == global_micro`` per rank."""
    batches = [b for b in range(global_micro, 0, -1) if global_micro % b == 0]
    for offload in ("none", "cpu"):
        for ac in (False, True):
            for b in batches:
                for stage in (0, 1, 2, 3):
                    yield replace(base, stage=stage, offload=offload,
                                  activation_checkpointing=ac, micro_batch=b,
                                  gradient_accumulation=global_micro // b)


def fit(base: StepSpec, device_budget: int, host_budget: Optional[int] = None,
        *, log: Optional[Callable[[StepPeak], None]] = None) -> Optional[StepPeak]:
    """The first configuration of :func:`candidates` whose predicted peak fits ``device_budget``
    bytes per rank (and ``host_budget`` per node when given); None when none does."""
    global_micro = base.micro_batch * base.gradient_accumulation
    smallest = replace(base, stage=3, offload="cpu", activation_checkpointing=True,
                       micro_batch=1, gradient_accumulation=global_micro)
    if not _fits(plan_peak(smallest), device_budget, host_budget):
        return None   # the least memory there is does not fit: no need to try the rest
    for spec in candidates(base, global_micro):
        result = plan_peak(spec)
        if log is not None:
            log(result)
        if _fits(result, device_budget, host_budget):
            return result
    return None


def _fits(result: StepPeak, device_budget: int, host_budget: Optional[int]) -> bool:
    host_ok = host_budget is None or result.host_bytes * result.spec.gpus <= host_budget
    return result.device_bytes <= device_budget and host_ok


# --------------------------------------------------------------------------- a live engine
def predict_engine_peak(engine: Any, build: Callable[[], torch.nn.Module],
                        batch: tuple, config: dict) -> int:
    """The predicted peak of a step of ``engine`` on this rank, for the model ``build()``
    makes, trained with the DeepSpeed ``config`` on micro-batches shaped like ``batch``
    (the forward's positional tensors; the output, or its ``.loss``, is the loss). Cached on
    the engine: ``engine.memory_breakdown()`` reports it as peak_predicted, beside the
    peak_measured of ``engine.measure_peak()``.

    Why a process of its own: the trace runs rank 0 of a fake world, and a process that
    trains already has a process group; a spawned process (fresh interpreter, no group)
    traces :data:`STEPS` steps of a model built on fake tensors, so nothing is allocated and
    the training state is left alone. ``build`` must be picklable (a class, a
    ``functools.partial``). Every rank of a symmetric run gets the same figure; ranks call
    it alone, it runs no collective."""
    cached = getattr(engine, "_peak_predicted", None)
    if cached is not None:
        return cached
    import pickle
    import subprocess
    import sys

    shapes = [(tuple(t.shape), t.dtype) for t in batch]
    backend = "gloo" if engine.device.type == "cpu" else "nccl"
    args = pickle.dumps((build, config, engine.world_size, shapes, backend))
    env = {k: v for k, v in os.environ.items()   # the trainer's world, not the traced one
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    done = subprocess.run([sys.executable, "-c", _CHILD], input=args, env=env,
                          capture_output=True, check=False)
    if done.returncode != 0:
        raise PlanError("the step could not be traced on fake tensors: "
                        + done.stderr.decode(errors="replace").strip()[-2000:])
    engine._peak_predicted = int(done.stdout.decode().split()[-1])
    return engine._peak_predicted


# A plain subprocess, not multiprocessing: a rank may run in a daemonic process, which
# multiprocessing forbids to have children.
_CHILD = ("import pickle, sys; from zerotrain.planner import _trace_built; "
          "print(_trace_built(*pickle.load(sys.stdin.buffer)))")


def _on_fake_tensors(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (built on meta or real tensors) with fresh fake parameters and buffers of
    the same shapes, tied parameters kept tied (``Module.to_empty`` cannot swap them under
    the fake mode)."""
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                if id(p) not in made:
                    made[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype),
                                                     p.requires_grad)
                module._parameters[name] = made[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype)
    return model


def _trace_built(build: Callable[[], torch.nn.Module], config: dict, world: int,
                 shapes: list, backend: str) -> int:
    """In the spawned process of :func:`predict_engine_peak`: the traced peak."""
    from .initialize import initialize

    tracker = _FakeTracker()
    with fake_world(0, world, backend):
        with torch.device("meta"):
            model = build()
        model = _on_fake_tensors(model)
        batch = [torch.zeros(shape, dtype=dtype) for shape, dtype in shapes]
        with tracker:
            tracker.add_existing(list(model.parameters()) + list(model.buffers()))
            tracker.phase = "initialize"
            engine, *_ = initialize(model=model, config=config)
            for _ in range(STEPS):
                tracker.phase = "forward"
                out = engine(*batch)
                loss = out.loss if hasattr(out, "loss") else out
                del out
                tracker.phase = "backward"
                engine.backward(loss)
                del loss
                tracker.phase = "step"
                engine.step()
        with contextlib.suppress(Exception):
            engine.destroy()
    return tracker.peak
