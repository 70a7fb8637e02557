"""The engine's accumulation window (engine/window.py): its transition table, that only the
window writes its fields, and single-process engine runs through its phases."""
import ast
from pathlib import Path

import pytest

from zerotrain.engine.window import EVENTS, TRANSITIONS, AccumulationWindow, Phase
from zerotrain.errors import StateError

SRC = Path(__file__).resolve().parents[2] / "src" / "zerotrain"


class _Outcome:
    applied = True


# each event with the arguments its method takes
_CALLS = {
    "begin_backward": lambda w: w.begin_backward(),
    "end_backward": lambda w: w.end_backward(boundary=True),
    "fail_backward": lambda w: w.fail_backward(),
    "abandon_backward": lambda w: w.abandon_backward(),
    "enter_no_sync": lambda w: w.enter_no_sync(),
    "leave_no_sync": lambda w: w.leave_no_sync(False),
    "enter_coalescing": lambda w: w.enter_coalescing(),
    "leave_coalescing": lambda w: w.leave_coalescing(),
    "begin_step": lambda w: w.begin_step(),
    "took_update": lambda w: w.took_update("engine.step()", _Outcome()),
    "end_step": lambda w: w.end_step(),
    "end_micro_step": lambda w: w.end_micro_step(),
    "drop_window": lambda w: w.drop_window("engine.step()"),
    "reduced_local": lambda w: w.reduced_local(),
    "zero_grad": lambda w: w.zero_grad(),
    "request_drop_at_backward": lambda w: w.request_drop_at_backward(),
    "set_boundary_override": lambda w: w.set_boundary_override(True),
    "reset_after_load": lambda w: w.reset_after_load(),
    "set_lr_step_due": lambda w: w.set_lr_step_due({}),
    "take_lr_step_due": lambda w: w.take_lr_step_due(),
}

# the call each event names in its refusal
_NAMES = {"begin_backward": "engine.backward()", "begin_step": "engine.step()",
          "took_update": "engine.step()", "zero_grad": "engine.zero_grad()",
          "enter_no_sync": "engine.no_sync()",
          "enter_coalescing": "engine.coalesce_grad_reduction()",
          "request_drop_at_backward": "optimizer.zero_grad()",
          "set_boundary_override": "engine.set_gradient_accumulation_boundary()",
          "reset_after_load": "engine.load_checkpoint()"}


def test_every_event_has_a_method_and_every_phase_is_reachable_and_left():
    assert set(_CALLS) == set(EVENTS)
    reached = {after for after in TRANSITIONS.values()}
    left = {phase for phase, _ in TRANSITIONS}
    assert reached == set(Phase) and left == set(Phase)


@pytest.mark.parametrize("phase", list(Phase), ids=lambda p: p.name)
@pytest.mark.parametrize("event", EVENTS)
def test_each_phase_and_event_moves_as_the_table_says_or_is_refused(phase, event):
    window = AccumulationWindow()
    window.phase = phase
    if (phase, event) in TRANSITIONS:
        _CALLS[event](window)
        assert window.phase is TRANSITIONS[(phase, event)]
        return
    before = {name: getattr(window, name) for name in AccumulationWindow.__slots__}
    with pytest.raises(StateError) as info:
        _CALLS[event](window)
    message = str(info.value)
    assert f"(phase {phase.name})" in message and phase.value in message
    if event in _NAMES:
        assert message.startswith(_NAMES[event])
    assert {name: getattr(window, name) for name in AccumulationWindow.__slots__} == before


def test_a_step_called_from_a_backward_names_both():
    window = AccumulationWindow()
    window.begin_backward()
    with pytest.raises(StateError, match=r"^engine\.step\(\) during a backward "
                                         r"\(phase BACKWARD\): "):
        window.begin_step()


def test_a_backward_that_raised_unseen_is_failed_before_the_next_event():
    """The probe (a direct loss.backward() that raised): the next event finds FAILED, where
    leaving no_sync and zero_grad are allowed and the engine's end returns the window."""
    over = [False]
    window = AccumulationWindow(backward_raised=lambda: over[0])
    outer = window.enter_no_sync()
    window.begin_backward("loss.backward()")
    with pytest.raises(StateError, match="phase BACKWARD"):   # still running: refused
        window.zero_grad()
    over[0] = True
    window.leave_no_sync(outer)
    assert window.phase is Phase.FAILED and not window.inside_no_sync
    window.zero_grad()
    window.fail_backward()
    window.end_backward(boundary=False)
    assert window.phase is Phase.MICRO_STEP and window.backward_in_window


