"""``UlyssesSPAttentionHF.register_with_transformers``: its checks and the registration.

DeepSpeed replaces the entry of ``transformers``' global attention table for the model's
implementation with a wrapper around Ulysses attention, so every model of the process that
uses that implementation runs sequence parallel from then on; this does the same. A second
registration wraps the original function again, never a wrapper (the Trainer may
register once per ``prepare``).
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, Optional

from torch import nn

from ..comm import parallel_state_sp

logger = logging.getLogger(__name__)

# Implementations whose masks the wrapper cannot build: paged attention needs a cache,
# flex attention a block mask of the whole sequence.
_REFUSED = {"paged|eager": "paged attention (generation with a cache) cannot run sequence "
                           "parallel",
            "flex_attention": "flex attention's block mask is not built for the whole "
                              "sequence here"}
_ORIGINAL = "zerotrain_ulysses_original"


def register(cls, model_name_or_path: Any, core_attn_implementation: str,
             sequence_parallel_size: int, micro_batch_size: int, *,
             seq_length: Optional[int], seq_length_is_variable: bool, disable_in_eval: bool,
             max_length: Optional[int]):
    """See ``UlyssesSPAttentionHF.register_with_transformers``."""
    if sequence_parallel_size == 1:
        return None
    if max_length is not None:
        logger.warning("The 'max_length` argument is deprecated and will be eventually removed, "
                       "please use `seq_length` instead")
        seq_length = max_length if seq_length is None else seq_length
    if not seq_length_is_variable and seq_length is None:
        raise ValueError("Either `seq_length_is_variable` needs to be `True` or `seq_length` "
                         "needs to be set to an integer value of the fixed batch size length.")
    from transformers import AutoConfig, PreTrainedModel
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    loaded = hasattr(model_name_or_path, "config") or isinstance(model_name_or_path,
                                                                  PreTrainedModel)
    config = (model_name_or_path.config if loaded
              else AutoConfig.from_pretrained(model_name_or_path))
    if loaded:
        current = getattr(config, "_attn_implementation", None)
        if current is not None and current != core_attn_implementation:
            raise ValueError(f"core_attn_implementation='{core_attn_implementation}' does not "
                             f"match model config attn_implementation='{current}'. Set both to "
                             "the same value so sequence-parallel wrapper can intercept the "
                             "active attention path.")
    core = _core_function(core_attn_implementation, ALL_ATTENTION_FUNCTIONS)
    parallel_state_sp.initialize_sequence_parallel(sequence_parallel_size=sequence_parallel_size)
    if seq_length_is_variable:
        local, whole = None, None
    else:
        if seq_length % sequence_parallel_size:
            raise ValueError(f"seq_length {seq_length} is not divisible by "
                             f"sequence_parallel_size {sequence_parallel_size}")
        local, whole = seq_length // sequence_parallel_size, seq_length
    arch = config.get_text_config()
    uattn = cls(attn=core, batch_size=micro_batch_size,
                attn_head_count=arch.num_attention_heads,
                attn_head_size=getattr(arch, "head_dim", None) or (
                    arch.hidden_size // arch.num_attention_heads),
                kv_head_count=getattr(arch, "num_key_value_heads", None) or
                arch.num_attention_heads,
                num_hidden_layers=arch.num_hidden_layers,
                process_group=parallel_state_sp.get_sequence_parallel_group(),
                seq_length_is_variable=seq_length_is_variable, local_seq_length=local,
                global_seq_length=whole, disable_in_eval=disable_in_eval)
    uattn.core_attn_implementation = core_attn_implementation

    def uattn_wrapper(module, query, key, value, attention_mask, *args, **kwargs):
        return uattn(module, query, key, value, None, *args, **kwargs)

    setattr(uattn_wrapper, _ORIGINAL, getattr(core, _ORIGINAL, core) if
            core_attn_implementation != "eager" else None)
    uattn_wrapper.ulysses = uattn
    ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = uattn_wrapper
    return parallel_state_sp


def _core_function(name: str, table):
    """The attention function Ulysses attention wraps for ``name``; ValueError naming what
    cannot be wrapped."""
    if name in _REFUSED:
        raise ValueError(f"{name} attn_implementation isn't supported by Ulysses sequence "
                         f"parallelism: {_REFUSED[name]}; use 'sdpa', 'eager' or a flash "
                         "attention variant")
    if name == "eager":
        return lambda module, *args, **kwargs: model_eager_attention(module)(module, *args,
                                                                             **kwargs)
    if name not in table:
        raise ValueError(f"{name} is not a valid attn_implementation. The choices are "
                         f"{['eager', *table.valid_keys()]}")
    fn = table[name]
    return getattr(fn, _ORIGINAL, None) or fn


def unregister(core_attn_implementation: str) -> None:
    """Put the original attention function back (tests run a reference in the same
    process); nothing when none was registered."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    fn = ALL_ATTENTION_FUNCTIONS.get(core_attn_implementation)
    if fn is None or not hasattr(fn, "ulysses"):
        return
    original = getattr(fn, _ORIGINAL)
    if original is None:
        del ALL_ATTENTION_FUNCTIONS[core_attn_implementation]
    else:
        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = original


def model_eager_attention(module: nn.Module):
    """The ``eager_attention_forward`` of the modeling file that defines ``module``'s class
    (softcapping, sinks and the like stay the model's own)."""
    source = inspect.getmodule(type(module))
    fn = getattr(source, "eager_attention_forward", None)
    if fn is None:
        raise ValueError(f"{type(module).__name__} ({getattr(source, '__name__', '?')}) has no "
                         "eager_attention_forward to wrap; use core_attn_implementation='sdpa'")
    return fn
