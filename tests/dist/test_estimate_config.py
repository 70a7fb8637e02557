"""A config written by `zerotrain estimate --write` trains through initialize as it is
(for NVMe, once nvme_path names a real directory, as the recommendation asks).

The command runs in the test process (``main``; test_cli.py runs it through
``python -m zerotrain.cli`` once), the training on the pool's ranks."""
import json
import warnings

import pytest

import reference as R


def _train_with(rank, world, path):
    import zerotrain
    config = json.loads(open(path).read())
    if config.get("bf16", {}).get("enabled"):   # the reference batches are fp32: cast them in
        config["bf16"]["auto_cast"] = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = zerotrain.initialize(model=R.make_model(), config=config)
    micro = engine.train_micro_batch_size_per_gpu()
    R.train_engine(engine, steps=1, rank=rank, ga=engine.gradient_accumulation_steps(),
                   micro_size=micro)
    engine.close()
    return engine.zero_optimization_stage(), engine.global_steps


def _offload_device(zero, key):
    return zero.get(key, {}).get("device", "none")


@pytest.mark.slow
def test_written_config_trains_through_initialize(worlds, tmp_path):
    path = tmp_path / "ds_config.json"
    nvme_dir = tmp_path / "nvme"
    nvme_dir.mkdir()
    # 1.3B on 2 GPUs: ZeRO-1 in 80GB; in 6GB ZeRO-3 with the optimizer on CPU (need* 6Ψ/N =
    # 3.9 GB); in 4GB parameters on CPU too (4Ψ/N = 2.6 GB, host 14Ψ = 18.2 GB per node);
    # with 10GB of host as well, the optimizer on NVMe (host 2Ψ = 2.6 GB).
    cases = [(["--gpu-memory", "80GB"], (1, "none", "none")),
             (["--gpu-memory", "6GB"], (3, "cpu", "none")),
             (["--gpu-memory", "4GB"], (3, "cpu", "cpu")),
             (["--gpu-memory", "4GB", "--cpu-memory", "10GB"], (3, "nvme", "cpu"))]
    from zerotrain.cli import main
    for flags, expected in cases:
        assert main(["estimate", "--params", "1.3B", "--gpus", "2", *flags, "--write",
                     str(path)]) == 0, flags
        config = json.loads(path.read_text())
        zero = config["zero_optimization"]
        assert (zero["stage"], _offload_device(zero, "offload_optimizer"),
                _offload_device(zero, "offload_param")) == expected
        if expected[1] == "nvme":
            zero["offload_optimizer"]["nvme_path"] = str(nvme_dir)
            path.write_text(json.dumps(config))
        for got_stage, steps in worlds.run(2, _train_with, str(path)):
            assert got_stage == expected[0] and steps == 1
