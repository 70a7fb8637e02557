"""``deepspeed.tp_model_init`` (transformers' Trainer calls it before ``initialize`` when the
config sets ``tensor_parallel.autotp_size``): record-only, checked against the config."""
import pytest
import torch

import zerotrain
from zerotrain.errors import ConfigError
from zerotrain.tp import check_recorded


def _model():
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))


def test_tp_model_init_returns_the_model_uncut():
    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert zerotrain.tp_model_init(model, tp_size=2, dtype=torch.float32, config={}) is model
    after = dict(model.named_parameters())
    assert before.keys() == after.keys()
    assert all(torch.equal(before[n], after[n]) for n in before)


@pytest.mark.parametrize("config_size, dtype, match", [
    (0, torch.float32, "sets no tensor_parallel.autotp_size"),
    (4, torch.float32, "tp_model_init\\(tp_size=2\\)"),
    (2, torch.bfloat16, "trains in torch.float32"),
])
def test_what_tp_model_init_recorded_must_agree_with_the_config(config_size, dtype, match):
    model = zerotrain.tp_model_init(_model(), tp_size=2, dtype=dtype)
    with pytest.raises(ConfigError, match=match):
        check_recorded(model, config_size, torch.float32)


def test_an_agreeing_record_and_a_model_without_one_pass():
    check_recorded(zerotrain.tp_model_init(_model(), 2, torch.float32), 2, torch.float32)
    check_recorded(_model(), 0, torch.float32)


@pytest.mark.parametrize("kwargs, match", [({"tp_size": 0}, "positive int"),
                                           ({"tp_size": 2, "tp_group": object()}, "tp_group")])
def test_bad_tp_model_init_arguments_are_named(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        zerotrain.tp_model_init(_model(), dtype=torch.float32, **kwargs)


def test_initialize_refuses_a_record_the_config_contradicts(worlds):
    assert worlds.run(1, _initialize_with_a_contradicting_record) == ["refused"]


def _initialize_with_a_contradicting_record(rank, world):
    model = zerotrain.tp_model_init(_model(), tp_size=2, dtype=torch.float32)
    try:
        zerotrain.initialize(model=model, model_parameters=model.parameters(), config={
            "train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    except ConfigError as error:
        return "refused" if "autotp_size" in str(error) else str(error)
    return "accepted"
