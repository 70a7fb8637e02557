"""Asynchronous checkpoint save: a snapshot that training cannot disturb, one save in flight,
errors on every rank, exit waits, and a kill during the background write leaves the
previous tag as ``latest`` (real SIGKILL, fresh processes)."""
import contextlib
import os

import pytest
import torch

import reference as R
from distributed import run_world

ASYNC = {"checkpoint": {"writer": {"decoupled": True, "type": "fast"}}}


def _engine(stage=2, seed=0, **extra):
    import zerotrain
    config = {**R.engine_config(stage=stage), **extra}
    engine, _, _, _ = zerotrain.initialize(model=R.make_model(seed), config=config)
    return engine


def _train(engine, rank, first, steps):
    for step in range(first, first + steps):
        engine.backward(engine(*R.micro_batch(step, rank, 0)))
        engine.step()


def _params(engine):
    import zerotrain
    params = list(engine.module.parameters())
    with zerotrain.zero.GatheredParameters(params):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def _snapshot_job(rank, world, root, stage):
    """Save in the background while training goes on; the checkpoint holds the state at the
    call, and resuming from it continues exactly as the original did."""
    engine = _engine(stage, **ASYNC)   # the config switch, not the argument
    _train(engine, rank, 0, 2)
    at_save = _params(engine)
    engine.save_checkpoint(root, tag="first")
    writer = engine._checkpoint_writer
    pending = writer is not None and writer.pending
    _train(engine, rank, 2, 2)          # mutates the masters the save was taken from
    buffer_ptr = writer.buffer._storage.data_ptr()
    engine.save_checkpoint(root, tag="second", async_save=True)   # waits for "first"
    reused = writer.buffer._storage.data_ptr() == buffer_ptr
    engine.wait_for_checkpoint()
    _train(engine, rank, 4, 2)
    resumed = _engine(stage, seed=3)
    resumed.load_checkpoint(root, tag="first")
    loaded = _params(resumed)
    _train(resumed, rank, 2, 4)
    return {"pending": pending, "reused": reused, "latest": open(os.path.join(root, "latest")).read(),
            "at_save": R.max_diff(loaded, at_save), "continued": R.max_diff(
                _params(resumed), _params(engine)), "left": sorted(os.listdir(root))}


@pytest.mark.parametrize("stage", [3])
def test_async_save_holds_the_state_at_the_call_and_resumes_exactly(worlds, tmp_path, stage):
    for res in worlds.run(2, _snapshot_job, str(tmp_path), stage):
        assert res["pending"] and res["reused"], res
        assert res["at_save"] == 0.0 and res["continued"] == 0.0, res
        assert res["latest"] == "second" and res["left"] == ["first", "latest", "second",
                                                               "zero_to_fp32.py"], res


@contextlib.contextmanager
def _disk_full(on):
    """Where ``on``: every rank file written inside fails as a full disk does."""
    from zerotrain.checkpoint import save
    real = save._write_rank_file

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")
    if on:
        save._write_rank_file = broken
    try:
        yield
    finally:
        save._write_rank_file = real


def _failing_job(rank, world, root):
    from zerotrain.checkpoint import CheckpointError
    engine = _engine(1)
    _train(engine, rank, 0, 1)
    engine.save_checkpoint(root, tag="good", async_save=True)
    engine.wait_for_checkpoint()
    with _disk_full(on=rank == 1):
        engine.save_checkpoint(root, tag="bad", async_save=True)
        try:
            engine.wait_for_checkpoint()
            message = None
        except CheckpointError as exc:
            message = str(exc)
    engine.comm.barrier()
    return {"message": message, "latest": open(os.path.join(root, "latest")).read(),
            "left": sorted(n for n in os.listdir(root) if not n.startswith(".tmp-"))}


def test_a_failed_background_write_raises_on_every_rank_and_publishes_nothing(worlds,
                                                                                tmp_path):
    for res in worlds.run(2, _failing_job, str(tmp_path)):
        assert res["message"] and "rank 1" in res["message"], res
        assert "No space left" in res["message"] and "not published" in res["message"], res
        assert res["latest"] == "good" and res["left"] == ["good", "latest", "zero_to_fp32.py"], res


def _close_job(rank, world, root):
    """``close()`` with a save in flight: it returns once the tag is published; with a
    failed one it raises naming the tag and still closes the engine."""
    from zerotrain.checkpoint import CheckpointError
    from zerotrain.engine.ownership import is_closed
    engine = _engine(2)
    _train(engine, rank, 0, 1)
    _slow_markers()
    try:
        engine.save_checkpoint(root, tag="closing", async_save=True)
        in_flight = engine._checkpoint_writer.in_flight
        engine.close()
        published = open(os.path.join(root, "latest")).read()
        failing = _engine(2, seed=1)
        _train(failing, rank, 0, 1)
        with _disk_full(on=rank == 0):
            failing.save_checkpoint(root, tag="doomed", async_save=True)
            try:
                failing.close()
                message = None
            except CheckpointError as exc:
                message = str(exc)
    finally:
        _fast_markers()
    return {"in_flight": in_flight, "published": published, "message": message,
            "closed": is_closed(failing.stage), "latest": open(
                os.path.join(root, "latest")).read()}


