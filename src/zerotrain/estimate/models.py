"""What the estimate needs to know about a model: its parameter count, its largest layer,
and the shape that sets activation memory.

Three sources: a plain count (``--params 7B``); a Hugging Face ``config.json`` of a GPT-2 or
Llama-style decoder, counted from its fields without building anything; or a
``module:callable`` returning an ``nn.Module``, built on the meta device so that no memory
is allocated and a 70B model "builds" in a second.

Note: activation memory
    Per transformer layer, with 16-bit activations and no tensor or sequence parallelism,
    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
    Models", eq. 2) count ``s*b*h*(34 + 5*a*s/h)`` bytes saved for backward, where s is the
    sequence length, b the micro-batch per GPU, h the hidden size and a the number of heads
    (the ``5as/h`` term is the attention score matrices; fused attention kernels avoid most
    of it, so this is an upper bound). With full activation checkpointing only each layer's
    input survives, ``2*s*b*h`` bytes per layer, plus one layer's full activations while it
    is recomputed. The logits of the last layer add ``4*s*b*V`` bytes (fp32 for the loss).
    fp32 training doubles the per-layer terms.

Note: sequence parallelism and tiling
    Ulysses sequence parallelism over S ranks (``sequence_parallel_size``, DeepSpeed's
    ALST) leaves each rank ``s/S`` tokens of every per-token activation; inside attention
    a rank holds the whole sequence for ``a/S`` heads, so the score term keeps one full
    ``s``: per layer ``(s/S)*b*h*(34 + 5*a*s/h)``. The all-to-all that swaps sequence for
    heads holds a send and a receive copy of q, k and v, ``12*(s/S)*b*h`` bytes, one layer
    at a time. A tiled MLP (``TiledMLP``) saves only its input, dropping the ``16*s*b*h``
    of its two intermediates per layer and adding one tile of them (DeepSpeed's tile is
    ``h`` tokens: ``16*b*h*h``) at a time. A tiled loss (``TiledFusedLogitsLoss`` over N
    tiles) keeps one tile of the logits, ``4*s*b*V/N``. Model states do not change: ZeRO
    shards them over all ranks, sequence-parallel ones included.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any, Mapping, Optional

from .. import untrusted

__all__ = ["MAX_DIMENSION", "ModelShape", "SequenceLengthError", "activation_bytes",
           "check_positions", "check_sequence_parallel", "position_table", "shape_from_hf_config", "shape_from_module",
           "shape_from_module_spec"]

# The largest value of any one model dimension in a config (hidden size, layers, heads,
# vocabulary, positions): 16M, far above any model trained; 4e9 would make figures and
# tensor shapes no step could run.
MAX_DIMENSION = 2**24


class SequenceLengthError(ValueError):
    """A sequence longer than the model's learned position table: the real step's position
    lookup raises IndexError, so no estimate of it is made."""

_GATED_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "olmo", "olmo2",
                             "granite", "phi3", "cohere", "stablelm", "internlm2", "yi",
                             "deepseek", "baichuan", "smollm3"})
_TIED_BY_DEFAULT = frozenset({"gemma"})  # Llama-style families whose head is tied unless said


@dataclass(frozen=True)
class ModelShape:
    """Parameter counts (elements) and, when known, the transformer shape."""

    total_params: int
    largest_layer_params: int
    hidden_size: Optional[int] = None
    num_layers: Optional[int] = None
    num_heads: Optional[int] = None
    vocab_size: Optional[int] = None
    description: str = ""
    max_positions: Optional[int] = None   # rows of a learned position table, when it has one
    positions_from: str = ""              # where max_positions comes from, for errors

    @property
    def has_transformer_shape(self) -> bool:
        return None not in (self.hidden_size, self.num_layers, self.num_heads, self.vocab_size)


def read_model_config(config: Any) -> tuple[dict, str]:
    """A model config (a mapping, or a config.json path read through the one opener) and
    where it came from; ValueError naming the file when it cannot be one."""
    if isinstance(config, Mapping):
        return dict(config), "config"
    path = os.fspath(config)
    try:   # the one opener: a FIFO would hang the estimate, /dev/zero exhaust its memory
        data = untrusted.read_json(path, what="model config", max_bytes=untrusted.CONFIG_MAX_BYTES,
                                   root=os.path.dirname(os.path.abspath(path)))
    except FileNotFoundError:
        raise ValueError(f"cannot read model config {path}: no such file") from None
    except untrusted.UnsafeFile as exc:
        raise ValueError(str(exc)) from None
    if not isinstance(data, dict):
        raise ValueError(f"model config {path} must hold a JSON object")
    return data, path


def _int(cfg: Mapping, *keys: str, default: Optional[int] = None) -> int:
    for key in keys:
        if cfg.get(key) is not None:
            return _dimension(key, cfg[key])
    if default is None:
        raise ValueError(f"model config has none of {', '.join(keys)}")
    return default


def _dimension(key: str, value: Any) -> int:
    """A config's dimension: a whole number in 1..``MAX_DIMENSION`` (4096.0 reads as 4096)."""
    whole = (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, float) and value.is_integer())
    if not whole:
        raise ValueError(f"model config {key} is {value!r}, not a whole number")
    if not 1 <= value <= MAX_DIMENSION:
        raise ValueError(f"model config {key} is {value!r}; it must lie in 1..{MAX_DIMENSION}")
    return int(value)


