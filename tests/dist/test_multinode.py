"""Bytes across nodes on a simulated 2-node world (4 ranks, 2 per node), and a real one
launched as two torchrun agents.

The ledger's rule (``comm/ledger.py``): all_gather counts its output, reduce_scatter its input,
all_reduce twice its tensor, all_to_all its input; a collective over a group spanning
nodes counts as cross-node bytes. Plain stage 3 with 16-bit parameters and gradients
moves 3Ψ × 2 bytes per step, all across nodes.
"""
import json
import math
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from multinode_helpers import STEPS, as_nodes, run_bytes, stage3_config

HERE = os.path.dirname(os.path.dirname(__file__))
NORM_BYTES = 2 * 4   # the gradient-norm scalar all-reduce (fp32, counted twice)


def test_plain_stage3_moves_three_psi_16bit_bytes_across_nodes(worlds):
    for res in worlds.run(4, run_bytes, 2, {}):
        comm, padded = res["comm"], res["padded"]
        assert comm["steps"] == STEPS
        assert comm["cross_node"] == {"all_gather": 2 * padded * 2 * STEPS,
                                      "reduce_scatter": padded * 2 * STEPS,
                                      "all_reduce": NORM_BYTES * STEPS}
        assert comm.get("intra_node", {}) == {}


def test_one_node_keeps_every_byte_inside_it(worlds):
    for res in worlds.run(4, run_bytes, 4, {}):
        assert res["comm"]["cross_node"] == {}
        assert sum(res["comm"]["intra_node"].values()) == (3 * res["padded"] * 2
                                                           + NORM_BYTES) * STEPS


def _cross(res) -> int:
    return sum(res["comm"]["cross_node"].values())


def test_hpz_gathers_backward_inside_the_node_and_keeps_psi_over_h_extra(worlds):
    """Forward gathers across nodes and leaves each rank its secondary chunk; backward
    gathers those chunks inside the node. Extra memory: ceil(numel / 2) per parameter."""
    for res in worlds.run(4, run_bytes, 2, {"zero_hpz_partition_size": 2}):
        comm, padded = res["comm"], res["padded"]
        secondary = sum(2 * math.ceil(n / 2) for n in res["numels"])   # padded over 2 ranks
        assert comm["cross_node"] == {"all_gather": padded * 2 * STEPS,
                                      "reduce_scatter": padded * 2 * STEPS,
                                      "all_reduce": NORM_BYTES * STEPS}
        assert comm["intra_node"] == {"all_gather": secondary * 2 * STEPS}
        assert res["memory"]["hpz_parameters"] == secondary // 2 * 2   # Ψ/H bf16 elements


def test_hpz_smaller_than_the_node_uses_blocks_of_that_size(worlds):
    """4 ranks on one node, hpZ over 2: the secondary gathers are over pairs of ranks."""
    for res in worlds.run(4, run_bytes, 4, {"zero_hpz_partition_size": 2}):
        secondary = sum(2 * math.ceil(n / 2) for n in res["numels"])
        assert res["comm"]["cross_node"] == {}
        assert res["comm"]["intra_node"]["all_gather"] == (res["padded"] + secondary) * 2 * STEPS


