"""The engine's accumulation window (engine/window.py): its transition table, that only the
window writes its fields, and single-process engine runs through its phases."""
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
