"""Muon over ZeRO's flat shards: the momentum stays sharded, each matrix meets at one owner.

Note: whole matrices under ZeRO
    Every optimizer group is one flat shard per rank holding chunk r of each parameter
    (Note "interleaved blocks" in ``core/flat.py``). Muon's momentum, its Nesterov blend,
    the weight decay and the final add are elementwise, so they run on the shard as Adam
    does. Only Newton-Schulz needs a whole matrix. Each Muon matrix therefore has an owner
    rank (chosen once, largest matrices first, each to the rank with the fewest elements so
    far: the same answer on every rank); at the step each rank sends its chunk of the
    blended momentum of every matrix to that matrix's owner (one ``all_to_all``), the owner
    orthogonalises its matrices whole, and sends each rank its chunk of the update back
    (a second ``all_to_all``). The momentum is saved, resharded and offloaded as any
    shard-sized state (``momentum_buffer``).

    Bytes, counted by the comm ledger (each rank's ``all_to_all`` input): the two exchanges
    move about ``2 * M / N`` elements per rank for ``M`` Muon elements over ``N`` ranks, on
    top of the ``2 * P`` of a stage 1-2 step's reduce-scatter and all-gather (``P`` all
    parameters; stage 3 adds its gathers). The alternatives: all-gathering the blend to every
    rank moves ``M`` per rank and repeats every Newton-Schulz ``N`` times; giving whole
    matrices to ranks moves nothing extra but needs a layout other than the interleaved one
    every stage, bucket and checkpoint reader shares (docs/memory.md "Muon").

Note: two rules
    ``"optimizer": {"type": "Muon"}`` follows DeepSpeed 0.19.8's ``MuonWithAuxAdam``
    (``muon_update``: momentum ``lerp`` by ``1 - momentum``, Nesterov blend, its Newton-Schulz
    with the aspect-ratio scale, ``p *= 1 - lr * wd`` then ``p -= lr * update``; the other
    half its inline AdamW). A client ``torch.optim.Muon`` keeps torch's arithmetic (its
    Newton-Schulz in bf16, its ``adjust_lr_fn``) and its own parameter groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from ..errors import ConfigError, StateError
from .newton_schulz import (NS_METHODS, deepspeed_orthogonalize, torch_adjusted_lr,
                            torch_orthogonalize)

DEEPSPEED, TORCH = "deepspeed", "torch"
# Client optimizers stepped here whole-matrix (the others are stepped elementwise: optim.py)
MATRIX_OPTIMIZERS: tuple[type, ...] = tuple(
    c for c in (getattr(torch.optim, "Muon", None),) if c is not None)


@dataclass(frozen=True, slots=True)
class Matrix:
    """One Muon parameter inside a record's shard."""

    name: str
    where: slice             # its chunk in the record's shard
    numel: int
    chunk: int
    shape: tuple[int, ...]
    owner: int
    num_heads: Optional[int] = None
    batched: bool = False


