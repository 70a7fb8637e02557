"""What the engine keeps about the stage that holds a model (Note "one open engine per
model" in engine/ownership.py) lives in its registry, not on the stage, and goes with the
stage."""
import gc
import weakref

from torch import nn

from zerotrain.engine import ownership
from zerotrain.stages.param_watch import ParameterWatch


class FakeStage:
    """What ``claim``/``close_stage`` ask of a stage: ``close()``; stage 3's
    ``gather_external`` is a bound method, which the parameter watch holds."""

    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1

    def gather_external(self, param: nn.Parameter) -> None:
        pass


class FakeEngine:
    pass


def test_a_claim_writes_nothing_onto_the_stage_and_closing_refuses_by_the_registry():
    model, stage, engine = nn.Linear(2, 2), FakeStage(), FakeEngine()
    before = dict(vars(stage))
    held = ownership.claim(stage, model, engine=engine)
    watch = ParameterWatch(model, held.params, gather_external=stage.gather_external)
    watch.install()
    held.watch(watch)
    assert vars(stage) == before
    assert ownership.open_stage_of(model) == ("weight", stage)
    assert ownership.claim_of(stage).holder() is engine
    assert not ownership.is_closed(stage)

    ownership.close_stage(stage, model)
    assert vars(stage) == {**before, "closed": 1}
    assert ownership.is_closed(stage) and ownership.open_stage_of(model) is None
    assert watch._handles == []   # the watch was uninstalled through the claim
    assert not any(hasattr(p, "_zerotrain_stage") for p in model.parameters())


def test_a_stage_never_claimed_is_open_until_closed():
    model, stage = nn.Linear(2, 2), FakeStage()
    assert not ownership.is_closed(stage) and not ownership.is_closed(None)
    ownership.close_stage(stage, model)   # an inference engine at stages 0-2 claims nothing
    assert ownership.is_closed(stage)


def test_the_registry_lets_a_dropped_stage_go_even_with_its_watch_holding_it():
    model, stage = nn.Linear(2, 2), FakeStage()
    gc.collect()   # stages earlier tests dropped leave the registry now, not during this one
    entries = len(ownership._CLAIMS)
    held = ownership.claim(stage, model, engine=FakeEngine())
    watch = ParameterWatch(model, held.params, gather_external=stage.gather_external)
    held.watch(watch)
    gone = weakref.ref(stage)
    del stage, held, watch
    model = None
    gc.collect()
    assert gone() is None
    assert len(ownership._CLAIMS) <= entries   # its entry went with it (others may have too)
