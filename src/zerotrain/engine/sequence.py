"""What ``initialize`` does with DeepSpeed's ``mpu`` and ``sequence_parallel_size``.

Ulysses sequence parallelism reaches the engine as DeepSpeed's does: an ``mpu`` with
sequence-parallel groups (``register_with_transformers`` returns ``parallel_state_sp``; a
user's module with the same functions works too), or ``sequence_parallel_size`` in the
config. Either way the sequence mesh exists after ``initialize`` (Note "the sequence mesh"
in ``comm/sequence.py``), ``deepspeed.utils.groups`` answers from it, ZeRO shards over
every rank, and the summed gradient is divided by the N/S data-parallel ranks, as
DeepSpeed divides it by ``seq_dp_world / sp_size``.
"""
from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

from ..comm import Communicator, groups, parallel_state_sp
from ..errors import ConfigError


def sequence_parallel_of(mpu: Any) -> Optional[int]:
    """The sequence-parallel world size of ``mpu``, None without one; ConfigError for an
    mpu of another kind (Megatron tensor or pipeline groups), which zerotrain cannot use."""
    if mpu is None:
        return None
    if not hasattr(mpu, "get_sequence_parallel_world_size") or not hasattr(
            mpu, "get_sequence_parallel_group"):
        raise ConfigError("mpu", "only a sequence-parallel mpu (DeepSpeed's parallel_state_sp, "
                          "as UlyssesSPAttentionHF.register_with_transformers returns) is "
                          "supported; Megatron-style tensor or pipeline groups are not, use "
                          "tensor_parallel.autotp_size for tensor parallelism")
    return int(mpu.get_sequence_parallel_world_size())


def use_sequence_mesh(mpu: Any, size: int, comm: Communicator) -> Optional[int]:
    """Make the sequence mesh of ``size`` current and ``groups.mpu`` answer from it; returns
    the ranks gradients are averaged over (N / S), or None without sequence parallelism.
    Collective over the default group the first time the groups are made."""
    if size <= 1:
        return None
    parallel_state_sp.initialize_sequence_parallel(size)
    mine = parallel_state_sp.sequence_mesh().sp.ranks
    if mpu is not None and mpu is not parallel_state_sp:
        theirs = tuple(dist.get_process_group_ranks(mpu.get_sequence_parallel_group()))
        if theirs != mine:
            raise ConfigError("mpu", f"its sequence-parallel group of rank {comm.rank} holds "
                              f"ranks {list(theirs)}; zerotrain's sequence mesh puts "
                              f"consecutive ranks together ({list(mine)})")
    groups.mpu = mpu if mpu is not None else parallel_state_sp
    return comm.world_size // size