def test_mics_all_reduces_only_its_shard_across_nodes(worlds):
    """Shard groups of 2 ranks (one node each): gathers and reduce-scatters stay in the
    node; only each rank's reduced shard is all-reduced with its replica on the other."""
    for res in worlds.run(4, run_bytes, 2, {"mics_shard_size": 2}):
        comm, padded = res["comm"], res["padded"]            # padded over 2 ranks
        assert comm["intra_node"] == {"all_gather": 2 * padded * 2 * STEPS,
                                      "reduce_scatter": padded * 2 * STEPS,
                                      "all_reduce": NORM_BYTES * STEPS}
        assert comm["cross_node"] == {"all_reduce": 2 * (padded // 2) * 2 * STEPS}
        # ZeRO-3 memory over the group of 2: fp32 master and two Adam moments of Ψ/2
        state = res["memory"]["optimizer_state"]
        assert 12 * padded // 2 <= state <= 12 * padded // 2 + 64 * 8, res["memory"]


def test_zero_plus_plus_crosses_at_most_a_quarter_of_plain(worlds):
    """qwZ + hpZ + qgZ on units of 16K elements: int8 forward gather, backward inside the
    node, int4 gradients of which only the node's partial sums cross."""
    zpp = {"zero_hpz_partition_size": 2, "zero_quantized_weights": True,
           "zero_quantized_gradients": True}
    plain = worlds.run(4, run_bytes, 2, {}, model="wide")
    quant = worlds.run(4, run_bytes, 2, zpp, model="wide")
    for p, q in zip(plain, quant):
        assert _cross(q) <= _cross(p) / 4, (p["comm"], q["comm"])
        assert set(q["comm"]["cross_node"]) == {"all_gather", "all_to_all", "all_reduce"}
        assert q["comm"]["intra_node"]["all_to_all"] > q["comm"]["cross_node"]["all_to_all"]
        assert abs(q["losses"][-1] - p["losses"][-1]) <= 0.05 * p["losses"][-1]


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _load_elsewhere(rank, world, path, stage, zero=None):
    import reference as R
    import zerotrain
    from multinode_helpers import full_parameters
    with as_nodes(rank, 2 if world % 2 == 0 else world):
        model = R.make_model()
        config = R.engine_config(stage=stage) if stage < 3 else stage3_config(
            "fp32", **(zero or {}))
        engine, *_ = zerotrain.initialize(model=model, config=config)
        engine.load_checkpoint(path, tag="t")
        return full_parameters(model) if stage == 3 else {
            n: p.detach().float().clone() for n, p in model.named_parameters()}


def test_hpz_is_bitwise_and_mics_within_1e6_of_plain_and_their_checkpoints_reshard(
        worlds, tmp_path):
    """fp32, 3 steps on the 2 x 2 world; then the hpZ checkpoint loads into 3 ranks at
    stage 3 and into MiCS groups of 2, the MiCS one into 2 ranks at stage 1, bitwise."""
    hpz_dir, mics_dir = str(tmp_path / "hpz"), str(tmp_path / "mics")
    plain = worlds.run(4, run_bytes, 2, {}, precision="fp32", steps=3)
    hpz = worlds.run(4, run_bytes, 2, {"zero_hpz_partition_size": 2}, precision="fp32",
                     steps=3, save=hpz_dir)
    mics = worlds.run(4, run_bytes, 2, {"mics_shard_size": 2}, precision="fp32", steps=3,
                      save=mics_dir)
    for p, h, m in zip(plain, hpz, mics):
        assert _max_diff(p["full"], h["full"]) == 0.0
        assert _max_diff(p["full"], m["full"]) <= 1e-6
        assert p["losses"] == h["losses"]
    for full in worlds.run(3, _load_elsewhere, hpz_dir, 3):
        assert _max_diff(hpz[0]["full"], full) == 0.0
    for full in worlds.run(4, _load_elsewhere, hpz_dir, 3, {"mics_shard_size": 2}):
        assert _max_diff(hpz[0]["full"], full) == 0.0
    for full in worlds.run(2, _load_elsewhere, mics_dir, 1):
        assert _max_diff(mics[0]["full"], full) == 0.0


def test_hpz_with_the_optimizer_on_the_host_sees_every_update(worlds):
    """bf16 shards published from fp32 masters on the host: each step makes the secondary
    copy stale, so hpZ still ends bitwise equal to plain stage 3."""
    offload = {"offload_optimizer": {"device": "cpu"}}
    plain = worlds.run(4, run_bytes, 2, offload, steps=3)
    hpz = worlds.run(4, run_bytes, 2, {**offload, "zero_hpz_partition_size": 2}, steps=3)
    for p, h in zip(plain, hpz):
        assert _max_diff(p["full"], h["full"]) == 0.0 and p["losses"] == h["losses"]


def test_overlapped_two_step_reductions_match_the_synchronous_ones(worlds):
    """With overlap_comm, MiCS's and qgZ's second step runs when the bucket is waited for:
    the same bytes and the same bits as running both steps at once."""
    for zero in ({"mics_shard_size": 2}, {"zero_quantized_gradients": True}):
        sync = worlds.run(4, run_bytes, 2, zero, precision="fp32")
        overlapped = worlds.run(4, run_bytes, 2, {**zero, "overlap_comm": True},
                                precision="fp32")
        for a, b in zip(sync, overlapped):
            assert _max_diff(a["full"], b["full"]) == 0.0
            assert a["comm"] == b["comm"]


def _bad_hpz(rank, world, size):
    import reference as R
    import zerotrain
    with as_nodes(rank, 2):
        try:
            zerotrain.initialize(model=R.make_model(),
                                 config=stage3_config(zero_hpz_partition_size=size))
        except zerotrain.errors.ConfigError as exc:
            return str(exc)
    return "no error"


def test_hpz_larger_than_a_node_is_a_named_error_on_every_rank(worlds):
    for message in worlds.run(4, _bad_hpz, 4):
        assert message.startswith("zero_optimization.zero_hpz_partition_size: 4 is larger "
                                  "than a node (2 ranks"), message


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_torchrun_agents_form_two_nodes(tmp_path):
    """``torchrun --nnodes 2 --node_rank {0,1}`` with 2 processes each, on this machine:
    the nodes come from torchrun's environment; plain stage 3 crosses 3Ψ × 2 bytes, ZeRO++
    (hpZ + qwZ + qgZ) at most a quarter of that."""
    zpp = {"zero_hpz_partition_size": 2, "zero_quantized_weights": True,
           "zero_quantized_gradients": True}
    script = tmp_path / "two_nodes.py"
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    script.write_text(textwrap.dedent(f"""
        import gc, json, os, sys, time
        import torch.distributed as dist
        sys.path.insert(0, {HERE!r})
        sys.path.insert(0, {os.path.join(HERE, "dist")!r})
        import reference as R
        import zerotrain
        from multinode_helpers import make_model, stage3_config
        rank = int(os.environ["RANK"])
        result = {{"group_rank": os.environ["GROUP_RANK"]}}
        for name, model, zero in [("plain", "tiny", {{}}), ("wide", "wide", {{}}),
                                  ("zeropp", "wide", {zpp!r})]:
            module = make_model(model)
            engine, *_ = zerotrain.initialize(model=module, config=stage3_config(**zero))
            engine.communication_breakdown()
            R.train_engine(engine, steps=2, rank=rank, ga=1)
            result[name] = {{"node_of": list(engine.comm.topology.node_of),
                            "comm": engine.communication_breakdown(),
                            "padded": sum(r.layout.padded_numel
                                          for r in engine.stage.shard_records())}}
        with open(os.path.join({str(out_dir)!r}, f"rank{{rank}}.json"), "w") as f:
            json.dump(result, f)
        dist.destroy_process_group()   # ANCHORS: let gloo's threads finish before exit
        gc.collect()
        time.sleep(0.2)
    """))
    port = _free_port()
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank",
         str(node), "--nproc_per_node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
         str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in (0, 1)]
    texts = [agent.communicate(timeout=240)[0] for agent in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(t[-3000:] for t in texts)
    for rank in range(4):
        with open(out_dir / f"rank{rank}.json") as f:
            res = json.load(f)
        assert res["plain"]["node_of"] == [0, 0, 1, 1] and res["group_rank"] == str(rank // 2)
        padded = res["plain"]["padded"]
        assert res["plain"]["comm"]["cross_node"] == {"all_gather": 2 * padded * 2 * 2,
                                                      "reduce_scatter": padded * 2 * 2,
                                                      "all_reduce": NORM_BYTES * 2}
        assert _cross(res["zeropp"]) <= _cross(res["wide"]) / 4
