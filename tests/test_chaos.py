"""The chaos run in short (bench/chaos.py): a job under ``zerotrain launch --auto-resume``
with torchrun restarts takes a SIGKILL of a rank, a full disk during a save and a
truncated newest tag, and ends bitwise equal to an uninterrupted run with no step lost
beyond the last published checkpoint."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_a_short_chaos_run_ends_bitwise_equal(tmp_path):
    out = tmp_path / "summary.json"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src") + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "chaos.py"), "--faults", "3",
         "--per-job", "3", "--kinds", "kill,disk_full,truncate", "--steps", "12",
         "--seed", "1", "--out", str(tmp_path / "runs"), "--json-out", str(out)],
        env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["ok"] and summary["mismatched_jobs"] == 0 and not summary["lost"]
    assert summary["faults"] >= 3 and summary["restarts"] >= summary["faults"]
