"""Run a function on N gloo ranks (spawned processes) and collect each rank's result.

A FileStore in a temporary directory does the rendezvous, so tests never race for ports.
A hard timeout turns a hang into a failure that names the ranks still running; an
exception on any rank fails the test with that rank's traceback.

:func:`run_world` starts a fresh world per call (for tests that break the process group on
purpose); :class:`WorldPool` keeps N ranks alive and runs many functions on them, so the
suite pays the start-up of a world once per world size.

Ranks are forked from multiprocessing's fork server, which has imported torch and zerotrain
once per test process (:data:`_PRELOAD`): a rank then costs a fork instead of an interpreter
start-up and those imports (about 3 s of CPU each, which a 2-core CI machine pays dozens of
times over a run; torch._dynamo, which the first optimizer imports, 1.5-2 s more). A forked
rank would carry the server's environment, so each rank takes the test process's
environment as it is when the rank starts, as a spawned one would. A forked rank leaves
by ``os._exit`` (no ``atexit`` handlers, no interpreter finalization): a test about what
happens at interpreter exit passes ``start="spawn"`` to :func:`run_world`.
"""
from __future__ import annotations

import faulthandler
import os
import pickle
import queue
import signal
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 240
_POLL_S = 1.0          # how often the pool checks that every rank is still alive
_STACK_DUMP_WAIT_S = 3.0
_CLOSE_WAIT_S = 5.0    # how long closing waits for ranks to exit before killing them
# torch._dynamo: torch.optim.Optimizer imports it on first use (about 800 modules, 1.5-2 s
# of CPU), which every fresh rank that builds an engine paid again
_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "zerotrain", "distributed",
            "reference"]


def _context(start: str = "forkserver"):
    """The fork server's context (the server, started on first use, imports :data:`_PRELOAD`;
    a module that fails to import there is left to the rank that needs it), or ``spawn``'s."""
    ctx = mp.get_context(start)
    if start == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _take_environment(env: dict[str, str], rank: int, world_size: int) -> None:
    """The test process's environment (not the fork server's) plus this rank's variables."""
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:   # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False


def _watch_faults() -> None:
    """A crashing rank prints its Python stack (SIGSEGV, SIGABRT, ...), and a hung one
    prints every thread's stack on SIGUSR1, so a failure names the line it happened on."""
    faulthandler.enable(all_threads=True)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)


def _describe_exit(code) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _rank_entry(fn: Callable, rank: int, world_size: int, store_path: str, out_dir: str,
                env: dict[str, str], args: tuple, kwargs: dict) -> None:
    import torch
    import torch.distributed as dist

    _watch_faults()
    _take_environment(env, rank, world_size)
    torch.set_num_threads(1)
    result: dict[str, Any]
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        result = {"ok": True, "value": fn(rank, world_size, *args, **kwargs)}
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_world(fn: Callable, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT_S,
              expect_error: bool = False, start: str = "forkserver", **kwargs) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks.

    Returns the per-rank return values. With ``expect_error`` the per-rank result dicts
    (``ok``, ``error``, ``traceback``) are returned instead of raising. ``start="spawn"``
    starts each rank as a new interpreter that exits like a script does (``atexit``
    handlers, then finalization), for tests about interpreter exit.
    """
    ctx = _context(start)
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_entry,
                             args=(fn, r, world_size, store_path, tmp, env, args, kwargs))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        _dump_stacks([procs[r] for r in hung])
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if hung:
            raise TimeoutError(f"ranks {hung} of {world_size} still running after {timeout}s")
        results = []
        for r in range(world_size):
            path = os.path.join(tmp, f"rank{r}.pkl")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} died without a result "
                                   f"({_describe_exit(procs[r].exitcode)})")
            with open(path, "rb") as f:
                results.append(pickle.load(f))
    if expect_error:
        return results
    failed = [(r, res) for r, res in enumerate(results) if not res["ok"]]
    if failed:
        rank, res = failed[0]
        raise AssertionError(f"rank {rank} failed: {res['error']}\n{res['traceback']}")
    return [res["value"] for res in results]


def _pool_rank(rank: int, world_size: int, store_path: str, owner: int, env: dict[str, str],
               tasks, results) -> None:
    import torch
    import torch.distributed as dist

    _watch_faults()
    _take_environment(env, rank, world_size)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                            world_size=world_size)
    while True:
        try:
            task = tasks.get(timeout=_POLL_S)
        except queue.Empty:
            if _gone(owner):  # the test process died: do not linger as an orphan
                os._exit(1)
            continue
        if task is None:
            break
        fn, args, kwargs, path = task
        for entry in path:
            if entry not in sys.path:
                sys.path.append(entry)
        try:
            result = {"ok": True, "value": fn(rank, world_size, *args, **kwargs)}
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc()}
        results.put((rank, pickle.dumps(result)))
    dist.destroy_process_group()


def _dump_stacks(procs) -> None:
    """Ask hung ranks to print every thread's Python stack (see :func:`_watch_faults`)."""
    if not hasattr(signal, "SIGUSR1"):
        return
    for p in procs:
        if p.is_alive() and p.pid is not None:
            os.kill(p.pid, signal.SIGUSR1)
    if procs:
        time.sleep(_STACK_DUMP_WAIT_S)


