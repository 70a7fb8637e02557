"""One step traced on fake tensors (:func:`plan_peak`), and ``--fit``'s search for the
fastest configuration whose traced peak fits a budget.

Why a module of its own: it is the planner's one procedure, ``initialize`` and
:data:`STEPS` steps of the real engine under a :class:`PeakTracker`; the same
:func:`run_step` measured on real gloo ranks is what the suite compares it with.
"""
from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, Callable, Iterator, Optional

import torch

from ..estimate.peak import PeakTracker
from .fake_world import _FakeTracker, fake_world
from .spec import (PlanError, StepPeak, StepSpec, _vocab, build_model,
                   check_tensor_parallel, ds_config_for)


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
    from ..estimate.models import check_positions, position_table
    from ..engine.build import initialize

    table = position_table(model)   # fake tensors look no position up: refuse it here
    if table is not None:
        check_positions(spec.seq_len, table[1], f"{spec.model}: its position table {table[0]}")
    if spec.activation_checkpointing:
        if not hasattr(model, "gradient_checkpointing_enable"):
            raise ValueError(f"{spec.model}: activation checkpointing needs a model with "
                             "gradient_checkpointing_enable() (a transformers model)")
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):   # transformers >= 5.x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    inputs = step_inputs(spec, model)
    with tracker:
        tracker.add_existing(list(model.parameters()) + list(model.buffers()))
        tracker.phase = "initialize"
        engine, *_ = initialize(model=model, config=config or ds_config_for(spec))
        for _ in range(STEPS):
            tracker.phase = "forward"
            out = engine(**inputs)
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


def step_inputs(spec: StepSpec, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Note: the inputs of a traced step
        A model is called as ``model(input_ids=ids, labels=ids)``, ``ids`` a LongTensor
        ``[micro_batch, seq_len]`` of token ids below ``model.config.vocab_size`` (256 for
        a model without one), and its output's ``.loss`` (or the output itself) is the
        loss backward starts from. An encoder-decoder (``config.is_encoder_decoder``: T5,
        BART) also gets ``decoder_input_ids``, the labels shifted right by one behind
        ``decoder_start_token_id`` (0 when the config has none), so encoder and decoder
        both see ``seq_len`` tokens. A ``module:callable`` model gets the same keyword
        arguments, so its ``forward`` must take ``input_ids`` and ``labels``."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, _vocab(model), (spec.micro_batch, spec.seq_len), generator=gen)
    inputs = {"input_ids": ids, "labels": ids}
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        start = getattr(config, "decoder_start_token_id", None)
        start = 0 if start is None else int(start)
        shifted = torch.full_like(ids, start)
        shifted[:, 1:] = ids[:, :-1]
        inputs["decoder_input_ids"] = shifted
    return inputs


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


def plan_peak(spec: StepSpec) -> StepPeak:
    """The predicted peak of one step of ``spec`` on rank 0 (no memory allocated). With
    ``spec.tp`` T > 1, rank 0 holds its slice of each split layer, as in the real run."""
    check_tensor_parallel(spec)
    tracker = _FakeTracker()
    with fake_world(0, spec.world, spec.backend):
        try:
            model = build_model(spec)
        except (ValueError, OSError):
            raise
        except Exception as exc:   # noqa: BLE001 - transformers' or the user's own refusal
            raise ValueError(f"{spec.model}: the model could not be built ({type(exc).__name__}"
                             f": {_first_line(exc)})") from exc
        try:
            engine, phases = run_step(spec, model, tracker)
        except (ValueError, OSError):
            raise
        except Exception as exc:   # noqa: BLE001 - any failure of the traced step
            raise PlanError(f"{spec.model}: the step could not be traced on fake tensors "
                            f"({type(exc).__name__}: {_first_line(exc)}); "
                            "a model whose shapes depend on its data (mixture-of-experts "
                            "routing, nonzero) cannot be traced") from exc
        breakdown = breakdown_at_peak(tracker, engine)
        with contextlib.suppress(Exception):
            engine.destroy()
    return StepPeak(spec, tracker.peak, tracker.where, breakdown, phases)


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[0] if lines else type(exc).__name__)[:300]


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
                for stage in ((1, 2, 3) if base.bf16_states else (0, 1, 2, 3)):
                    yield replace(base, stage=stage, offload=offload,
                                  activation_checkpointing=ac, micro_batch=b,
                                  gradient_accumulation=global_micro // b)


def fit(base: StepSpec, device_budget: int, host_budget: Optional[int] = None,
        *, log: Optional[Callable[[StepPeak], None]] = None) -> Optional[StepPeak]:
    """The first configuration of :func:`candidates` whose predicted peak fits ``device_budget``
    bytes per rank (and ``host_budget`` per node when given); None when none does."""
    global_micro = base.micro_batch * base.gradient_accumulation
    smallest = replace(base, stage=3, offload="cpu",
                       activation_checkpointing=True, micro_batch=1,
                       gradient_accumulation=global_micro)
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
