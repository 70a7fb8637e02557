"""Accelerate's own ALST (Ulysses sequence parallelism) script, unmodified, through the
switch: ``accelerate launch --use_deepspeed`` on 2 CPU ranks with the alias installed, as
Accelerate's ``tests/deepspeed/test_alst_ulysses_sp.py`` launches it (bf16, stage 3),
prints the losses of one process training on the whole sequences in fp32
(``alst_fixture.reference_losses``) to within 1e-3 (bf16 weights; the run measured 1e-4,
while attention cut at the shard boundary, what a model left in eval mode gets on
DeepSpeed, is 3.5e-3 off at the first step; fp32 at stage 2 prints the reference's digits). The script loads ``hf-internal-testing/tiny-random-LlamaForCausalLM`` by
name: a tiny Llama is saved under that relative path in the run's folder (no hub here).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "hf_scripts"))
import alst_fixture  # noqa: E402


def _script():
    import accelerate
    path = os.path.join(os.path.dirname(accelerate.__file__), "test_utils", "scripts",
                        "external_deps", "test_ds_alst_ulysses_sp.py")
    if not os.path.exists(path):
        pytest.skip("this Accelerate has no ALST test script")
    return path


def _launch(tmp_path, stage: int, precision: str) -> list[float]:
    from zerotrain.deepspeed_alias import install
    site, boot = tmp_path / "site", tmp_path / "boot"
    site.mkdir()
    boot.mkdir()
    install(str(site))
    (boot / "sitecustomize.py").write_text(f"import site\nsite.addsitedir({str(site)!r})\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(boot), os.path.join(ROOT, "src"),
                                         env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    run = subprocess.run([sys.executable, "-m", "accelerate.commands.launch",
                          "--num_processes=2", "--num_machines=1", "--machine_rank=0",
                          f"--mixed_precision={precision}", "--use_deepspeed",
                          f"--zero_stage={stage}", _script(),
                          f"--output_dir={tmp_path / 'out'}"],
                         cwd=str(tmp_path), env=env, capture_output=True, text=True,
                         timeout=400)
    assert run.returncode == 0, run.stderr[-4000:]
    return [float(v) for v in re.findall(r"^\d+: loss=tensor\(([0-9.]+)", run.stdout, re.M)]


@pytest.mark.slow
def test_accelerate_alst_script_prints_the_one_process_losses(tmp_path):
    alst_fixture.build(str(tmp_path))
    expected = alst_fixture.reference_losses(str(tmp_path))
    bf16 = _launch(tmp_path, 3, "bf16")
    assert len(bf16) == len(expected) == 4, bf16
    assert max(abs(a - b) for a, b in zip(bf16, expected)) < 1e-3, (bf16, expected)
