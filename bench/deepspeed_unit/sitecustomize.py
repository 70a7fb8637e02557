"""Harness adaptation for running DeepSpeed's unit tests on 2 CPU ranks (``run.sh``).

Python imports ``sitecustomize`` at start-up when it is on ``PYTHONPATH``, so this runs in
every process of the run: the pytest parent, the forkserver and each rank of DeepSpeed's
process pool. It does two things, and touches no test:

* ``ZEROTRAIN_AS_DEEPSPEED=1``: installs zerotrain's ``deepspeed`` switch, so each rank
  imports zerotrain where the test imports ``deepspeed``.
* In both modes, a test that fails inside a rank by ``pytest.fail`` or an unmet
  ``pytest.raises`` raises pytest's ``Failed``, a ``BaseException``. ``multiprocessing``'s
  pool worker catches only ``Exception``, so the rank dies, its result never comes, the
  parent waits out ``DS_UNITTEST_TIMEOUT`` and then ``pytest.exit`` stops the whole run
  (after hanging in ``Pool.join``). Here such an error leaves the rank as an
  ``AssertionError`` with the same message, so it fails that test alone. ``Skipped`` is
  left alone (the harness catches it itself), and so are ``SystemExit`` and
  ``KeyboardInterrupt``.
* In both modes, the forkserver that DeepSpeed's harness forks every rank from imports, once,
  what the ranks would otherwise import in every test (``_forkserver_preload.py`` says why and
  what): the test modules and torch's lazily imported modules. Each test then starts its ranks
  without seconds of imports per rank. ``DS_UNIT_NO_PRELOAD=1`` turns it off.
"""
import json
import multiprocessing.forkserver
import multiprocessing.pool
import os
import sys
import tempfile

_starmapstar = multiprocessing.pool.starmapstar


def _failures_as_assertions(args):
    try:
        return _starmapstar(args)
    except (Exception, SystemExit, KeyboardInterrupt):
        raise
    except BaseException as error:  # pytest's Failed (an OutcomeException)
        raise AssertionError(f"{type(error).__name__}: {error}") from None


multiprocessing.pool.starmapstar = _failures_as_assertions

_ensure_running = multiprocessing.forkserver.ForkServer.ensure_running
_SKIP = ("__main__", "__mp_main__", "conftest", "sitecustomize", "_forkserver_preload")


def _ensure_running_preloaded(self):
    """Start the forkserver with this process's modules listed for it to import first."""
    if self._forkserver_pid is None and os.environ.get("DS_UNIT_NO_PRELOAD") != "1":
        modules = [name for name in list(sys.modules) if name not in _SKIP]
        with tempfile.NamedTemporaryFile("w", suffix="_preload.json", delete=False) as f:
            json.dump({"path": list(sys.path), "modules": modules}, f)
        os.environ["DS_UNIT_FORKSERVER_PRELOAD"] = f.name
        self._preload_modules = ["_forkserver_preload"]
    return _ensure_running(self)


multiprocessing.forkserver.ForkServer.ensure_running = _ensure_running_preloaded

if os.environ.get("ZEROTRAIN_AS_DEEPSPEED") == "1":
    import zerotrain.as_deepspeed

    zerotrain.as_deepspeed.install()

# The real DeepSpeed run (baseline) only: ``DS_NO_JIT=op1,op2`` makes those ops' JIT build
# fail at once with a RuntimeError naming the op, instead of compiling it (10-15 minutes an
# op on 2 busy cores). A test that needs one fails, and the log says why.
_no_jit = {name for name in os.environ.get("DS_NO_JIT", "").split(",") if name}
if _no_jit and os.environ.get("ZEROTRAIN_AS_DEEPSPEED") != "1":
    from deepspeed.ops.op_builder import builder as _builder

    _jit_load = _builder.OpBuilder.jit_load

    def _refuse_listed_builds(self, verbose=True):
        if self.name in _no_jit:
            raise RuntimeError(f"op {self.name} is not built and DS_NO_JIT forbids "
                               "compiling it in this run")
        return _jit_load(self, verbose)

    _builder.OpBuilder.jit_load = _refuse_listed_builds
