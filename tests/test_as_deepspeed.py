"""An unmodified DeepSpeed script runs on zerotrain through the ``--as-deepspeed`` switch.

``ds_scripts/train_ds.py`` is written for DeepSpeed (``import deepspeed``, its own
``--local_rank``, ``deepspeed.comm``, ``get_accelerator``, a user-built ``FusedAdam``,
``save_checkpoint(tag=int)`` with tensors and RNG states in ``client_state``). It runs on
2 ranks at stages 1-3 (one launch, one engine per stage) and must end each with plain DDP's
weights.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_scripts")
STEPS = 4


def _ddp_job(rank: int, world: int, steps: int) -> dict:
    """The same training with torch's DistributedDataParallel and the same optimizer."""
    sys.path.insert(0, SCRIPTS)
    from toy import batch, build_model

    from zerotrain.ops.adam import FusedAdam

    model = torch.nn.parallel.DistributedDataParallel(build_model())
    optimizer = FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01)
    for step in range(steps):
        x, y = batch(step, rank)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}


@pytest.mark.slow
def test_unmodified_deepspeed_script_matches_ddp_at_stages_1_to_3(worlds, tmp_path):
    ddp_weights = worlds.run(2, _ddp_job, STEPS)[0]
    out_file = tmp_path / "out.json"
    run = subprocess.run(
        [sys.executable, "-m", "zerotrain", "launch", "--as-deepspeed", "--standalone",
         "--nproc_per_node", "2", os.path.join(SCRIPTS, "train_ds.py"), "--stage", "1", "2",
         "3", "--steps", str(STEPS), "--save_dir", str(tmp_path / "ckpt"), "--out",
         str(out_file)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    results = json.loads(out_file.read_text())
    assert sorted(results) == ["1", "2", "3"]
    for stage, out in results.items():
        _check_stage(int(stage), out, ddp_weights, tmp_path / "ckpt" / f"stage{stage}")


def _check_stage(stage: int, out: dict, ddp_weights: dict, ckpt) -> None:
    weights = {n: torch.tensor(v) for n, v in out["weights"].items()}
    assert weights.keys() == ddp_weights.keys()
    for name, value in weights.items():
        assert torch.allclose(value, ddp_weights[name], atol=1e-6, rtol=0), (stage, name)
    assert out["world"] == 2 and out["all_reduce"] == 3.0 and out["accelerator"] == "cpu"
    assert out["local_rank_arg"] == 0   # passed by the launcher, as DeepSpeed's does
    assert os.path.isdir(ckpt / "2")   # save_checkpoint(tag=2) -> "2"
    assert out["client_step"] == 2 and out["client_marker"] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert out["client_args_stages"] == [1, 2, 3] and out["resumed_step"] == 2
    statuses = ["ZeroParamStatus.AVAILABLE"] if stage == 3 else ["None"]  # a tiny model
    assert out["statuses"] == statuses   # stays gathered: under the persistence threshold


def _run_switch(script: str, tmp_path, extra_path: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, env.get("PYTHONPATH", "")) if p)
    path = tmp_path / "script.py"
    path.write_text(script)
    return subprocess.run([sys.executable, "-m", "zerotrain.as_deepspeed", str(path)],
                          capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.slow
def test_switch_refuses_when_the_real_deepspeed_is_importable(tmp_path):
    fake = tmp_path / "site" / "deepspeed"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    run = _run_switch("import deepspeed\nprint('ran')\n", tmp_path, str(tmp_path / "site"))
    assert run.returncode != 0 and "ran" not in run.stdout
    assert "DeepSpeedInstalledError" in run.stderr and "real DeepSpeed" in run.stderr
    assert str(fake) in run.stderr


def test_switch_names_what_is_missing_and_is_undone_by_uninstall():
    from zerotrain import as_deepspeed

    as_deepspeed.install()
    try:
        import deepspeed
        import deepspeed.comm as dist
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        import zerotrain
        assert dist.get_rank is zerotrain.comm.get_rank
        assert DeepSpeedCPUAdam is zerotrain.ops.adam.DeepSpeedCPUAdam
        assert ZeroParamStatus is zerotrain.zero.ZeroParamStatus
        assert deepspeed.initialize is zerotrain.initialize
        assert deepspeed.__version__ == zerotrain.DEEPSPEED_VERSION   # test below
        from deepspeed.ops.adam.fused_adam import FusedAdam
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold
        assert FusedAdam is zerotrain.ops.adam.FusedAdam
        assert callable(estimate_zero3_model_states_mem_needs_all_cold)
        assert deepspeed.moe.layer.MoE is zerotrain.moe.layer.MoE
        with pytest.raises(ModuleNotFoundError, match="deepspeed.inference is not provided"):
            import deepspeed.inference  # noqa: F401
        with pytest.raises(AttributeError, match="deepspeed.init_inference is not provided"):
            deepspeed.init_inference  # noqa: B018
    finally:
        as_deepspeed.uninstall()
    assert "deepspeed" not in sys.modules
    with pytest.raises(ModuleNotFoundError):
        import deepspeed  # noqa: F401,F811


def test_deepspeed_version_is_the_release_zerotrain_follows_and_its_own_stays_readable():
    """A script's ``version.parse(deepspeed.__version__) >= version.parse("0.10.0")`` takes
    DeepSpeed's modern branch; the release named is the one that wrote the fixtures."""
    from packaging import version

    import zerotrain
    from zerotrain import as_deepspeed
    from zerotrain.checkpoint.deepspeed.files import read

    model_states = os.path.join(ROOT, "tests", "fixtures", "deepspeed_ckpts", "z1_fp32_w2",
                                "checkpoint", "global_step3", "mp_rank_00_model_states.pt")
    assert read(model_states)["ds_version"] == zerotrain.DEEPSPEED_VERSION
    as_deepspeed.install()
    try:
        import deepspeed
        assert deepspeed.__version__ == zerotrain.DEEPSPEED_VERSION != zerotrain.__version__
        assert version.parse(deepspeed.__version__) >= version.parse("0.10.0")
        assert (deepspeed.__version_major__, deepspeed.__version_minor__,
                deepspeed.__version_patch__) == version.parse(deepspeed.__version__).release
        assert deepspeed.__zerotrain_version__ == zerotrain.__version__ == "0.1.0"
    finally:
        as_deepspeed.uninstall()


LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def _launcher_env(monkeypatch, **values) -> None:
    for key in LAUNCHER_VARS:
        monkeypatch.setenv(key, "0")   # recorded, so what main() sets is undone afterwards
        monkeypatch.delenv(key)
    for key, value in values.items():
        monkeypatch.setenv(key, value)


def _env_script(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import os, sys, json, deepspeed, deepspeed.accelerator\n"
                      "json.dump({'argv': sys.argv[1:], 'name': __name__,\n"
                      "           'device': deepspeed.accelerator.get_accelerator()"
                      ".device_name(),\n"
                      f"           'env': {{k: os.environ.get(k) for k in {LAUNCHER_VARS}}}}},"
                      " open(sys.argv[-1], 'w'))\n")
    return script


def test_runner_without_a_launcher_sets_deepspeeds_launcher_variables(tmp_path, monkeypatch):
    """As DeepSpeed's launcher of one process: --local_rank=0 and RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT... (the Trainer on the CPU needs the rendezvous address)."""
    from zerotrain import as_deepspeed

    _launcher_env(monkeypatch)
    script = _env_script(tmp_path)
    out = tmp_path / "out.json"
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        assert as_deepspeed.main([str(script), "--flag", str(out)]) == 0
        assert as_deepspeed.main(["--no_local_rank", str(script), str(out) + "2"]) == 0
    finally:
        as_deepspeed.uninstall()
    result = json.loads(out.read_text())
    env = result.pop("env")
    assert result == {"argv": ["--local_rank=0", "--flag", str(out)], "name": "__main__",
                      "device": "cpu"}
    assert env == {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "LOCAL_SIZE": "1",
                   "CROSS_RANK": "0", "CROSS_SIZE": "1", "LOCAL_WORLD_SIZE": None,
                   "GROUP_RANK": None}
    assert json.loads((tmp_path / "out.json2").read_text())["argv"] == [str(out) + "2"]


def test_runner_under_torchrun_keeps_its_variables(tmp_path, monkeypatch):
    from zerotrain import as_deepspeed

    torchrun = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.2",
                "MASTER_PORT": "1234", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}
    _launcher_env(monkeypatch, **torchrun)
    script, out = _env_script(tmp_path), tmp_path / "out.json"
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        assert as_deepspeed.main([str(script), str(out)]) == 0
    finally:
        as_deepspeed.uninstall()
    result = json.loads(out.read_text())
    assert result["argv"] == ["--local_rank=1", str(out)]
    assert result["env"] == dict(torchrun, LOCAL_SIZE="2", CROSS_RANK="1", CROSS_SIZE="2")


@pytest.mark.slow
def test_install_after_accelerate_and_transformers_were_imported():
    """Accelerate and transformers gate their DeepSpeed names on availability at import:
    install() after those imports still lets the Trainer and Accelerate's plugin import."""
    code = ("import accelerate.utils, accelerate.accelerator\n"
            "import transformers.integrations.deepspeed as hf\n"
            "from zerotrain import as_deepspeed\n"
            "as_deepspeed.install()\n"
            "import transformers.trainer\n"
            "from accelerate.utils import DeepSpeedSchedulerWrapper, DummyOptim\n"
            "import accelerate.utils.deepspeed as acc\n"
            "assert accelerate.accelerator.DummyOptim is acc.DummyOptim\n"
            "assert issubclass(hf.HfDeepSpeedConfig, acc.HfDeepSpeedConfig)\n"
            "print('imported')\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 0 and run.stdout.strip() == "imported", run.stderr[-3000:]


def test_switch_gives_deepspeed_metadata_to_its_own_process_only(tmp_path):
    """transformers' and Accelerate's availability checks read ``importlib.metadata``; the
    switch answers them in memory, and nothing is left behind on disk or after uninstall."""
    import importlib.metadata as md
    import importlib.util

    from accelerate.utils import imports as accelerate_imports
    from transformers.integrations import deepspeed as hf_deepspeed

    import zerotrain
    from zerotrain import as_deepspeed

    def on_disk() -> list:
        return sorted(f for d in sys.path if os.path.isdir(d) for f in os.listdir(d)
                      if f.lower().startswith("deepspeed"))

    before = on_disk()
    with pytest.raises(md.PackageNotFoundError):
        md.version("deepspeed")
    assert not hf_deepspeed.is_deepspeed_available()
    as_deepspeed.install()
    try:
        assert md.version("deepspeed") == zerotrain.DEEPSPEED_VERSION
        assert md.metadata("DeepSpeed")["Name"] == "deepspeed"   # names compare case-blind
        assert importlib.util.find_spec("deepspeed") is not None
        assert md.packages_distributions()["deepspeed"] == ["deepspeed"]
        assert [d.version for d in md.distributions(name="deepspeed")] == ["0.19.8"]
        assert hf_deepspeed.is_deepspeed_available()
        assert accelerate_imports._is_package_available("deepspeed")
        assert on_disk() == before
        other = subprocess.run([sys.executable, "-c", "import importlib.metadata as m\n"
                                "try: m.version('deepspeed')\n"
                                "except m.PackageNotFoundError: print('absent')"],
                               capture_output=True, text=True, timeout=60)
        assert other.stdout.strip() == "absent", other.stderr
    finally:
        as_deepspeed.uninstall()
    with pytest.raises(md.PackageNotFoundError):
        md.version("deepspeed")
    assert not hf_deepspeed.is_deepspeed_available() and on_disk() == before


def _site_run(site, code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter that treats ``site`` as a site-packages folder
    (its .pth files run at start-up), as an environment the alias was installed into."""
    boot = site.parent / "boot"
    boot.mkdir(exist_ok=True)
    (boot / "sitecustomize.py").write_text(f"import site\nsite.addsitedir({str(site)!r})\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(boot), os.path.join(ROOT, "src")])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=240, env=env)


@pytest.mark.slow
def test_deepspeed_alias_installs_lazily_refuses_to_shadow_and_uninstalls(tmp_path,
                                                                          monkeypatch):
    """``zerotrain install-deepspeed-alias``: a ``deepspeed`` distribution for launchers
    outside the switch (``accelerate launch --use_deepspeed``)."""
    from zerotrain import DEEPSPEED_VERSION, deepspeed_alias
    from zerotrain.cli import main

    site = tmp_path / "site"
    site.mkdir()
    assert main(["install-deepspeed-alias", "--target", str(site)]) == 0
    assert sorted(os.listdir(site)) == ["_zerotrain_deepspeed_alias.py",
                                        f"deepspeed-{DEEPSPEED_VERSION}.dist-info",
                                        "zerotrain-deepspeed-alias.pth"]
    run = _site_run(site, "import sys, importlib.metadata as md\n"
                    "lazy = 'zerotrain' not in sys.modules\n"
                    "from accelerate.utils import is_deepspeed_available\n"
                    "from deepspeed.launcher.runner import DEEPSPEED_ENVIRONMENT_NAME\n"
                    "import deepspeed, zerotrain\n"
                    "print(lazy, md.version('deepspeed'), is_deepspeed_available(),\n"
                    "      DEEPSPEED_ENVIRONMENT_NAME, deepspeed.initialize is "
                    "zerotrain.initialize)\n")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["True", DEEPSPEED_VERSION, "True", ".deepspeed_env", "True"]
    # idempotent; then removed, everything it wrote and nothing else
    (site / "other.txt").write_text("kept")
    assert main(["install-deepspeed-alias", "--target", str(site)]) == 0
    assert main(["uninstall-deepspeed-alias", "--target", str(site)]) == 0
    assert os.listdir(site) == ["other.txt"]
    assert main(["uninstall-deepspeed-alias", "--target", str(site)]) == 0   # nothing there
    # a real DeepSpeed is never shadowed: installed in that folder, or importable
    real = site / "deepspeed-0.19.8.dist-info"
    real.mkdir()
    (real / "INSTALLER").write_text("pip\n")
    with pytest.raises(deepspeed_alias.AliasError, match="will not shadow it"):
        deepspeed_alias.install(str(site))
    with pytest.raises(deepspeed_alias.AliasError, match="not zerotrain's alias"):
        deepspeed_alias.uninstall(str(site))
    assert main(["install-deepspeed-alias", "--target", str(site)]) == 1
    assert sorted(os.listdir(site)) == ["deepspeed-0.19.8.dist-info", "other.txt"]
    other = tmp_path / "elsewhere"
    (other / "deepspeed").mkdir(parents=True)
    (other / "deepspeed" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(other))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(deepspeed_alias.AliasError, match="deepspeed module is importable"):
        deepspeed_alias.install(str(empty))
    assert os.listdir(empty) == []