class ShardedMuon(torch.optim.Optimizer):
    """Muon for groups flagged ``use_muon``, AdamW for the others, over flat shards
    (Note: whole matrices under ZeRO). :meth:`bind` must run before the first step."""

    def __init__(self, groups: Sequence[dict], *, adam_w_mode: bool = True,
                 rule: str = DEEPSPEED) -> None:
        super().__init__(list(groups), {})
        for group in self.param_groups:
            if group.get("use_muon") and group.get("ns_method", "gram") not in NS_METHODS:
                raise ConfigError("optimizer.params.ns_method", "must be one of "
                                  + ", ".join(NS_METHODS), value=group["ns_method"])
        self.adam_w_mode = adam_w_mode
        self.rule = rule
        self._matrices: dict[int, list[Matrix]] = {}
        self._worlds: dict[int, int] = {}
        self._comm: Any = None
        self.client: Optional[torch.optim.Optimizer] = None

    @classmethod
    def around(cls, client: torch.optim.Optimizer) -> "ShardedMuon":
        """A client ``torch.optim.Muon`` (already retargeted to the shards) stepped here:
        its groups and state dict are shared, so its scheduler and references still work."""
        out = cls([{"params": [torch.zeros(1)], "use_muon": True}], rule=TORCH)
        out.param_groups = client.param_groups
        out.state = client.state
        out.defaults = client.defaults
        out.client = client   # what engine.optimizer_name() names
        for group in out.param_groups:
            group["use_muon"] = True
        return out

    # ------------------------------------------------------------------ set-up
    def bind(self, records: Sequence[Any], comm: Any,
             params_by_name: Optional[dict[str, torch.Tensor]] = None) -> None:
        """Learn where each Muon matrix sits in each record's shard and choose its owner.
        ``records``: the stage's ``shard_records()``; the same on every rank."""
        params_by_name = params_by_name or {}
        muon_groups = {g for g, group in enumerate(self.param_groups) if group.get("use_muon")}
        loads = [0] * comm.world_size
        self._matrices, self._worlds, self._comm = {}, {}, comm
        for record in records:
            if record.group_index not in muon_groups:
                continue
            world = record.layout.world
            if world not in (1, comm.world_size):
                raise ConfigError("optimizer", f"Muon needs each matrix's shards on one "
                                  f"group of ranks: this stage shards over {world} of "
                                  f"{comm.world_size} ranks (MiCS or hpZ); drop that "
                                  "setting or use another optimizer")
            slots = sorted(record.layout.slots, key=lambda s: (-s.numel, s.index))
            mats = []
            for slot in slots:
                name, shape = record.names[slot.index], tuple(record.shapes[slot.index])
                param = params_by_name.get(name)
                batched = bool(getattr(param, "is_expert_group", False))
                if len(shape) < 2 or (len(shape) == 3 and not batched) or len(shape) > 4:
                    raise ConfigError("optimizer", f"Muon steps matrices, and {name!r} has "
                                      f"shape {shape}; set use_muon False on it (Muon "
                                      "takes 2-D weights, 4-D convolutions and batched "
                                      "expert weights)")
                owner = min(range(comm.world_size), key=lambda r: (loads[r], r))
                if world > 1:
                    loads[owner] += slot.numel
                mats.append(Matrix(name, record.layout.shard_slice(slot), slot.numel,
                                   slot.chunk, shape, owner if world > 1 else comm.rank,
                                   getattr(param, "muon_num_heads", None), batched))
            self._matrices[id(record.master)] = mats
            self._worlds[id(record.master)] = world

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise StateError("ShardedMuon.step(closure): a closure is not supported")
        for group in self.param_groups:
            for master in group["params"]:
                if master.grad is None:
                    continue
                if group.get("use_muon"):
                    self._muon(master, group)
                else:
                    self._adam(master, group)

    def _muon(self, master: torch.Tensor, group: dict) -> None:
        if id(master) not in self._matrices:
            raise StateError("the Muon optimizer was stepped before the engine bound it to "
                             "its shards")
        grad = master.grad
        state = self.state[master]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(master)
        buf = state["momentum_buffer"]
        beta = group["momentum"]
        buf.lerp_(grad, 1 - beta)
        blend = grad.lerp(buf, beta) if group.get("nesterov", True) else buf
        update = self._orthogonalized(master, blend, group)
        lr, wd = group["lr"], group["weight_decay"]
        master.mul_(1 - lr * wd)
        if self.rule == DEEPSPEED:
            master.add_(update, alpha=-lr)
            return
        for m in self._matrices[id(master)]:
            master[m.where].add_(update[m.where], alpha=-torch_adjusted_lr(
                group, torch.Size(m.shape)))

    def _orthogonalize(self, full: torch.Tensor, m: Matrix, group: dict) -> torch.Tensor:
        if self.rule == TORCH:
            return torch_orthogonalize(full, group)
        return deepspeed_orthogonalize(full, ns_method=group.get("ns_method", "gram"),
                                       num_heads=m.num_heads, batched=m.batched)

    def _orthogonalized(self, master: torch.Tensor, blend: torch.Tensor,
                        group: dict) -> torch.Tensor:
        """The Newton-Schulz update, shard-sized (zero outside the Muon matrices), each
        matrix made whole at its owner (Note: whole matrices under ZeRO). Collective when
        the record is sharded: every rank calls it for the same records in the same order."""
        mats = self._matrices[id(master)]
        out = torch.zeros_like(blend)
        world = self._worlds[id(master)]
        if world == 1:
            for m in mats:
                out[m.where] = self._orthogonalize(blend[m.where].view(m.shape), m,
                                                   group).reshape(-1)
            return out
        comm = self._comm
        device = comm.device
        by_owner = [[m for m in mats if m.owner == r] for r in range(world)]
        splits = [sum(m.chunk for m in owned) for owned in by_owner]
        mine = by_owner[comm.rank]
        width = splits[comm.rank]
        send = torch.cat([blend[m.where] for owned in by_owner for m in owned]).to(device)
        gathered = torch.empty(world * width, dtype=blend.dtype, device=device)
        total = world * sum(splits)
        comm.all_to_all_uneven(gathered, send, [width] * world, splits, total=total,
                               label="muon gather")
        rows = gathered.view(world, width)
        updates = torch.empty_like(rows)
        column = 0
        for m in mine:
            cols = slice(column, column + m.chunk)
            full = rows[:, cols].reshape(-1)[: m.numel].view(m.shape)
            padded = torch.zeros(world * m.chunk, dtype=blend.dtype, device=device)
            padded[: m.numel] = self._orthogonalize(full, m, group).reshape(-1)
            updates[:, cols] = padded.view(world, m.chunk)
            column += m.chunk
        back = torch.empty(sum(splits), dtype=blend.dtype, device=device)
        comm.all_to_all_uneven(back, updates.reshape(-1), splits, [width] * world,
                               total=total, label="muon scatter")
        back = back.to(blend.device)
        offset = 0
        for owned in by_owner:
            for m in owned:
                out[m.where] = back[offset: offset + m.chunk]
                offset += m.chunk
        return out

    def _adam(self, master: torch.Tensor, group: dict) -> None:
        """DeepSpeed's inline AdamW of the non-Muon half (``adam_update``)."""
        if self.rule == TORCH:
            raise ConfigError("optimizer", "torch.optim.Muon steps matrices only")
        grad = master.grad
        if not self.adam_w_mode:
            grad = grad.add(master, alpha=group["weight_decay"])
        state = self.state[master]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(master)
            state["exp_avg_sq"] = torch.zeros_like(master)
            state["step"] = torch.tensor(0.0)
        state["step"] += 1
        step = float(state["step"])
        beta1, beta2 = group["betas"]
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].lerp_(grad.square(), 1 - beta2)
        update = (state["exp_avg"] / (1 - beta1 ** step)) / (
            (state["exp_avg_sq"] / (1 - beta2 ** step)).sqrt() + group["eps"])
        if self.adam_w_mode:
            master.mul_(1 - group["lr"] * group["weight_decay"])
        master.add_(update, alpha=-group["lr"])
