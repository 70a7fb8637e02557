"""bench/gpu_check.py, the first command on a GPU machine, rehearsed on CPU: the dry run
goes through every step and reports each; a step past its time limit is killed with its
children and reported, and the steps after it still run."""
import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import gpu_check  # noqa: E402


@pytest.mark.slow
def test_dry_run_goes_through_every_step(tmp_path):
    env = dict(os.environ, DRY_RUN="1", OUT=str(tmp_path), SITE=str(tmp_path / "site"))
    out = subprocess.run([sys.executable, "bench/gpu_check.py"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("[gpu-check] ")]
    assert [line.split()[1] for line in lines[:-1]] == list(gpu_check.STEPS), out.stdout
    rows = {r["step"]: r for r in map(json.loads, (tmp_path / "summary.jsonl").read_text()
                                      .splitlines())}
    assert list(rows) == list(gpu_check.STEPS)
    for step, row in rows.items():
        assert row["status"] in ("ok", "skipped"), row
    assert rows["pytest"]["figures"]["skipped"] >= 1          # tests/gpu skip without CUDA
    stages = {r["case"]: r for r in rows["stages"]["figures"]["rows"]}
    assert list(stages) == list(gpu_check.STAGE_CASES)
    assert all(r["s_per_step"] > 0 and r["timed_steps"] == 2 for r in stages.values()), stages
    for r in rows["breakdown"]["figures"]["rows"]:
        assert {"forward", "backward", "step"} <= set(r["breakdown_s_per_step"]), r
    report = (tmp_path / "report.md").read_text()
    assert "DRY RUN" in report and "| stage3 |" in report
    assert sorted(os.listdir(tmp_path)) == ["gpu_check.log", "pytest.xml", "report.md",
                                            "summary.jsonl"]   # few files come back


def test_a_step_past_its_limit_is_killed_with_its_children_and_the_next_runs(tmp_path):
    check = gpu_check.Check(str(tmp_path), budget=60, dry=True, python=sys.executable,
                            site=str(tmp_path / "site"), wheels=str(tmp_path / "none"))
    pid_file = tmp_path / "child.pid"
    sleeper = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
               "'import time; time.sleep(60)']); open(sys.argv[1], 'w').write(str(p.pid)); "
               "time.sleep(60)")
    t0 = time.monotonic()
    rc, timed_out, _ = check.run([sys.executable, "-c", sleeper, str(pid_file)], cap=8)
    assert (rc, timed_out) == (124, True) and time.monotonic() - t0 < 30
    child = int(pid_file.read_text())
    for _ in range(50):                     # the grandchild is gone too (killed, reaped)
        if not os.path.exists(f"/proc/{child}") or _zombie(child):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"grandchild {child} outlived its step")
    rc, timed_out, output = check.run([sys.executable, "-c", "print('next')"], cap=30)
    assert (rc, timed_out, output.strip()) == (0, False, "next")


def test_no_pydantic_and_no_wheels_stops_the_check_with_the_reason(tmp_path):
    check = gpu_check.Check(str(tmp_path), budget=60, dry=True, python=sys.executable,
                            site=str(tmp_path / "site"), wheels=str(tmp_path / "none"))
    check.run = lambda cmd, cap: (1, False, "ModuleNotFoundError: No module named 'pydantic'")
    assert check.main(["wheels", "env"]) == 1
    rows = [json.loads(line) for line in (tmp_path / "summary.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == ["wheels"]
    assert rows[0]["status"] == "FAILED" and "make gpu-wheels" in rows[0]["text"]


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True