def test_the_window_counts_backwards_and_the_update_resets_them():
    window = AccumulationWindow()
    for local, kept in ((True, 1), (True, 2), (False, 0)):   # the last one reduces all
        outer = window.enter_no_sync() if local else False
        window.begin_backward()
        window.end_backward(boundary=not local)
        window.leave_no_sync(outer)
        assert window.local_backwards == kept
    assert (window.window_backwards, window.micro_backwards) == (3, 3)
    window.begin_step()
    assert window.in_step and not window.step_applied
    window.took_update("engine.step()", _Outcome())
    window.end_step()
    assert window.phase is Phase.STEPPED and window.updated_by == "engine.step()"
    assert (window.backward_in_window, window.window_backwards, window.step_applied) == (
        False, 0, True)
# ---------------------------------------------------------------------- one writer
_FIELDS = frozenset(s for s in AccumulationWindow.__slots__ if not s.startswith("_")) | {
    "coalescing", "in_step"}
# the engine's former names of the same fields
_OLD = frozenset({"_step_applied", "_lr_step_due", "_backward_in_window", "_updated_by",
                  "_drop_grads_at_backward", "inside_no_sync_ctxt", "_local_backwards",
                  "_boundary_override", "_coalescing", "_in_step", "_window_backwards",
                  "_micro_backwards", "_last_outcome", "_is_gradient_accumulation_boundary"})


def _names_the_window(node: ast.AST) -> bool:
    """``<x>.accumulation_window`` or a name ``window``: ``phase`` is a common attribute
    name elsewhere (planner, buckets), so only the window's is checked."""
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
    return name in ("accumulation_window", "window")


def _assigned_attributes(tree: ast.AST):
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and (sub.attr != "phase"
                                                       or _names_the_window(sub.value)):
                    yield sub.attr, node.lineno
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "setattr" and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)):
            yield node.args[1].value, node.lineno


def test_only_the_window_assigns_the_window_fields():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path == SRC / "engine" / "window.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found += [f"{path.relative_to(SRC)}:{line} assigns .{name}"
                  for name, line in _assigned_attributes(tree) if name in _FIELDS | _OLD]
    assert found == []


def test_the_checker_sees_an_assignment():
    tree = ast.parse("engine.accumulation_window.backward_in_window = True\n"
                     "self._coalescing = False\nsetattr(w, 'updated_by', None)\n"
                     "window.phase = None\nplan.phase = 'gather'\n")
    assert sorted(name for name, _ in _assigned_attributes(tree)) == [
        "_coalescing", "accumulation_window", "backward_in_window", "phase", "updated_by"]


# ---------------------------------------------------------------------- engine runs
def _engine(stage, *, ga=1, **extra):
    import zerotrain
    import reference as R
    model = R.make_model()
    engine, *_ = zerotrain.initialize(model=model, config=R.engine_config(
        stage=stage, ga=ga, **extra))
    return engine, model


def _batch(i):
    import reference as R
    return R.micro_batch(0, 0, i)


