"""DeepSpeed's ``UlyssesSPDataLoaderAdapter``: each batch cut along the sequence.

Note: one batch, S shards
    The S ranks of a sequence-parallel group each draw a batch from their own data loader
    (as data-parallel ranks would). The adapter gathers the S batches over the group, and
    hands them out one after the other: at the k-th call every rank of the group gets its
    shard (rank r: tokens ``[r*L/S, (r+1)*L/S)``) of rank k's batch, so S calls consume what
    one data-parallel step would and ``len()`` is S times the wrapped loader's. ``labels``
    becomes ``shift_labels`` (the next token's label, -100 after the last), shifted before
    the cut so the shard boundaries lose no target. Tensors are ``[batch, seq, ...]``;
    other values are copied to every rank. Tensors come back on the host, as DeepSpeed's.

Note: padding to a multiple of S
    A batch whose length L is not a multiple of S is padded at the end to the next multiple
    (DeepSpeed 0.19.8 refuses it with a ValueError): ``shift_labels`` -100 so the padding
    adds no loss and no gradient, ``position_ids`` continuing the count, every other tensor
    zeros. Attention is causal, so no real token sees the padding: the loss and gradients
    are those of the unpadded batch.
"""
from __future__ import annotations

from collections import deque
from typing import Any

import torch
import torch.nn.functional as F

from ..comm.sequence import gather_padded
from .attention import communicator_of


class UlyssesSPDataLoaderAdapter:
    """Wraps ``dl`` so that each rank of the sequence-parallel group ``sp_group`` gets its
    shard of every batch of the group (Note: one batch, S shards)."""

    def __init__(self, dl, sp_rank: int, sp_group, sp_world_size: int, device) -> None:
        self.dl = dl
        self.sp_rank = sp_rank
        self.sp_group = sp_group
        self.sp_world_size = sp_world_size
        self.device = device
        self.comm = communicator_of(sp_group)
        if (self.comm.world_size, self.comm.rank) != (sp_world_size, sp_rank):
            raise ValueError(f"sp_world_size {sp_world_size} / sp_rank {sp_rank} are not this "
                             f"rank's place in sp_group ({self.comm.world_size} ranks, rank "
                             f"{self.comm.rank})")
        self.iter = iter(dl)
        self.micro_batches: deque = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self):
        return self

    def __next__(self):
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        """Draw one batch, gather the group's, queue this rank's shard of each.
        Collective over the sequence-parallel group."""
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)
            raise
        _check_batch(batch)
        keys = self.comm.all_gather_object(sorted(batch), label="sequence parallel batch keys")
        if any(k != keys[0] for k in keys):
            raise ValueError(f"the ranks of one sequence-parallel group drew batches with "
                             f"different keys: {keys}")
        per_rank: list[dict[str, Any]] = [{} for _ in range(self.sp_world_size)]
        for k in keys[0]:
            if torch.is_tensor(batch[k]):
                parts = gather_padded(batch[k].to(self.device), self.comm,
                                      label=f"sequence parallel batch {k!r}")
            else:
                parts = self.comm.all_gather_object(batch[k], label=f"sequence parallel {k!r}")
            for rank, part in enumerate(parts):
                per_rank[rank][k] = part
        for whole in per_rank:
            self.micro_batches.append(self._shard(whole))

    def _shard(self, batch: dict[str, Any]) -> dict[str, Any]:
        """This rank's shard of one gathered batch (Notes: one batch, S shards; padding to
        a multiple of S)."""
        length = batch["input_ids"].shape[1]
        pad = -length % self.sp_world_size
        labels = batch.pop("labels")
        labels = F.pad(labels, (0, 1 + pad), value=-100)
        batch["shift_labels"] = labels[..., 1:].contiguous()
        chunk = (length + pad) // self.sp_world_size
        cut = slice(chunk * self.sp_rank, chunk * (self.sp_rank + 1))
        for k, v in batch.items():
            if not torch.is_tensor(v) or k == "shift_labels":
                continue
            if pad:
                v = _pad_end(v, pad, positions=(k == "position_ids"))
            batch[k] = v
        return {k: (v[:, cut].cpu().contiguous() if torch.is_tensor(v) else v)
                for k, v in batch.items()}


def _pad_end(t: torch.Tensor, pad: int, *, positions: bool) -> torch.Tensor:
    """``t`` with ``pad`` entries appended along the sequence: the positions counting on
    from the last, anything else zeros (Note: padding to a multiple of S)."""
    if positions:
        tail = t[:, -1:] + torch.arange(1, pad + 1, dtype=t.dtype, device=t.device)
    else:
        tail = torch.zeros((t.shape[0], pad, *t.shape[2:]), dtype=t.dtype, device=t.device)
    return torch.cat([t, tail], dim=1)


def _check_batch(batch: Any) -> None:
    """A dict with ``input_ids``, ``labels`` and ``position_ids``, every tensor of
    ``input_ids``' length; ValueError naming what is missing or which key differs."""
    if not isinstance(batch, dict):
        raise ValueError(f"Ulysses SP needs each batch to be a dict of input_ids, labels and "
                         f"position_ids, got {type(batch).__name__}")
    for key in ("input_ids", "labels"):
        if key not in batch:
            raise ValueError(f"Ulysses SP needs {key!r} in every batch; got {sorted(batch)}")
    if "position_ids" not in batch:
        raise ValueError("Ulysses SP requires `position_ids` in every dataloader batch so that "
                         "each token retains its correct global position after sequence "
                         "sharding; for non-packed sequences: torch.arange(seq_len) per sample")
    length = batch["input_ids"].shape[1]
    for k, v in batch.items():
        if torch.is_tensor(v) and (v.dim() < 2 or v.shape[1] != length):
            raise ValueError(f"{k}'s shape {tuple(v.shape)} must match input_ids's shape "
                             f"{tuple(batch['input_ids'].shape)} in the sequence dimension")