def _bounded(shape: ModelShape) -> ModelShape:
    """``shape``, or ValueError when it counts more than ``MAX_PARAMS`` parameters."""
    from .sizes import MAX_PARAMS, format_count

    if shape.total_params > MAX_PARAMS:
        raise ValueError(f"{shape.description}: {format_count(shape.total_params)} "
                         f"parameters, more than {format_count(MAX_PARAMS)}")
    return shape


def _gpt2(cfg: Mapping, where: str) -> ModelShape:
    """GPT-2 layout: learned positions, LayerNorms with bias, biased linears, tied head."""
    h, layers, heads = _int(cfg, "n_embd", "hidden_size"), _int(cfg, "n_layer"), _int(cfg, "n_head")
    vocab = _int(cfg, "vocab_size")
    positions = _int(cfg, "n_positions", "max_position_embeddings", default=1024)
    positions_key = next((k for k in ("n_positions", "max_position_embeddings")
                          if cfg.get(k) is not None), "n_positions (default)")
    inner = _int(cfg, "n_inner", default=4 * h)
    tied = bool(cfg.get("tie_word_embeddings", True))
    qkv, proj, fc, fc_out = 3 * h * h + 3 * h, h * h + h, h * inner + inner, inner * h + h
    per_layer = 2 * h + qkv + proj + 2 * h + fc + fc_out
    total = vocab * h + positions * h + layers * per_layer + 2 * h + (0 if tied else vocab * h)
    largest = max(vocab * h, positions * h, qkv, fc, fc_out)
    return ModelShape(total, largest, h, layers, heads, vocab, f"GPT-2 layout from {where}",
                      max_positions=positions, positions_from=f"{positions_key} in {where}")