class WorldPool:
    """``world_size`` long-lived gloo ranks that run submitted functions one at a time."""

    def __init__(self, world_size: int) -> None:
        ctx = _context()
        self.world_size = world_size
        self._tmp = tempfile.TemporaryDirectory()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        store = os.path.join(self._tmp.name, "store")
        owner, env = os.getpid(), dict(os.environ)
        self._procs = [ctx.Process(target=_pool_rank, daemon=True,
                                   args=(r, world_size, store, owner, env, self._tasks[r],
                                         self._results))
                       for r in range(world_size)]
        for p in self._procs:
            p.start()

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable, *args, timeout: float = DEFAULT_TIMEOUT_S,
            expect_error: bool = False, **kwargs) -> list[Any]:
        """Like :func:`run_world`, on the pool's ranks. A hang or crash closes the pool."""
        for q in self._tasks:
            q.put((fn, args, kwargs, list(sys.path)))
        results: dict[int, dict] = {}
        deadline = time.monotonic() + timeout
        while len(results) < self.world_size:
            try:
                rank, payload = self._results.get(timeout=_POLL_S)
            except queue.Empty:
                self._check_progress(results, deadline, timeout)
                continue
            results[rank] = pickle.loads(payload)
        ordered = [results[r] for r in range(self.world_size)]
        if expect_error:
            return ordered
        failed = [(r, res) for r, res in enumerate(ordered) if not res["ok"]]
        if failed:
            self.close()  # a failed rank may have left a collective half done
            rank, res = failed[0]
            raise AssertionError(f"rank {rank} failed: {res['error']}\n{res['traceback']}")
        return [res["value"] for res in ordered]

    def _check_progress(self, results: dict[int, dict], deadline: float,
                        timeout: float) -> None:
        """Fail at once when a rank died (naming its signal and what the others said),
        or at the deadline when one hangs (after it printed its stacks)."""
        missing = sorted(set(range(self.world_size)) - set(results))
        dead = [r for r in missing if not self._procs[r].is_alive()]
        if dead:
            exits = ", ".join(f"rank {r} {_describe_exit(self._procs[r].exitcode)}"
                              for r in dead)
            others = "".join(f"\nrank {r}: {res['error']}" for r, res in sorted(results.items())
                             if not res["ok"])
            self.close()
            raise RuntimeError(f"{exits} without a result (its stack, if it crashed, is in "
                               f"the captured stderr){others}")
        if time.monotonic() > deadline:
            _dump_stacks([self._procs[r] for r in missing])
            self.close()
            raise TimeoutError(f"ranks {missing} of {self.world_size} gave no result "
                               f"within {timeout}s (their stacks are in the captured stderr; "
                               f"the pool was shut down)")

    def close(self) -> None:
        self._ask_to_stop()
        self._reap(time.monotonic() + _CLOSE_WAIT_S)

    def _ask_to_stop(self) -> None:
        for q in self._tasks:
            try:
                q.put(None)
            except (ValueError, OSError):
                pass

    def _reap(self, deadline: float) -> None:
        """Wait for the ranks until ``deadline``, then kill those still exiting."""
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        self._tmp.cleanup()


class Worlds:
    """One pool per world size, started on first use and restarted after a failure."""

    def __init__(self) -> None:
        self._pools: dict[int, WorldPool] = {}

    def run(self, world_size: int, fn: Callable, *args, **kwargs) -> list[Any]:
        pool = self._pools.get(world_size)
        if pool is None or not pool.alive:
            pool = self._pools[world_size] = WorldPool(world_size)
        return pool.run(fn, *args, **kwargs)

    def close(self) -> None:
        """Every pool's ranks exit together (one shared wait, not one per pool in turn)."""
        for pool in self._pools.values():
            pool._ask_to_stop()
        deadline = time.monotonic() + _CLOSE_WAIT_S
        for pool in self._pools.values():
            pool._reap(deadline)
        self._pools.clear()
