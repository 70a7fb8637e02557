"""The groups stage 3 shards and communicates over: the whole world by default, or the
layouts of ZeRO++ (hpZ, qwZ, qgZ) and MiCS, chosen from the config and the node topology.

Note: which group does what
    ``shard`` is the primary partition's group: parameters, gradients and optimizer state
    are split over it. It is the world, or with ``mics_shard_size`` S the S consecutive
    ranks holding this rank (MiCS: every group of S ranks holds a whole replica; gradients
    are reduce-scattered inside the group, then all-reduced over the replicas, the ranks at
    the same position in every group). ``wire`` gathers full parameters: from ``shard``,
    in int8 blocks with ``zero_quantized_weights``, and with ``zero_hpz_partition_size`` H
    from a secondary partition over H ranks of one node after the first gather
    (``wire.py``). ``reduce_scatter`` carries gradient blocks to their owners: over
    ``shard``, over shard then replicas (MiCS), or with ``zero_quantized_gradients`` as int4
    through the node and then across nodes (``hierarchy.py``). Gradients are averaged over
    every data-parallel rank, ``data_parallel_world``, whatever the shard group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

from ...comm import Communicator
from ...errors import ConfigError
from ...comm.hierarchy import QuantizedHierarchicalReduceScatter, ReplicatedReduceScatter
from .wire import SecondaryPartitionWire, UnitWire


@dataclass(frozen=True)
class Zero3Groups:
    shard: Communicator
    wire: UnitWire
    reduce_scatter: Optional[Callable]
    data_parallel_world: int


def build_groups(comm: Communicator, zero_config) -> Zero3Groups:
    """Stage 3's groups for ``comm`` (the data-parallel world) and the config. Collective the
    first time a set of groups is made (every rank makes the same ones, in the same order);
    raises ConfigError when a group size does not fit the nodes."""
    topology = comm.topology
    hpz = int(zero_config.zero_hpz_partition_size)
    mics = int(zero_config.mics_shard_size)
    shard = comm
    reduce_scatter: Optional[Union[ReplicatedReduceScatter,
                                   QuantizedHierarchicalReduceScatter]] = None
    if 0 < mics < comm.world_size:
        blocks = topology.blocks(mics)
        shard = comm.subgroup(blocks)
        reduce_scatter = ReplicatedReduceScatter(shard, comm.subgroup(
            topology.replicas_of(blocks)))
    if zero_config.zero_quantized_gradients:   # not with MiCS (config/checks.py refuses it)
        _require_uniform(topology, "zero_optimization.zero_quantized_gradients")
        reduce_scatter = QuantizedHierarchicalReduceScatter(
            comm, comm.subgroup(topology.node_groups()),
            comm.subgroup(topology.cross_node_groups()))
    quantized = bool(zero_config.zero_quantized_weights)
    if hpz > 1:
        _check_hpz(topology, hpz)
        wire: UnitWire = SecondaryPartitionWire(shard, comm.subgroup(topology.blocks(hpz)),
                                                quantized=quantized)
    else:
        wire = UnitWire(shard, quantized=quantized)
    return Zero3Groups(shard, wire, reduce_scatter, comm.world_size)


def _require_uniform(topology, key: str) -> None:
    if not topology.uniform:
        raise ConfigError(key, "needs nodes with the same number of ranks, numbered "
                          f"consecutively; the nodes are {list(topology.node_groups())}")


def _check_hpz(topology, hpz: int) -> None:
    key = "zero_optimization.zero_hpz_partition_size"
    _require_uniform(topology, key)
    local = topology.local_world_size
    if hpz > local:
        raise ConfigError(key, f"{hpz} is larger than a node ({local} ranks, "
                          "LOCAL_WORLD_SIZE): the secondary partition must stay inside one "
                          "node", value=hpz, suggestion=f"use {local} or a divisor of it")
    if local % hpz:
        raise ConfigError(key, f"{hpz} does not divide the ranks per node ({local})",
                          value=hpz, suggestion=f"use {local} or a divisor of it")