def _llama(cfg: Mapping, where: str) -> ModelShape:
    """Llama layout: RMSNorms, grouped-query attention, gated MLP, head tied or not."""
    family = str(cfg.get("model_type", "")).lower()
    h, f = _int(cfg, "hidden_size"), _int(cfg, "intermediate_size")
    layers, heads = _int(cfg, "num_hidden_layers"), _int(cfg, "num_attention_heads")
    kv_heads = _int(cfg, "num_key_value_heads", default=heads)
    head_dim = _int(cfg, "head_dim", default=h // heads)
    vocab = _int(cfg, "vocab_size")
    tied = bool(cfg.get("tie_word_embeddings", family in _TIED_BY_DEFAULT))
    qkv_bias = bool(cfg.get("attention_bias", family == "qwen2"))
    o_bias, mlp_bias = bool(cfg.get("attention_bias", False)), bool(cfg.get("mlp_bias", False))
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = (h * q + 2 * h * kv + q * h + (q + 2 * kv if qkv_bias else 0)
                 + (h if o_bias else 0))
    mlp = 3 * h * f + (2 * f + h if mlp_bias else 0)
    total = vocab * h + layers * (attention + mlp + 2 * h) + h + (0 if tied else vocab * h)
    largest = max(vocab * h, h * f + (f if mlp_bias else 0), h * q)
    note = ("" if family in _GATED_FAMILIES
            else f" (model_type {family or 'unset'} counted as Llama-style)")
    return ModelShape(total, largest, h, layers, heads, vocab, f"Llama layout from {where}{note}")


def shape_from_hf_config(config: Any) -> ModelShape:
    """Count a Hugging Face ``config.json`` (a path or a dict) of a GPT-2 or Llama-style
    decoder. Raises ValueError for layouts it cannot count (encoders, mixtures of experts)."""
    cfg, where = read_model_config(config)
    if any(key in cfg for key in ("num_local_experts", "num_experts", "n_routed_experts")):
        raise ValueError(f"{where}: mixture-of-experts configs are not counted; pass "
                         "module:callable to build the model on the meta device instead")
    if "n_embd" in cfg or cfg.get("model_type") == "gpt2":
        return _bounded(_gpt2(cfg, where))
    if {"hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads"} <= cfg.keys():
        return _bounded(_llama(cfg, where))
    raise ValueError(f"{where}: cannot count model_type {cfg.get('model_type')!r}: expected "
                     "GPT-2 keys (n_embd, n_layer, n_head, vocab_size) or Llama-style keys "
                     "(hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, "
                     "vocab_size); pass module:callable instead")


def _load_callable(spec: str) -> Any:
    """``pkg.module:fn`` or ``path/to/file.py:fn`` -> the callable (cwd is importable)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{spec!r} is not module:callable (e.g. mypkg.models:build_model)")
    if module_name.endswith(".py"):
        file_spec = importlib.util.spec_from_file_location("_zerotrain_estimate_model",
                                                           module_name)
        if file_spec is None or file_spec.loader is None or not os.path.exists(module_name):
            raise ValueError(f"{spec!r}: no such file {module_name}")
        module = importlib.util.module_from_spec(file_spec)
        file_spec.loader.exec_module(module)
    else:
        sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"{spec!r}: cannot import {module_name}: {exc}") from None
        finally:
            sys.path.remove(os.getcwd())
    target = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{spec!r}: {module_name} has no attribute {attr}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{spec!r}: {attr} is not callable")
    return target


def _shape_fields(model: Any) -> dict:
    """hidden/layers/heads/vocab from ``model.config`` (HF) or ``model.cfg`` if present."""
    for name in ("config", "cfg"):
        cfg = getattr(model, name, None)
        if cfg is None:
            continue
        data = (cfg.to_dict() if hasattr(cfg, "to_dict") else asdict(cfg) if is_dataclass(cfg)
                else dict(vars(cfg)) if hasattr(cfg, "__dict__") else {})
        pick = {field: next((data[k] for k in keys if isinstance(data.get(k), int)), None)
                for field, keys in (("hidden_size", ("hidden_size", "n_embd", "d_model")),
                                    ("num_layers", ("num_hidden_layers", "n_layer",
                                                    "num_layers")),
                                    ("num_heads", ("num_attention_heads", "n_head",
                                                   "num_heads", "encoder_attention_heads")),
                                    ("vocab_size", ("vocab_size",)))}
        # an encoder-decoder: both stacks' layers (T5: num_layers + num_decoder_layers;
        # BART: encoder_layers + decoder_layers), counted as decoder layers
        stacks = [data.get(k) for k in (("num_layers", "num_decoder_layers")
                                        if "num_decoder_layers" in data
                                        else ("encoder_layers", "decoder_layers"))]
        if all(isinstance(n, int) for n in stacks):
            pick["num_layers"] = sum(stacks)
        if any(v is not None for v in pick.values()):
            return pick
    return {}


def shape_from_module(model: Any, description: str = "module") -> ModelShape:
    """Count an ``nn.Module`` as DeepSpeed's ``model_to_params`` does: shared parameters once,
    and the largest layer = the most parameters any one module holds directly, or a stage-3
    leaf module (``_z3_leaf``, Note "leaf modules" in ``zero3/leaf.py``) holds in all: a
    leaf is gathered whole, so it is the window stage 3 needs at once."""
    seen: dict[Any, int] = {}
    for param in model.parameters():  # parameters() already skips repeated Parameter objects
        key = id(param) if param.device.type == "meta" else param.data_ptr()
        seen[key] = param.numel()
    largest = max((sum(p.numel() for p in m.parameters(recurse=bool(getattr(m, "_z3_leaf",
                                                                          False))))
                   for m in model.modules()), default=0)
    table = position_table(model)
    return _bounded(ModelShape(sum(seen.values()), largest, description=description,
                               max_positions=table[1] if table else None,
                               positions_from=f"its position table {table[0]}" if table else "",
                               **_shape_fields(model)))


_POSITION_NAMES = ("wpe", "pos")   # GPT-2's wpe; position_embeddings, embed_positions, pos_emb


def position_table(model: Any) -> Optional[tuple[str, int]]:
    """(name, positions) of ``model``'s learned position table: an ``nn.Embedding`` named
    for positions (``wpe``, ``position_embeddings``, ``embed_positions``), less the rows it
    offsets its positions by (OPT's 2); None for a model without one (rotary or relative
    positions take any length)."""
    import torch

    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1].lower()
        if isinstance(module, torch.nn.Embedding) and any(p in last for p in _POSITION_NAMES):
            offset = getattr(module, "offset", 0)
            return name, module.num_embeddings - (offset if isinstance(offset, int) else 0)
    return None


def check_positions(seq_len: int, max_positions: Optional[int], source: str) -> None:
    """Refuse ``seq_len`` beyond a learned position table of ``max_positions`` rows (named by
    ``source``): the real step would raise IndexError looking position ``seq_len - 1`` up."""
    if max_positions is not None and seq_len > max_positions:
        raise SequenceLengthError(
            f"{seq_len} tokens are more than the model's {max_positions} positions "
            f"({source}); the real step raises IndexError at position {max_positions}. Use "
            f"--seq-len {max_positions} or less")


def shape_from_module_spec(spec: str) -> ModelShape:
    """Build ``module:callable``'s model on the meta device (no memory) and count it."""
    import torch  # only the model-based API needs torch

    factory = _load_callable(spec)
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as exc:  # the user's code: say which call failed, keep its message
        raise ValueError(f"{spec!r}: calling it on the meta device failed: "
                         f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"{spec!r} returned {type(model).__name__}, not an nn.Module")
    return shape_from_module(model, f"{spec} (built on the meta device)")


def activation_bytes(shape: ModelShape, *, micro_batch: int, seq_len: int, dtype: str,
                     checkpointing: bool, fused_attention: bool = False,
                     tp: int = 1, sp: int = 1, tiled_mlp: bool = False,
                     loss_tiles: int = 1) -> float:
    """Activation bytes per GPU for one micro-batch (Note "activation memory");
    ``fused_attention`` drops the ``5as/h`` score term, as FlashAttention-style kernels do.
    With ``tp`` T > 1, what is saved inside the split layers is divided by T (Korthikanti
    et al. 2022, eq. 3: ``s*b*h*(10 + 24/T + 5*a*s/(h*T))`` per layer); the layer's input,
    the norms and the logits stay whole on every rank. ``sp``, ``tiled_mlp`` and
    ``loss_tiles``: Note "sequence parallelism and tiling"."""
    if not shape.has_transformer_shape:
        raise ValueError("activation estimate needs hidden size, layers, heads and vocab size")
    check_positions(seq_len, shape.max_positions, shape.positions_from)
    s, b, h = seq_len, micro_batch, shape.hidden_size
    a, layers, vocab = shape.num_heads, shape.num_layers, shape.vocab_size
    local = s / sp
    mlp_saved = 0 if tiled_mlp else 16 / tp
    full_layer = local * b * h * (10 + 8 / tp + mlp_saved
                                  + (0 if fused_attention else 5 * a * s / (h * tp)))
    layers_bytes = (2 * local * b * h * layers + full_layer) if checkpointing else full_layer * layers
    one_layer = (12 * local * b * h if sp > 1 else 0) + (16 * b * h * h / tp if tiled_mlp else 0)
    scale = 2 if dtype == "fp32" else 1
    return scale * (layers_bytes + one_layer) + 4 * local * b * vocab / loss_tiles


def check_sequence_parallel(sp: int, world: int, heads: Optional[int],
                            seq_len: Optional[int]) -> None:
    """ValueError naming the problem when ``sp`` ranks cannot split this run's sequence: a
    size that does not divide the world, the attention heads (the all-to-all hands each
    rank ``heads / sp``) or the sequence (DeepSpeed's data-loader adapter refuses it)."""
    if sp < 1:
        raise ValueError(f"{sp} must be at least 1")
    if world % sp:
        raise ValueError(f"{sp} does not divide the {world} GPUs (the ranks form groups "
                         f"of {sp} sequence-parallel ranks)")
    if heads and heads % sp:
        raise ValueError(f"{sp} does not divide the model's {heads} attention heads (each "
                         f"sequence-parallel rank computes heads / {sp} of them)")
    if seq_len and seq_len % sp:
        raise ValueError(f"{sp} does not divide --seq-len {seq_len} (each rank takes "
                         f"seq_len / {sp} tokens; pad the sequence to a multiple)")
