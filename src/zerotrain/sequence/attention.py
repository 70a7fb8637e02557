"""DeepSpeed's ``UlyssesSPAttentionHF``: Ulysses attention for Hugging Face models.

Note: Ulysses attention
    Each of the S ranks of a sequence-parallel group holds 1/S of every sequence (the data
    loader adapter cut it, ``loader.py``). Everything but attention is per token and runs on
    the shard as it is; attention needs the whole sequence, so around the model's own
    attention function (sdpa, eager, flash) the ranks trade heads for sequence: one
    all-to-all turns ``[bs, heads, seq/S, dim]`` into ``[bs, heads/S, seq, dim]`` for q, k and
    v, attention runs on whole sequences for 1/S of the heads, and one all-to-all turns the
    output back to ``[bs, seq/S, heads*dim]`` (DeepSpeed-Ulysses, arXiv:2309.14509; the
    exchange is Note "the head exchange" in ``comm/sequence.py``). Key-value heads fewer
    than S are repeated up to S first, as DeepSpeed does. The positions are gathered so
    rotary embeddings and masks see global positions; the causal mask is the whole
    sequence's: sdpa and flash are called without a mask (causal by the module's
    ``is_causal``), eager gets the additive causal mask it needs (DeepSpeed refuses eager
    because that mask is O(seq^2); it is built here, once per shape).

Note: evaluation, not eval mode
    ``disable_in_eval`` (Accelerate and the Trainer pass True) runs the plain attention on
    each rank's own batch during evaluation. DeepSpeed tests ``module.training`` alone, so
    a model trained without ``model.train()`` (``from_pretrained`` returns it in eval mode,
    and Accelerate's own ALST script never calls ``train()``) silently trains each shard on
    its own tokens. Here evaluation is eval mode *and* no gradient (the Trainer evaluates
    under ``torch.no_grad``); a backward-able forward always runs sequence parallel.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..comm import Communicator
from ..comm import parallel_state_sp
from ..comm.sequence import all_to_all_dim0, check_same_shapes, gather_along
from .registration import register


def communicator_of(process_group) -> Communicator:
    """The mesh's sequence-parallel communicator when ``process_group`` is its group (one
    ledger for the dimension), else a communicator over ``process_group``."""
    mesh = parallel_state_sp.current()
    if mesh is not None and mesh.sp.group is process_group:
        return mesh.sp
    return Communicator(process_group)


class UlyssesSPAttentionHF(nn.Module):
    """Ulysses attention around ``attn``, a Hugging Face attention function (Note: Ulysses
    attention). Same constructor and checks as DeepSpeed's: the query heads must divide by
    the sequence-parallel size, and the key-value heads divide it or by it."""

    def __init__(self, attn, batch_size: int, attn_head_count: int, attn_head_size: int,
                 kv_head_count: int, num_hidden_layers: int, process_group,
                 seq_length_is_variable: bool = False, local_seq_length: Optional[int] = None,
                 global_seq_length: Optional[int] = None,
                 disable_in_eval: bool = False) -> None:
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.comm = communicator_of(process_group)
        self.world_size = self.comm.world_size
        self.sp_rank = self.comm.rank
        self.batch_size = batch_size
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length = local_seq_length
        self.global_seq_length = global_seq_length
        self.disable_in_eval = disable_in_eval
        self.attn_head_size = attn_head_size
        self.attn_head_count = attn_head_count
        self.global_kv_head_count = kv_head_count
        self.num_hidden_layers = num_hidden_layers
        self.core_attn_implementation: Optional[str] = None
        if attn_head_count % self.world_size != 0:
            raise ValueError(f"Attention head count {attn_head_count} is not divisible by SP "
                             f"size {self.world_size}")
        if not (kv_head_count % self.world_size == 0 or self.world_size % kv_head_count == 0):
            raise ValueError(f"KV attention head count {kv_head_count} is not divisible by SP "
                             f"size {self.world_size} or vice versa")
        self.local_q_head_count = attn_head_count // self.world_size
        self.kv_replication_factor = self.world_size // kv_head_count
        self.local_kv_head_count = (1 if self.kv_replication_factor > 1
                                    else kv_head_count // self.world_size)
        self._eager_mask: Optional[torch.Tensor] = None

    # ------------------------------------------------------------------ the exchange
    def _combine(self, x: torch.Tensor, heads_local: int, what: str) -> torch.Tensor:
        """``[bs, heads, seq/S, dim]`` -> ``[bs, heads/S, seq, dim]`` (one all-to-all)."""
        bs, _, sl_local, hs = x.shape
        x = x.permute(2, 0, 1, 3)   # [sl_l, bs, hc, hs]
        x = x.reshape(sl_local, bs, self.world_size, heads_local, hs).permute(2, 0, 1, 3, 4)
        out = all_to_all_dim0(x, self.comm, label=what)   # [ws (sequence chunk), sl_l, ...]
        out = out.reshape(self.world_size * sl_local, bs, heads_local, hs)
        return out.permute(1, 2, 0, 3).contiguous()

    def _partition(self, context: torch.Tensor) -> torch.Tensor:
        """``[bs, seq, heads/S, dim]`` -> ``[bs, seq/S, heads*dim]`` (one all-to-all)."""
        bs, sl = context.shape[:2]
        sl_local = sl // self.world_size
        x = context.reshape(bs, self.world_size, sl_local, -1).permute(1, 2, 0, 3)
        out = all_to_all_dim0(x, self.comm, label="attention output")  # [ws (heads), sl_l, bs, em_l]
        return out.permute(2, 1, 0, 3).reshape(bs, sl_local, -1)

    def _check_shapes(self, query: torch.Tensor, key: torch.Tensor) -> None:
        bs, hc, sl_local, hs = query.shape
        check_same_shapes(self.comm, "attention inputs [batch, local sequence, heads, kv "
                          "heads, head size]", [bs, sl_local, hc, key.shape[1], hs],
                          device=query.device)
        if hc != self.attn_head_count or key.shape[1] != self.global_kv_head_count or \
                hs != self.attn_head_size:
            raise ValueError(f"query {tuple(query.shape)} / key {tuple(key.shape)} do not have "
                             f"{self.attn_head_count} query and {self.global_kv_head_count} "
                             f"key-value heads of size {self.attn_head_size} [bs, heads, seq, "
                             "dim], as registered")
        if not self.seq_length_is_variable and sl_local != self.local_seq_length:
            raise ValueError(f"local sequence length {sl_local} is not the registered "
                             f"{self.local_seq_length} (seq_length {self.global_seq_length} / "
                             f"SP size {self.world_size}); register with "
                             "seq_length_is_variable=True for varying lengths")

    # ------------------------------------------------------------------ forward
    def forward(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, attention_mask: Optional[torch.Tensor], *args: Any,
                **kwargs: Any):
        """Attention over the whole sequence for this rank's heads; returns the output of
        this rank's shard ``[bs, seq/S, heads*dim]`` and the attention weights (None for
        sdpa)."""
        if self.disable_in_eval and not module.training and not torch.is_grad_enabled():
            # Note: evaluation, not eval mode
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        self._check_shapes(query, key)
        if self.seq_length_is_variable:
            self.local_seq_length = query.shape[2]
            self.global_seq_length = self.local_seq_length * self.world_size
        if "position_ids" not in kwargs or kwargs["position_ids"] is None:
            raise ValueError("Ulysses sequence parallelism needs position_ids in every "
                             "forward() (the data loader adapter passes them): without them "
                             "each rank numbers its shard from 0")
        kwargs["position_ids"] = gather_along(kwargs["position_ids"], self.comm, dim=1,
                                              label="sequence parallel position ids")
        if self.kv_replication_factor > 1:
            key = key.repeat_interleave(self.kv_replication_factor, dim=1)
            value = value.repeat_interleave(self.kv_replication_factor, dim=1)
        q = self._combine(query, self.local_q_head_count, "query")
        k = self._combine(key, self.local_kv_head_count, "key")
        v = self._combine(value, self.local_kv_head_count, "value")
        if self.kv_replication_factor > 1:
            module.num_key_value_groups = q.size(-3) // k.size(-3)
        if self.core_attn_implementation == "eager":
            attention_mask = self._causal_mask(q)
        context, weights = self.attn(module, q, k, v, attention_mask, *args, **kwargs)
        return self._partition(context), weights

    def _causal_mask(self, q: torch.Tensor) -> torch.Tensor:
        """The additive causal mask ``[1, 1, seq, seq]`` eager attention needs (Note:
        Ulysses attention), kept while the shape, dtype and device stay."""
        sl = q.shape[2]
        mask = self._eager_mask
        if mask is None or mask.shape[-1] != sl or mask.dtype != q.dtype or \
                mask.device != q.device:
            mask = torch.full((sl, sl), torch.finfo(q.dtype).min, dtype=q.dtype,
                              device=q.device).triu(1)[None, None]
            self._eager_mask = mask
        return mask

    @classmethod
    def register_with_transformers(cls, model_name_or_path, core_attn_implementation,
                                   sequence_parallel_size, micro_batch_size, seq_length=None,
                                   seq_length_is_variable=True, disable_in_eval=False,
                                   max_length=None):
        """Route ``core_attn_implementation`` of every Hugging Face model in this process
        through Ulysses attention, and return the mpu (``parallel_state_sp``) to pass to
        ``initialize(mpu=...)``; None when ``sequence_parallel_size`` is 1. As DeepSpeed's
        (``registration.py`` holds the checks)."""
        return register(cls, model_name_or_path, core_attn_implementation,
                        sequence_parallel_size, micro_batch_size, seq_length=seq_length,
                        seq_length_is_variable=seq_length_is_variable,
                        disable_in_eval=disable_in_eval, max_length=max_length)

