"""Which ranks share a node, and the rank groups hierarchical sharding is built on.

Note: nodes from torchrun's environment
    torchrun gives every worker ``LOCAL_WORLD_SIZE`` (workers on its node) and ``GROUP_RANK``
    (its node's index among the agents); SLURM launches that start one torchrun per node
    set the same variables. Each rank reads its own pair (:func:`local_node_entry`), the
    pairs of all ranks are exchanged once (``comm.discover_topology``), and
    :meth:`Topology.from_entries` checks that they describe whole nodes. Without the
    variables (a single process, or a hand-made world) every rank is on node 0. Without
    ``GROUP_RANK`` the node is ``RANK // LOCAL_WORLD_SIZE``, torchrun's own numbering.

Note: rank groups
    A *partition* is a list of disjoint rank lists covering the world; every rank builds
    the same partition and takes the list holding itself. ``node_groups`` is one list per
    node (collectives that never leave the node), ``cross_node_groups`` one per local index
    (rank l of every node: what hierarchical collectives send across nodes), and
    ``blocks(size)`` cuts the world into consecutive runs of ``size`` ranks (hpZ's secondary
    partitions inside a node, MiCS's shard groups).

This module is arithmetic on rank numbers; it reads the environment and never communicates.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from ..errors import ConfigError

Partition = tuple[tuple[int, ...], ...]


def _env_int(env: Mapping[str, str], name: str, minimum: int) -> Optional[int]:
    text = env.get(name)
    if text is None or text == "":
        return None
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(name, f"environment variable {name}={text!r} is not an integer",
                          value=text) from None
    if value < minimum:
        raise ConfigError(name, f"environment variable {name}={value} must be >= {minimum}",
                          value=value)
    return value


def local_node_entry(rank: int, world_size: int,
                     env: Optional[Mapping[str, str]] = None) -> tuple[int, int]:
    """This rank's ``(node index, ranks on its node)`` from torchrun's environment."""
    env = os.environ if env is None else env
    local_world = _env_int(env, "LOCAL_WORLD_SIZE", 1)
    if local_world is None:
        return 0, world_size
    node = _env_int(env, "GROUP_RANK", 0)
    if node is None:
        node = rank // local_world
    return node, local_world


@dataclass(frozen=True)
class Topology:
    """The node of every rank of a data-parallel world (global ranks ``0..world-1``)."""

    rank: int
    node_of: tuple[int, ...]    # node index of each rank

    @classmethod
    def single_node(cls, rank: int, world_size: int) -> "Topology":
        return cls(rank, (0,) * world_size)

    @classmethod
    def from_entries(cls, rank: int, entries: Sequence[tuple[int, int]]) -> "Topology":
        """Build from every rank's ``(node, local world size)``; refuse entries that do not
        describe whole nodes (a node with more or fewer ranks than it announced)."""
        members: dict[int, list[int]] = {}
        for r, (node, _) in enumerate(entries):
            members.setdefault(node, []).append(r)
        for r, (node, local_world) in enumerate(entries):
            found = len(members[node])
            if found != local_world:
                raise ConfigError("LOCAL_WORLD_SIZE", f"rank {r} says node {node} has "
                                  f"{local_world} ranks, but {found} ranks ({members[node]}) "
                                  "report that node (GROUP_RANK); launch the same number of "
                                  "processes on every node", value=local_world)
        order = {node: i for i, node in enumerate(sorted(members))}
        return cls(rank, tuple(order[node] for node, _ in entries))

    # ------------------------------------------------------------------ sizes
    @property
    def world_size(self) -> int:
        return len(self.node_of)

    @property
    def num_nodes(self) -> int:
        return len(set(self.node_of))

    @property
    def node(self) -> int:
        return self.node_of[self.rank]

    def node_ranks(self, node: int) -> tuple[int, ...]:
        return tuple(r for r, n in enumerate(self.node_of) if n == node)

    @property
    def local_world_size(self) -> int:
        """Ranks on this rank's node."""
        return len(self.node_ranks(self.node))

    @property
    def uniform(self) -> bool:
        """Every node has the same number of ranks, numbered consecutively."""
        size = self.world_size // self.num_nodes
        return all(self.node_ranks(n) == tuple(range(n * size, (n + 1) * size))
                   for n in range(self.num_nodes)) and size * self.num_nodes == self.world_size

    def spans_nodes(self, ranks: Sequence[int]) -> bool:
        """Whether a group of (global) ranks has members on more than one node."""
        return len({self.node_of[r] for r in ranks}) > 1

    # ------------------------------------------------------------------ partitions
    def node_groups(self) -> Partition:
        return tuple(self.node_ranks(n) for n in range(self.num_nodes))

    def cross_node_groups(self) -> Partition:
        """Rank ``l`` of every node, for each local index ``l`` (uniform nodes only)."""
        self._require_uniform("cross-node groups")
        nodes = self.node_groups()
        return tuple(tuple(node[l] for node in nodes) for l in range(len(nodes[0])))

    def blocks(self, size: int) -> Partition:
        """Consecutive runs of ``size`` ranks (``size`` divides the world size)."""
        if size < 1 or self.world_size % size:
            raise ValueError(f"block size {size} does not divide world size {self.world_size}")
        return tuple(tuple(range(start, start + size))
                     for start in range(0, self.world_size, size))

    def replicas_of(self, blocks: Partition) -> Partition:
        """Position ``i`` of every block, for each ``i``: the ranks holding the same shard."""
        return tuple(tuple(block[i] for block in blocks) for i in range(len(blocks[0])))

    def _require_uniform(self, what: str) -> None:
        if not self.uniform:
            raise ConfigError("LOCAL_WORLD_SIZE", f"{what} need nodes of equal size with "
                              f"consecutive ranks; nodes are {list(self.node_groups())}")


def group_of(partition: Partition, rank: int) -> tuple[int, ...]:
    """The member of ``partition`` holding ``rank``."""
    for ranks in partition:
        if rank in ranks:
            return ranks
    raise ValueError(f"rank {rank} is in no group of {partition}")
