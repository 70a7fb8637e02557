"""Nodes from torchrun's environment and the rank groups built on them (no process group)."""
import pytest

from zerotrain.errors import ConfigError
from zerotrain.comm.topology import Topology, group_of, local_node_entry


def test_entries_from_torchrun_environment():
    env = {"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}
    assert local_node_entry(3, 4, env) == (1, 2)
    assert local_node_entry(3, 4, {"LOCAL_WORLD_SIZE": "2"}) == (1, 2)   # RANK // local
    assert local_node_entry(3, 4, {}) == (0, 4)                          # one node


@pytest.mark.parametrize("env, name", [({"LOCAL_WORLD_SIZE": "two"}, "LOCAL_WORLD_SIZE"),
                                       ({"LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE"),
                                       ({"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "-1"},
                                        "GROUP_RANK")])
def test_bad_environment_is_a_named_error(env, name):
    with pytest.raises(ConfigError, match=name):
        local_node_entry(0, 4, env)


def test_two_nodes_of_two_ranks_give_node_and_cross_node_groups():
    topo = Topology.from_entries(2, [(0, 2), (0, 2), (1, 2), (1, 2)])
    assert topo.node_of == (0, 0, 1, 1) and topo.node == 1 and topo.local_world_size == 2
    assert topo.node_groups() == ((0, 1), (2, 3))
    assert topo.cross_node_groups() == ((0, 2), (1, 3))
    assert topo.blocks(2) == ((0, 1), (2, 3))
    assert topo.replicas_of(topo.blocks(2)) == ((0, 2), (1, 3))
    assert topo.spans_nodes((0, 2)) and not topo.spans_nodes((2, 3))
    assert group_of(topo.cross_node_groups(), 3) == (1, 3)


def test_node_numbers_need_not_start_at_zero():
    topo = Topology.from_entries(0, [(5, 1), (7, 1)])
    assert topo.node_of == (0, 1) and topo.num_nodes == 2


def test_a_node_with_fewer_ranks_than_announced_is_refused():
    with pytest.raises(ConfigError, match="node 1 has 2 ranks, but 1 ranks"):
        Topology.from_entries(0, [(0, 2), (0, 2), (1, 2)])


def test_cross_node_groups_need_equal_nodes_in_rank_order():
    topo = Topology.from_entries(0, [(0, 2), (1, 2), (0, 2), (1, 2)])
    assert not topo.uniform
    with pytest.raises(ConfigError, match="equal size with consecutive ranks"):
        topo.cross_node_groups()
