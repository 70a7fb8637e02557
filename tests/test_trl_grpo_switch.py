"""An unmodified TRL GRPO script with ``--deepspeed ds_config.json`` at ZeRO-3 runs through
``zerotrain launch --as-deepspeed`` with TRL's default generation gathering
(``ds3_gather_for_generation=True``): TRL gathers the whole model once around each
generation and takes stage 3's hooks out through ``optimizer.parameter_offload``
(``engine/parameter_offload.py``), then puts them back. With ``beta > 0`` TRL also builds a
reference model from the saved initial weights and prepares it as a second ZeRO-3 engine
from a config it derives from the user's. The logged losses equal the plain 2-rank run's, and the comm ledger shows one gather of the model per generation block and
none inside ``generate()`` (without the hooks out, each new token would gather every layer).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("trl")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "hf_scripts", "train_grpo.py")
NEW_TOKENS = 6
ARGS = ["--per_device_train_batch_size", "2", "--num_generations", "4",
        "--max_completion_length", str(NEW_TOKENS), "--max_steps", "2", "--logging_steps", "1",
        "--report_to", "none", "--save_strategy", "no", "--learning_rate", "1e-2", "--seed",
        "42", "--bf16", "false"]
# persistence threshold 0: every layer is partitioned, so a per-token gather would show
ZERO3 = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
         "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(ROOT, "src"),
                                                    env.get("PYTHONPATH", "")) if p)
    return env


def _run(tmp_path, name: str, launcher: list, extra: list) -> dict:
    out = tmp_path / f"{name}.json"
    run = subprocess.run([sys.executable, "-m", *launcher, "--standalone", "--nproc_per_node",
                          "2", SCRIPT, "--output_dir", str(tmp_path / name), "--out", str(out),
                          *ARGS, *extra], cwd=str(tmp_path), env=_env(), capture_output=True,
                         text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture
def initial_model(tmp_path) -> str:
    """The script's initial model saved once, for TRL's reference model (``beta > 0``)."""
    folder = tmp_path / "initial"
    run = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                          "import train_grpo; train_grpo.save_initial(sys.argv[2])",
                          os.path.dirname(SCRIPT), str(folder)], env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-4000:]
    return str(folder)


@pytest.mark.slow
def test_grpo_at_zero3_with_generation_gathering_and_a_reference_model_matches_the_plain_run(
        tmp_path, initial_model):
    reference = ["--beta", "0.1", "--saved", initial_model]
    plain = _run(tmp_path, "plain", ["torch.distributed.run"], ["--use_cpu", *reference])
    config = tmp_path / "ds3.json"
    config.write_text(json.dumps(ZERO3))
    ours = _run(tmp_path, "zero3", ["zerotrain", "launch", "--as-deepspeed"],
                ["--deepspeed", str(config), "--count_gathers", *reference])
    assert len(plain["losses"]) == 2
    # the first GRPO loss is ~0 (advantages sum to zero): abs covers float noise there only
    assert ours["losses"] == pytest.approx(plain["losses"], rel=1e-5, abs=1e-7)
    assert len(ours["generates"]) == 2   # one generation per step on rank 0
    for block in ours["generates"]:
        assert block["new_tokens"] == NEW_TOKENS
        assert block["generate"] == 0   # no gather while generating: hooks out
        assert block["block"] == ours["numel"]   # the whole model, gathered once