def _runs(rank, world):
    """Each loop's phases, as names, where the window is read."""
    import reference as R
    out = {}

    # managed, ga 2; a step from a backward hook is refused, naming the phase
    engine, _ = _engine(1, ga=2)
    phases, refused = [], []

    def hook(grad):
        phases.append(engine.accumulation_window.phase.name)
        try:
            engine.step()
        except StateError as exc:
            refused.append(str(exc))
        return grad
    for i in range(2):
        loss = engine(*_batch(i))
        loss.register_hook(hook)
        engine.backward(loss)
        phases.append(engine.accumulation_window.phase.name)
        engine.step()
        phases.append((engine.accumulation_window.phase.name, engine.was_step_applied()))
    out["managed"] = (phases, refused[0].split(":")[0], engine.global_steps)
    engine.close()

    # unmanaged: two backwards, one step ends the window; the boundary only inside step()
    engine, _ = _engine(1, ga=2, managed_gradient_accumulation=False)
    for i in range(2):
        engine.backward(engine(*_batch(i)))
    before = engine.is_gradient_accumulation_boundary()
    engine.step()
    out["unmanaged"] = (before, engine.accumulation_window.phase.name,
                        engine.was_step_applied(), engine.global_steps)
    engine.close()

    # no_sync: a local backward, then the window's last one outside reduces both
    engine, _ = _engine(1, ga=2)
    with engine.no_sync():
        engine.backward(engine(*_batch(0)))
        inside = (engine.inside_no_sync_ctxt, engine.accumulation_window.local_backwards)
    engine.step()
    engine.backward(engine(*_batch(1)))
    left = engine.accumulation_window.local_backwards
    engine.step()
    out["no_sync"] = (inside, engine.inside_no_sync_ctxt, left,
                      engine.accumulation_window.phase.name)
    engine.close()

    # coalesce_grad_reduction at stage 2: the block's phase, back to MICRO_STEP at its exit
    engine, _ = _engine(2)
    with engine.coalesce_grad_reduction():
        for i in range(2):
            engine.backward(engine(*_batch(i)))
        in_block = engine.accumulation_window.phase.name
    after = engine.accumulation_window.phase.name
    engine.step()
    out["coalesce"] = (in_block, after, engine.accumulation_window.phase.name,
                       engine.global_steps)
    engine.close()

    # optimizer.step() instead of engine.step(); engine.step() after it keeps its refusal
    engine, _ = _engine(2)
    engine.backward(engine(*_batch(0)))
    engine.optimizer.step()
    stepped = (engine.accumulation_window.phase.name, engine.accumulation_window.updated_by)
    try:
        engine.step()
        second = None
    except StateError as exc:
        second = str(exc).split(":")[0]
    out["optimizer_step"] = (stepped, second, engine.global_steps)
    engine.close()

    # a direct backward that fails: no_sync() after it finds it over (FAILED), and the
    # next step ends it and updates
    engine, model = _engine(1)
    fail = [True]
    model.inp.register_forward_hook(
        lambda m, args, y: R.RaiseInBackward.apply(y) if fail[0] else y)
    raised = False
    try:
        engine(*_batch(0)).backward()
    except RuntimeError as exc:
        raised = "injected" in str(exc)
    with engine.no_sync():
        stuck = engine.accumulation_window.phase.name
    engine.step()
    fail[0] = False
    out["failed_direct"] = (raised, stuck, engine.accumulation_window.phase.name,
                            engine.was_step_applied())
    # and a failing engine.backward is ended at once
    fail[0] = True
    try:
        engine.backward(engine(*_batch(1)))
    except RuntimeError:
        pass
    fail[0] = False
    ended = engine.accumulation_window.phase.name
    engine.step()
    out["failed_backward"] = (ended, engine.accumulation_window.phase.name)
    engine.close()

    # a backward whose end raises (a vote's verdict at its last launch) counts nothing and
    # leaves the window idle: the next backward is not refused as "during a backward"
    engine, _ = _engine(1)
    finish = engine.stage.finish_backward

    def failing():
        engine.stage.finish_backward = finish
        raise RuntimeError("injected at the end of the backward")
    engine.stage.finish_backward = failing
    try:
        engine.backward(engine(*_batch(0)))
    except RuntimeError:
        window = engine.accumulation_window
        out["failed_end"] = [window.phase.name, window.backward_in_window]
    engine.backward(engine(*_batch(1)))
    engine.step()
    out["failed_end"] += [engine.accumulation_window.phase.name, engine.was_step_applied()]
    engine.close()

    # optimizer.step() after a failed direct backward ends it first, as engine.step() does
    engine, model = _engine(2)
    fail = [True]
    model.inp.register_forward_hook(
        lambda m, args, y: R.RaiseInBackward.apply(y) if fail[0] else y)
    try:
        engine(*_batch(0)).backward()
    except RuntimeError:
        fail[0] = False
    engine.optimizer.step()
    out["failed_then_optimizer_step"] = (engine.accumulation_window.phase.name,
                                         engine.was_step_applied())
    engine.close()

    # a Trainer's short last window: the next backward ends it, and step() updates
    engine, _ = _engine(1, ga=4)
    engine.backward(engine(*_batch(0)))
    engine.step()
    engine.end_window_at_next_backward()
    engine.backward(engine(*_batch(1)))
    engine.step()
    out["short_window"] = (engine.micro_steps, engine.global_steps, engine.was_step_applied())
    engine.close()
    return out


@pytest.mark.slow
def test_engine_loops_move_the_window_through_its_phases(worlds):
    out, = worlds.run(1, _runs)
    phases, refused, steps = out["managed"]
    assert phases == ["BACKWARD", "MICRO_STEP", ("MICRO_STEP", False),
                      "BACKWARD", "MICRO_STEP", ("STEPPED", True)]
    assert refused == "engine.step() during a backward (phase BACKWARD)" and steps == 1
    assert out["unmanaged"] == (False, "STEPPED", True, 1)
    assert out["no_sync"] == ((True, 1), False, 0, "STEPPED")
    assert out["coalesce"] == ("COALESCING", "MICRO_STEP", "STEPPED", 1)
    assert out["optimizer_step"] == (("STEPPED", "optimizer.step()"),
                                     "engine.step() after optimizer.step() with no backward "
                                     "between", 0)
    assert out["failed_direct"] == (True, "FAILED", "STEPPED", True)
    assert out["failed_backward"] == ("MICRO_STEP", "STEPPED")
    assert out["failed_then_optimizer_step"] == ("STEPPED", True)
    assert out["failed_end"] == ["MICRO_STEP", False, "STEPPED", True]
    assert out["short_window"] == (4, 1, True)
