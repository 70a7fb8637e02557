"""``zero3_linear_wrap`` / ``LinearFunctionForZeroStage3`` (``deepspeed.runtime.zero.linear``):
F.linear's values and gradients for 1-, 2- and 3-d inputs, under ``torch.func`` and with
forward's autocast state replayed in backward."""
import pytest
import torch
import torch.nn.functional as F

from zerotrain.zero.linear import LinearFunctionForZeroStage3, zero3_linear_wrap


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


@pytest.mark.parametrize("shape", [(5,), (3, 5), (2, 3, 5)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_values_and_gradients_equal_f_linear(shape, with_bias):
    torch.manual_seed(0)
    x, w, b = torch.randn(shape), torch.randn(4, 5), torch.randn(4)
    ours, ref = _leaves(x, w, b), _leaves(x, w, b)
    out = zero3_linear_wrap(ours[0], ours[1], ours[2] if with_bias else None)
    expected = F.linear(ref[0], ref[1], ref[2] if with_bias else None)
    assert "LinearFunctionForZeroStage3" in type(out.grad_fn).__name__
    torch.testing.assert_close(out, expected)
    (out * torch.arange(4.0)).sum().backward()
    (expected * torch.arange(4.0)).sum().backward()
    for a, e in zip(ours[:3 if with_bias else 2], ref):
        torch.testing.assert_close(a.grad, e.grad)
    if not with_bias:
        assert ours[2].grad is None


def test_torch_func_grad_and_vmap():
    torch.manual_seed(0)
    w, b, xs = torch.randn(4, 5), torch.randn(4), torch.randn(3, 5)
    grads = torch.func.grad(lambda w_, x_: zero3_linear_wrap(x_, w_, b).square().sum(),
                            argnums=(0, 1))(w, xs)
    ref = torch.func.grad(lambda w_, x_: F.linear(x_, w_, b).square().sum(),
                          argnums=(0, 1))(w, xs)
    for a, e in zip(grads, ref):
        torch.testing.assert_close(a, e)
    y = torch.func.vmap(lambda x: LinearFunctionForZeroStage3.apply(x, w, b).sum())(xs)
    torch.testing.assert_close(y, F.linear(xs, w, b).sum(-1))


def test_backward_replays_forwards_autocast_state():
    w, x, b = _leaves(torch.randn(4, 4), torch.randn(2, 4), torch.randn(4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = zero3_linear_wrap(x, w, b)
    assert out.dtype == torch.bfloat16 and out.grad_fn._fwd_used_autocast
    out.float().sum().backward()
    assert {w.grad.dtype, x.grad.dtype, b.grad.dtype} == {torch.float32}
    w2, x2 = _leaves(w, x)
    out = zero3_linear_wrap(x2, w2)   # forward outside autocast: backward in full precision
    assert out.grad_fn._fwd_used_autocast is False and out.grad_fn._dtype is not None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out.sum().backward()
    torch.testing.assert_close(w2.grad, torch.ones(4, 2) @ x2.detach(), rtol=0, atol=0)