def test_close_waits_for_the_save_in_flight_and_raises_its_failure_naming_the_tag(worlds,
                                                                                    tmp_path):
    for res in worlds.run(2, _close_job, str(tmp_path)):
        assert res["in_flight"] and res["published"] == "closing", res
        assert res["message"] and "doomed" in res["message"], res
        assert "rank 0" in res["message"] and "not published" in res["message"], res
        assert res["closed"] and res["latest"] == "closing", res


def _fast_markers():
    from zerotrain.checkpoint import writer
    writer.write_marker = getattr(writer.write_marker, "real", writer.write_marker)


def _slow_markers():
    from zerotrain.checkpoint import writer
    real = writer.write_marker

    def slow(*args, **kwargs):
        import time
        time.sleep(1.0)
        real(*args, **kwargs)
    slow.real = real
    writer.write_marker = slow


def _exit_job(rank, world, root):
    engine = _engine(2)
    _train(engine, rank, 0, 1)
    _slow_markers()
    engine.save_checkpoint(root, tag="at_exit", async_save=True)
    return engine._checkpoint_writer.in_flight   # the process exits with the save unfinished


def _crash_job(rank, world, root, point):
    from zerotrain.checkpoint.fs import CRASH_ENV
    engine = _engine(1)
    _train(engine, rank, 0, 2)
    engine.save_checkpoint(root, tag="good", async_save=True)
    engine.wait_for_checkpoint()
    torch.save(_params(engine), os.path.join(root, "expected.pt"))
    _train(engine, rank, 2, 1)
    os.environ[CRASH_ENV] = point
    _slow_markers()
    engine.save_checkpoint(root, tag="next", async_save=True)
    _train(engine, rank, 3, 50)         # training goes on until the writer kills the process
    engine.wait_for_checkpoint()
    return "survived"


def _resume_job(rank, world, root):
    import zerotrain
    from zerotrain.checkpoint import fs
    config = {**R.engine_config(stage=2), "checkpoint": {"auto_resume": root}}
    engine, _, _, _ = zerotrain.initialize(model=R.make_model(5), config=config)
    expected = torch.load(os.path.join(root, "expected.pt"))
    candidates, _ = fs.resume_candidates(root)
    return {"diff": R.max_diff(_params(engine), expected), "steps": engine.global_steps,
            "candidates": candidates}


@pytest.mark.slow
def test_interpreter_exit_waits_for_the_save_in_flight(tmp_path):
    root = str(tmp_path)
    assert run_world(_exit_job, 2, root, start="spawn") == [True, True]   # a real exit
    assert open(os.path.join(root, "latest")).read() == "at_exit"
    assert sorted(os.listdir(root)) == ["at_exit", "latest", "zero_to_fp32.py"]


@pytest.mark.slow
@pytest.mark.parametrize("point", ["background"])   # "latest": fs.publish, shared with the
#                                                      synchronous save and tested there
def test_a_kill_during_the_background_write_leaves_latest_on_the_previous_tag(worlds, tmp_path,
                                                                             point):
    root = str(tmp_path)
    with pytest.raises(RuntimeError, match="died without a result.*SIGKILL"):
        run_world(_crash_job, 2, root, point)
    assert open(os.path.join(root, "latest")).read() == "good"
    for res in worlds.run(2, _resume_job, root):
        assert res["diff"] == 0.0 and res["steps"] == 2, res
        assert all(not c.startswith(".") for c in res["candidates"]), res
        assert res["candidates"][0] == "good", res


SHORT_TIMEOUT_S = 30   # a regression that waits out comms_timeout fails in seconds, not 30 min


