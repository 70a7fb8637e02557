"""The offload bench's CPU smoke run trains every case it can and prints the table."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_offload_bench_tiny_cpu_smoke_lists_every_case(tmp_path):
    rows_path = tmp_path / "rows.json"
    out = subprocess.run(
        [sys.executable, "bench/offload_gpu.py", "--size", "tiny", "--device", "cpu",
         "--steps", "3", "--json-out", str(rows_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("command: ") and "offload_gpu.py" in lines[0]
    table = {line.split("|")[1].strip(): line for line in lines if line.startswith("| ")}
    assert set(table) == {"case", "plain", "fsdp2_offload", "zt_z2_cpu", "zt_z3_cpu"}, out.stdout
    assert "skipped: needs CUDA" in table["fsdp2_offload"]
    rows = {r["case"]: r for r in json.loads(rows_path.read_text())["rows"]}
    for case in ("plain", "zt_z2_cpu", "zt_z3_cpu"):
        assert "failed" not in rows[case], rows[case]
        assert rows[case]["s_per_step"] > 0 and rows[case]["peak_rss_gib"] > 0
        assert 0 < rows[case]["final_loss"] < 10, rows[case]  # ln(512) = 6.24 at the start
    assert table["plain"].split("|")[3].strip() == "1.00"  # ratios are to plain
