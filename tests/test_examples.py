"""The DeepSpeed-style example script runs unchanged under `zerotrain launch`."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.parametrize("config", ["ds_config.json", "ds_config_offload.json"])
def test_deepspeed_style_example_trains_under_zerotrain_launch(config):
    out = subprocess.run(
        [sys.executable, "-m", "zerotrain.cli", "launch", "--standalone", "--nproc_per_node",
         "2", "examples/train.py", "--steps", "10", "--deepspeed", "--deepspeed_config",
         f"examples/{config}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step   10  loss" in out.stdout and "per-rank bytes" in out.stdout, out.stdout
    if "offload" in config:  # the fp32 state is on the host, not in device optimizer_state
        assert "host_optimizer_state" in out.stdout, out.stdout
