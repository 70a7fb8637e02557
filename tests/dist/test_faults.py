"""Faults and hostile input: nothing is lost and nothing lies.

Two jobs sharing a save directory, a failed load, bad random-generator state, a bad
``latest``, bad manifest hyperparameters, a caught NonFiniteGradientError: each either
works or fails with a named error, and leaves the training state exactly as it was.
"""
import os
import threading

import reference as R
from distributed import run_world


def _engine(config=None, seed=0):
    import zerotrain
    model = R.make_model(seed)
    engine, *_ = zerotrain.initialize(model=model, config=config or R.engine_config(stage=1))
    return engine, model


# --------------------------------------------------------------------------- concurrent saves
def _saving_job(rank, world, root, name, saves):
    import time
    from zerotrain.checkpoint import CheckpointError
    engine, _ = _engine()
    open(f"{root}-ready-{name}", "w").close()
    while not all(os.path.exists(f"{root}-ready-{n}") for n in ("a", "b")):
        time.sleep(0.01)   # start saving together, so the saves overlap
    refused = []
    for i in range(saves):
        engine.backward(engine(*R.micro_batch(i, rank, 0)))
        engine.step()
        try:
            engine.save_checkpoint(root, tag=f"{name}{i}")
        except CheckpointError as exc:
            refused.append(str(exc))
    return refused


def test_two_jobs_saving_into_one_directory_never_publish_a_broken_tag(tmp_path):
    """Two single-rank jobs save 30 tags each into one directory at the same time: every
    published tag is complete, ``latest`` names one, and a refused save says why."""
    from zerotrain.checkpoint.fs import read_latest
    from zerotrain.checkpoint.manifest import read_manifest
    root = str(tmp_path / "shared")
    refusals: dict = {}

    def job(name):
        refusals[name] = run_world(_saving_job, 1, root, name, 30)[0]

    threads = [threading.Thread(target=job, args=(name,)) for name in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(refusals) == {"a", "b"}, refusals
    for message in refusals["a"] + refusals["b"]:
        assert "is saving a checkpoint into" in message and root in message, message
    tags = [e for e in os.listdir(root) if not e.startswith(".") and e != "latest"]
    assert len(tags) + len(refusals["a"]) + len(refusals["b"]) == 60, (tags, refusals)
    for tag in tags:
        read_manifest(os.path.join(root, tag))  # every file present with its recorded size
    assert read_latest(root) in tags
