"""A clean interpreter exit for processes that used a gloo process group.

Note: exit aborts
    With torch 2.11-2.13 on gloo, a process that has finished its script sometimes dies at
    interpreter exit with ``terminate called without an active exception`` (SIGABRT; torchrun
    reports the job failed and its restart policy starts it again). Plain DDP does it too.
    A gloo worker thread (``pt_gloo_runloop``) drops the last reference to a finished
    collective's work after the main thread has begun interpreter finalization; that
    release decrefs Python objects, which needs the GIL; the finalizing interpreter makes the
    thread exit, and the unwind through a ``noexcept`` destructor calls ``std::terminate``.

    :func:`install` registers :func:`at_exit` with ``atexit`` once per process, when
    zerotrain initialises or adopts a process group. At exit it destroys a gloo-only default
    group, collects recent garbage, then sleeps with the GIL released so that the worker threads
    finish those releases while the interpreter is still alive. The sleep is what matters
    (destroying the group alone does not stop gloo's threads); it is the cost of the
    teardown: :data:`EXIT_PAUSE_S` per process exit, extended in steps of
    :data:`_POLL_S` while a ``pt_gloo_runloop`` thread is still runnable (a loaded machine),
    up to :data:`MAX_PAUSE_S`. ``os._exit`` is never used: it would skip other ``atexit``
    handlers and turn ``sys.exit(3)`` into exit code 0.

    A group that uses NCCL is left to torch (destroying it can block on a lost peer).
"""
from __future__ import annotations

import atexit
import gc
import glob
import logging
import time

import torch.distributed as dist

logger = logging.getLogger(__name__)

EXIT_PAUSE_S = 0.1
MAX_PAUSE_S = 1.0
_POLL_S = 0.01
_GLOO_THREAD = "pt_gloo_runloop"
_registered: list[bool] = []  # one entry once at_exit is registered in this process


def install() -> None:
    """Register :func:`at_exit` once per process (call after a group exists or is adopted)."""
    if _registered:
        return
    atexit.register(at_exit)
    _registered.append(True)


def at_exit(pause_s: float = EXIT_PAUSE_S) -> None:
    """Destroy a gloo default group, collect garbage, and pause with the GIL released.

    Runs from ``atexit``; never raises (an exception here would change nothing but the
    output of a job that has already finished).
    """
    try:
        if dist.is_available() and dist.is_initialized() and _gloo_only():
            dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - the job is over; say so and carry on
        logger.debug("exit teardown: destroying the process group failed: %s", exc)
    gc.collect(1)   # the young generations: a full pass over torch's objects costs ~0.1-0.5 s
    time.sleep(pause_s)
    waited = pause_s
    while waited < MAX_PAUSE_S and _gloo_thread_runnable():
        time.sleep(_POLL_S)
        waited += _POLL_S


def _gloo_thread_runnable() -> bool:
    """Whether a gloo worker thread of this process is running or waiting for a CPU (Linux
    ``/proc``; False where there is none)."""
    for task in glob.glob("/proc/self/task/*"):
        try:
            with open(f"{task}/comm") as f:
                name = f.read().strip()
            if name != _GLOO_THREAD:
                continue
            with open(f"{task}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state == "R":
            return True
    return False


def _gloo_only() -> bool:
    """True when the default group runs on gloo alone (``gloo``, or ``cpu:gloo``)."""
    backend = str(dist.get_backend())
    return "nccl" not in backend and "gloo" in backend
