"""Reliability: a hang becomes a named error, and memory stays flat over long runs."""
import gc
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

import reference as R

HERE = os.path.dirname(os.path.dirname(__file__))


def _soak(rank, world, steps, probes):
    import zerotrain
    from zerotrain.core.memory import current_rss_bytes, live_tensor_bytes
    model = R.make_model()
    config = R.engine_config(stage=3, lr=1e-3)
    config["zero_optimization"].update(stage3_param_persistence_threshold=0,
                                       stage3_prefetch_bucket_size=100)
    engine, *_ = zerotrain.initialize(model=model, config=config)
    seen = {}
    x, y = R.micro_batch(0, rank, 0)
    for step in range(1, steps + 1):
        engine.backward(engine(x, y))
        engine.step()
        if step in probes:
            gc.collect()
            seen[step] = {"live": live_tensor_bytes(), "rss": current_rss_bytes(),
                          "objects": len(gc.get_objects())}
    return seen


def test_memory_stays_flat_over_a_long_stage3_run(worlds):
    for res in worlds.run(2, _soak, 400, (100, 400)):
        early, late = res[100], res[400]
        assert late["live"] == early["live"], res
        assert late["rss"] <= early["rss"] * 1.01, res
        assert late["objects"] <= early["objects"] * 1.01, res


@pytest.mark.slow
def test_a_rank_that_stops_communicating_gives_a_named_error_on_every_rank(tmp_path):
    """Rank 1 skips a backward: rank 0 waits in a reduce-scatter that never completes."""
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time, torch
        sys.path.insert(0, {HERE!r})
        import zerotrain, reference as R
        config = R.engine_config(stage=2, comms_timeout=4, debug=True)
        model = R.make_model()
        engine, *_ = zerotrain.initialize(model=model, config=config)
        rank = torch.distributed.get_rank()
        try:
            if rank == 0:
                engine.backward(engine(*R.micro_batch(0, rank, 0)))
            engine.step()
            print(f"rank {{rank}} finished", flush=True)
        except Exception as exc:
            print(f"rank {{rank}} error: {{type(exc).__name__}}: {{exc}}", flush=True)
            if rank == 1:  # stay alive, so rank 0's wait ends by its timeout, not our exit
                time.sleep(60)
            sys.exit(3)
    """))
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node", "2", str(script)],
                         capture_output=True, text=True, timeout=150)
    elapsed = time.monotonic() - start
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert "rank 0 error: CollectiveError" in text and "reduce_scatter" in text, text
    assert "gradient bucket" in text, text
    assert elapsed < 120, elapsed


def _torchrun_training(tmp_path, name: str, kill: bool) -> tuple[str, dict]:
    """Train 8 steps at stage 2 under torchrun (--max-restarts 1), saving every step; with
    ``kill`` rank 1 SIGKILLs itself after step 5 of the first attempt."""
    script = tmp_path / f"{name}.py"
    ckpt, result = tmp_path / f"{name}-ckpt", tmp_path / f"{name}.json"
    script.write_text(textwrap.dedent(f"""
        import json, os, signal, sys, torch
        sys.path.insert(0, {HERE!r})
        import zerotrain, reference as R
        config = R.engine_config(stage=2, comms_timeout=60,
                                 checkpoint={{"auto_resume": {str(ckpt)!r}}})
        model = R.make_model()
        engine, *_ = zerotrain.initialize(model=model, config=config)
        rank = torch.distributed.get_rank()
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        print(f"rank {{rank}} attempt {{attempt}} starts at step {{engine.global_steps}}",
              flush=True)
        while engine.global_steps < 8:
            step = engine.global_steps
            engine.backward(engine(*R.micro_batch(step, rank, 0)))
            engine.step()
            engine.save_checkpoint({str(ckpt)!r})
            if {kill!r} and attempt == 0 and rank == 1 and engine.global_steps == 5:
                os.kill(os.getpid(), signal.SIGKILL)
        if rank == 0:
            with open({str(result)!r}, "w") as f:
                json.dump({{n: p.detach().reshape(-1).tolist()
                           for n, p in model.named_parameters()}}, f)
    """))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node", "2", "--max-restarts", "1", str(script)],
                         capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    with open(result) as f:
        return text, json.load(f)


@pytest.mark.slow
def test_a_killed_rank_restarted_by_torchrun_resumes_without_losing_a_step(tmp_path):
    """SIGKILL one of 2 ranks mid-training under ``torchrun --max-restarts 1``: the job
    finishes from the last checkpoint with an uninterrupted run's parameters, bit for bit."""
    text, interrupted = _torchrun_training(tmp_path, "killed", kill=True)
    assert "attempt 1 starts at step 5" in text, text[-3000:]
    _, uninterrupted = _torchrun_training(tmp_path, "straight", kill=False)
    assert interrupted == uninterrupted
