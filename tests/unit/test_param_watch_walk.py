"""The parameter watch walks its model at a forward only after a module or parameter was
registered somewhere (Note "parameters the engine does not hold" in stages/param_watch.py)."""
import logging

import torch
from torch import nn

from zerotrain.stages.param_watch import ParameterWatch, TrackedParameters


def test_a_forward_walks_the_model_only_after_a_registration(caplog):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    watch = ParameterWatch(model, {id(p) for p in model.parameters()})
    watch.install()
    walks = []
    modules = model.modules
    model.modules = lambda: (walks.append(1), modules())[1]
    x = torch.randn(2, 4)
    try:
        model(x)
        model(x)
        assert walks == []   # nothing registered: no walk
        model.append(nn.Linear(4, 4))   # attached after install
        with caplog.at_level(logging.WARNING, logger="zerotrain.stages.param_watch"):
            model(x)
        assert len(walks) == 1
        late = model[2]._parameters
        assert type(late) is TrackedParameters and late._watch is watch
        assert "2.weight (4, 4), 2.bias (4,)" in caplog.text
        model(x)
        assert len(walks) == 1   # adopted once
        model[0].extra = nn.Parameter(torch.zeros(3))   # a parameter: noted, walked
        model(x)
        assert len(walks) == 2
    finally:
        watch.uninstall()
    model.append(nn.Linear(4, 4))   # an uninstalled watch is no longer marked
    assert not watch.stale
