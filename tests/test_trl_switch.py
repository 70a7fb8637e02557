"""TRL's trainers, unmodified, through ``zerotrain launch --as-deepspeed`` at ZeRO-3 train as
the same script without ``--deepspeed`` does under torchrun (2 gloo ranks, fp32).

DPO prepares its reference model with a config built from the user's before transformers
fills the model-dependent "auto" values, plus top-level dotted keys; it loads as DeepSpeed
reads it (Note "what DeepSpeed ignores" in ``config/keys.py``). SFT with a peft LoRA
adapter starts the adapter from torch's random stream right after ``from_pretrained``,
which under ``zero.Init`` must leave the stream where a plain load does (Note "a load draws
nothing" in ``stages/zero3/zero_init.py``). Both trainers run in one process per launch,
to pay the imports once.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("trl", reason="TRL is not installed (pip install zerotrain[dev])")
pytest.importorskip("peft", reason="peft is not installed (pip install zerotrain[dev])")
pytest.importorskip("datasets", reason="datasets (TRL's dependency) is not installed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "hf_scripts", "trl_train.py")
# the Trainer's usual ZeRO-3 file: batch sizes and bucket sizes left to "auto"
DS3 = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
       "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
       "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                             "stage3_prefetch_bucket_size": "auto",
                             "stage3_param_persistence_threshold": "auto"},
       "steps_per_print": 2000}


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(ROOT, "src"),
                                                    env.get("PYTHONPATH", "")) if p)
    env["HF_HUB_OFFLINE"] = "1"
    return env


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """A tiny Llama and its word-level tokenizer, saved once per session."""
    folder = tmp_path_factory.mktemp("tiny_llama")
    run = subprocess.run([sys.executable, SCRIPT, "--make_model", str(folder)], env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-4000:]
    return str(folder)


def _train(tmp_path, name: str, launcher: list, model: str, runs: str, extra: list) -> dict:
    out = tmp_path / f"{name}.json"
    run = subprocess.run([sys.executable, "-m", *launcher, "--standalone", "--nproc_per_node",
                          "2", SCRIPT, "--model", model, "--runs", runs, "--output_dir",
                          str(tmp_path / name), "--out", str(out), *extra],
                         cwd=str(tmp_path), env=_env(), capture_output=True, text=True,
                         timeout=500)
    assert run.returncode == 0, (name, run.stderr[-4000:])
    return json.loads(out.read_text())


@pytest.mark.slow
def test_dpo_and_sft_lora_at_zero3_match_the_plain_run(tmp_path, tiny_llama):
    runs = "dpo,sft_lora"
    plain = _train(tmp_path, "plain", ["torch.distributed.run"], tiny_llama, runs, [])
    config = tmp_path / "ds3.json"
    config.write_text(json.dumps(DS3))
    ours = _train(tmp_path, "zero3", ["zerotrain", "launch", "--as-deepspeed"], tiny_llama,
                  runs, ["--deepspeed", str(config)])
    for run in runs.split(","):
        assert len(plain[run]["losses"]) == 3, (run, plain[run])
        for key in ("losses", "grad_norms"):
            assert ours[run][key] == pytest.approx(plain[run][key], rel=1e-5, abs=0), (run, key)
