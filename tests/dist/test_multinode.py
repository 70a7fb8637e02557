"""Bytes across nodes on a simulated 2-node world (4 ranks, 2 per node), and a real one
launched as two torchrun agents.

The ledger's rule (``comm.py``): all_gather counts its output, reduce_scatter its input,
all_reduce twice its tensor, all_to_all its input; a collective over a group spanning
nodes counts as cross-node bytes. Plain stage 3 with 16-bit parameters and gradients
moves 3Ψ × 2 bytes per step, all across nodes.
"""
import json
import os
import socket
import subprocess
import sys
import textwrap

from multinode_helpers import STEPS, run_bytes

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_agents_form_two_nodes(tmp_path):
    """``torchrun --nnodes 2 --node_rank {0,1}`` with 2 processes each, on this machine."""
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
        from multinode_helpers import stage3_config
        rank = int(os.environ["RANK"])
        model = R.make_model()
        engine, *_ = zerotrain.initialize(model=model, config=stage3_config())
        engine.communication_breakdown()
        R.train_engine(engine, steps=2, rank=rank, ga=1)
        result = {{"node_of": list(engine.comm.topology.node_of),
                   "group_rank": os.environ["GROUP_RANK"],
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
        assert res["node_of"] == [0, 0, 1, 1] and res["group_rank"] == str(rank // 2)
        padded = res["padded"]
        assert res["comm"]["cross_node"] == {"all_gather": 2 * padded * 2 * 2,
                                             "reduce_scatter": padded * 2 * 2,
                                             "all_reduce": NORM_BYTES * 2}
