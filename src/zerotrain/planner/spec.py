"""What the planner plans: one training configuration (:class:`StepSpec`), the model it
names, its DeepSpeed config, and the traced peak (:class:`StepPeak`).

Why a module of its own: the command line, ``--fit`` and the suite build and compare these
records without tracing anything; keeping them apart from the trace keeps both short.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch

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
    tp: int = 1                    # tensor_parallel.autotp_size
    optimizer: str = "adam"        # adam (AdamW) | muon (Muon: one momentum per matrix
    #                                element, AdamW's two moments for the rest)
    # bf16.bf16_master_weights_and_grads with bf16_optimizer_states (stages 1-3, bf16)
    bf16_states: bool = False

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
                "tensor_parallel_size": s.tp,
                "peak_bytes_per_rank": self.device_bytes,
                "peak_host_bytes_per_node": self.host_bytes * s.gpus,
                "peak_at": self.where, "breakdown": dict(self.breakdown),
                "phase_peaks": dict(self.phase_peaks)}


# --------------------------------------------------------------------------- the model
def _hf_config(path: str):
    import transformers

    from ..estimate.models import read_model_config   # the one opener's checks
    raw, _ = read_model_config(path)
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
    (the planner builds it under ``FakeTensorMode``). A config.json of an encoder-decoder
    (T5, BART) gives the sequence-to-sequence head; any other the causal-LM head where
    transformers has one, else the masked-LM head (BERT). Note "the
    inputs of a traced step" in ``trace.py`` says what the model is called with."""
    dtype = _DTYPES[spec.dtype]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        if os.path.isdir(spec.model):
            return build_model(replace(spec, model=os.path.join(spec.model, "config.json")))
        if spec.model.endswith(".json") or os.path.isfile(spec.model):
            import transformers

            config = _hf_config(spec.model)
            heads = [transformers.AutoModelForCausalLM, transformers.AutoModelForMaskedLM]
            # an encoder-decoder trains both stacks (BART also has a decoder-only causal LM)
            seq2seq = getattr(config, "is_encoder_decoder", False)
            heads.insert(0 if seq2seq else 2, transformers.AutoModelForSeq2SeqLM)
            for auto in heads:
                try:
                    return auto.from_config(config)
                except ValueError:
                    continue
            raise ValueError(f"{spec.model}: no causal-LM, masked-LM or sequence-to-sequence "
                             f"head for {type(config).__name__}")
        if ":" in spec.model:
            from ..estimate.models import _load_callable

            return _load_callable(spec.model)()
        raise ValueError(f"{spec.model!r} is neither a config.json file nor module:callable")
    finally:
        torch.set_default_dtype(previous)


def shape_of_config(path: str):
    """The :class:`~zerotrain.estimate.models.ModelShape` of a config.json whose layout the
    estimate's arithmetic does not count (an encoder-decoder, say): the model transformers
    builds from it (the head of :func:`build_model`) on the meta device, counted."""
    from ..estimate.models import shape_from_module

    with torch.device("meta"):
        model = build_model(StepSpec(path, dtype="fp32"))
    return shape_from_module(model, f"{type(model).__name__} built from {path} on the meta "
                                    "device")


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
        "optimizer": ({"type": "Muon", "params": {"lr": 1e-4}} if spec.optimizer == "muon"
                      else {"type": "AdamW", "params": {"lr": 1e-4}}),
    }
    if spec.dtype in ("bf16", "fp16"):
        config[spec.dtype] = {"enabled": True}
    if spec.bf16_states:
        config["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": True,
                          "bf16_optimizer_states": True}
    if spec.tp > 1:
        config["tensor_parallel"] = {"autotp_size": spec.tp}
    return config


def check_tensor_parallel(spec: StepSpec) -> None:
    """ValueError naming the option when ``spec.tp`` cannot be traced: a size that does not
    divide the world. Stage 3 traces as stages 0-2 do; what ``initialize`` refuses with
    tensor parallelism at stage 3 (``tp/zero3.py``) the planner's configs never set."""
    from ..estimate.tensor_parallel import check_tp_size

    check_tp_size(spec.tp, spec.world)
