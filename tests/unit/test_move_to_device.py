"""``deepspeed.runtime.utils.move_to_device`` (``zerotrain.core.runtime_utils``), which
Accelerate's ALST script calls on each batch: DeepSpeed's semantics."""
import pytest
import torch

from zerotrain.core.runtime_utils import move_to_device


def test_containers_are_rebuilt_and_tensors_moved():
    t = torch.ones(2)
    batch = {"a": t, "b": [t, (t, t)]}
    out = move_to_device(batch, torch.device("cpu"))
    assert out is not batch and isinstance(out["b"][1], tuple)
    assert torch.equal(out["b"][1][0], t)


def test_criterion_moves_in_place_and_others_need_to():
    t = torch.ones(2, dtype=torch.float64)
    moved = move_to_device(t, torch.float32, criterion_func=lambda x: torch.is_tensor(x))
    assert moved is t and t.dtype == torch.float32   # .data replaced, the object kept
    with pytest.raises(AttributeError):   # DeepSpeed calls .to() on anything else
        move_to_device(3, "cpu")


def test_the_switch_resolves_it():
    from zerotrain import as_deepspeed
    assert as_deepspeed.ALIASES["deepspeed.runtime.utils"] == "zerotrain.core.runtime_utils"
    import zerotrain.core.runtime_utils as runtime_utils
    from zerotrain.core.memory import see_memory_usage
    assert runtime_utils.see_memory_usage is see_memory_usage
