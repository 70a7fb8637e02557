"""The chaos run in short (bench/chaos.py): a job under ``zerotrain launch --auto-resume``
takes an I/O error and a full disk during saves and a truncated and a corrupted newest tag
(all survived in the running process, the damaged tags by a new engine's auto-resume) and a
SIGKILL of a rank (a torchrun restart); every step's parameters, redone ones included, and
the final ones equal an uninterrupted run's bit for bit, and no step is lost beyond the
last published checkpoint."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ("kill", "disk_full", "save_error", "truncate", "corrupt")


@pytest.mark.slow
def test_a_short_chaos_run_ends_bitwise_equal(tmp_path):
    out = tmp_path / "summary.json"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src") + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run(   # seed 35 plans each of KINDS, one kill among 6 faults
        [sys.executable, os.path.join(ROOT, "bench", "chaos.py"), "--faults", "6",
         "--per-job", "6", "--weights", ",".join(KINDS), "--steps", "30",
         "--seed", "35", "--out", str(tmp_path / "runs"), "--json-out", str(out)],
        env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["ok"] and summary["complete"] and summary["jobs_bitwise_equal"] == 1
    assert not summary["lost"] and summary["steps_checked"] >= 30
    assert all(summary["by_kind"][k] >= 1 for k in KINDS), summary["by_kind"]
    assert summary["restarts"] == summary["by_kind"]["kill"] == 1
    assert summary["reloads"] == summary["by_kind"]["truncate"] + summary["by_kind"]["corrupt"]
    assert summary["steps_redone"] > 0