@contextlib.contextmanager
def _full_disk_everywhere(on):
    """Where ``on``: the rank file and the marker both fail as a full disk does (ENOSPC)."""
    import errno
    from zerotrain.checkpoint import writer

    def marker(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    real = writer.write_marker
    if on:
        writer.write_marker = marker
    try:
        with _disk_full(on):
            yield
    finally:
        writer.write_marker = real


def _full_disk_job(rank, world, root):
    import time
    from zerotrain.checkpoint import CheckpointError
    engine = _engine(1, comms_timeout=SHORT_TIMEOUT_S)
    _train(engine, rank, 0, 1)
    engine.save_checkpoint(root, tag="good", async_save=True)
    engine.wait_for_checkpoint()
    out = {}
    for failing in (1, 0):
        with _full_disk_everywhere(on=rank == failing):
            begin = time.monotonic()
            engine.save_checkpoint(root, tag=f"full{failing}", async_save=True)
            try:
                engine.wait_for_checkpoint()
                message = None
            except CheckpointError as exc:
                message = str(exc)
        out[failing] = (message, time.monotonic() - begin)
    engine.save_checkpoint(root, tag="after", async_save=True)   # the ranks still pair up
    engine.wait_for_checkpoint()
    engine.comm.barrier()
    out["left"] = sorted(os.listdir(root))
    return out


def test_a_full_disk_fails_the_background_save_at_once_naming_it_even_without_markers(
        worlds, tmp_path):
    """The failing rank can write neither its file nor its marker: every rank still raises
    at its wait, at once, with that rank's "No space left on device"."""
    for res in worlds.run(2, _full_disk_job, str(tmp_path)):
        for failing in (1, 0):
            message, seconds = res[failing]
            assert message and f"rank {failing}" in message, (failing, message)
            assert "No space left" in message and "not published" in message, message
            assert seconds < SHORT_TIMEOUT_S / 2, (failing, seconds)
        assert res["left"] == ["after", "good", "latest", "zero_to_fp32.py"], res["left"]


def _staging_job(rank, world, root):
    from zerotrain.checkpoint import CheckpointError
    engine = _engine(2, comms_timeout=SHORT_TIMEOUT_S)
    _train(engine, rank, 0, 1)
    engine.save_checkpoint(root, tag="good", async_save=True)
    writer = engine._checkpoint_writer
    real = writer.buffer.stage

    def no_memory(items):
        raise RuntimeError("cannot allocate the staging buffer")
    if rank == 1:
        writer.buffer.stage = no_memory
    try:
        engine.save_checkpoint(root, tag="unstaged", async_save=True)
        message = None
    except CheckpointError as exc:
        message = str(exc)
    finally:
        writer.buffer.stage = real
    pending = writer.pending
    _train(engine, rank, 1, 1)
    engine.save_checkpoint(root, tag="next", async_save=True)   # the same collectives
    engine.wait_for_checkpoint()
    engine.comm.barrier()
    return {"message": message, "pending": pending, "left": sorted(os.listdir(root)),
            "latest": open(os.path.join(root, "latest")).read()}


def test_a_staging_failure_on_one_rank_fails_the_save_on_every_rank_and_starts_no_writer(
        worlds, tmp_path):
    for res in worlds.run(2, _staging_job, str(tmp_path)):
        assert res["message"] and "rank 1" in res["message"], res
        assert "staging buffer" in res["message"] and "unstaged" in res["message"], res
        assert not res["pending"], res
        assert res["latest"] == "next" and res["left"] == ["good", "latest", "next",
                                                           "zero_to_fp32.py"], res


def _two_engines_job(rank, world, root):
    """An actor and a critic of one job save into one directory: the critic's save waits for
    the actor's still in flight, and a refused save there releases nobody's lock."""
    import zerotrain
    from zerotrain.checkpoint import CheckpointError, fs
    actor = _engine(2, comms_timeout=SHORT_TIMEOUT_S)
    critic, *_ = zerotrain.initialize(model=R.make_model(1), config=R.engine_config(
        stage=1, comms_timeout=SHORT_TIMEOUT_S))
    _train(actor, rank, 0, 1)
    _train(critic, rank, 0, 1)
    _slow_markers()
    try:
        actor.save_checkpoint(root, tag="actor", async_save=True)
        in_flight = actor._checkpoint_writer.in_flight
        try:
            critic.save_checkpoint(root, tag="bad/tag")
            refused = None
        except CheckpointError as exc:
            refused = str(exc)
        still_locked = rank != 0 or os.path.realpath(root) in fs._held_locks
        critic.save_checkpoint(root, tag="critic", async_save=True)
        critic.wait_for_checkpoint()
        actor.wait_for_checkpoint()
    finally:
        _fast_markers()
    engine = _engine(2, seed=4)
    engine.load_checkpoint(root, tag="actor")
    loaded = R.max_diff(_params(engine), _params(actor))
    for e in (engine, actor, critic):
        e.close()
    return {"in_flight": in_flight, "refused": refused, "locked": still_locked,
            "loaded": loaded, "left": sorted(os.listdir(root)),
            "latest": open(os.path.join(root, "latest")).read()}


def test_two_engines_saving_into_one_directory_never_disturb_a_save_in_flight(worlds,
                                                                              tmp_path):
    for res in worlds.run(2, _two_engines_job, str(tmp_path)):
        assert res["in_flight"] and res["refused"] and res["locked"], res
        assert res["loaded"] == 0.0, res
        assert res["latest"] == "critic" and res["left"] == ["actor", "critic", "latest",
                                                             "zero_to_fp32.py"], res
