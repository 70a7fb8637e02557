"""Tiled compute along the sequence (``zerotrain.sequence.tiled``) equals the untiled
computation, in one process: outputs bitwise, input gradients bitwise, weight gradients to
summation order (the tiles add a weight's gradient in pieces: fp32 within 1e-6 of the
largest gradient, bf16 within 1e-2), also when the loss is scaled before backward;
against the real DeepSpeed's ``TiledMLP``/``TiledFusedLogitsLoss`` where it is importable;
bad inputs raise one named ``TilingError``.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tiled_model as T
from zerotrain.errors import TilingError
from zerotrain.sequence import tiled

# a folder holding a DeepSpeed 0.19.8 installation (pip install --target), or unset
REAL_DEEPSPEED = os.environ.get("ZEROTRAIN_DEEPSPEED_PATH", "")
DS_MODULE = "deepspeed.runtime.sequence_parallel.ulysses_sp"


def _close(a: dict, b: dict, rel: float) -> None:
    for name in a:
        scale = max(a[name].abs().max().item(), 1e-30)
        diff = (a[name] - b[name]).abs().max().item()
        assert diff <= rel * scale, (name, diff, scale)


@pytest.mark.parametrize("mlp,loss", [(4, 1), (1, 4), (5, 7), (3, 48)])
def test_tiled_mlp_and_loss_equal_the_untiled_model(mlp, loss):
    plain, tiles = T.gradients(1, 1), T.gradients(mlp, loss)
    assert torch.equal(plain["loss"], tiles["loss"])
    if mlp == 1:   # the MLPs untiled: every gradient before the loss is bitwise equal
        assert all(torch.equal(plain[n], tiles[n]) for n in plain if not n.startswith("lm_head"))
    _close(plain, tiles, 1e-6)
    assert (plain["lm_head.weight"] - tiles["lm_head.weight"]).abs().max() > 0 or loss == 1


def test_a_scaled_loss_scales_every_gradient_the_tiled_loss_made():
    """The engine multiplies the loss (1/accumulation steps, fp16's scale) before backward:
    the head's gradient follows it (DeepSpeed's in-forward backward would not)."""
    _close(T.gradients(1, 1, scale=0.25), T.gradients(2, 4, scale=0.25), 1e-6)


def test_bf16_tiled_equals_untiled_to_bf16_rounding():
    plain, tiles = T.gradients(1, 1, dtype=torch.bfloat16), T.gradients(4, 3, dtype=torch.bfloat16)
    assert torch.equal(plain["loss"], tiles["loss"])
    _close(plain, tiles, 1e-2)


def _mlp_fn(self, x):
    return x.pow(2) * self


def test_tiled_mlp_on_2d_input_and_input_gradient_bitwise():
    w = torch.randn(6)
    x = torch.randn(10, 6, requires_grad=True)
    out = tiled.TiledMLP.apply(_mlp_fn, w, x, 3, [])
    assert torch.equal(out, _mlp_fn(w, x.detach()))
    out.sum().backward()
    assert torch.equal(x.grad, 2 * x.detach() * w)


def test_autograd_compute_mlp_recomputes_and_equals_the_mlp():
    torch.manual_seed(0)
    mlp = T.MLP()
    x = torch.randn(2, 5, T.HIDDEN, requires_grad=True)
    out = tiled.AutogradComputeMLP.apply(T.MLP.plain, mlp, x)
    assert out.grad_fn is not None and torch.equal(out, T.MLP.plain(mlp, x.detach()))
    out.sum().backward()
    ref_x = x.detach().clone().requires_grad_()
    ref = T.MLP()
    ref.load_state_dict(mlp.state_dict())
    T.MLP.plain(ref, ref_x).sum().backward()
    assert torch.equal(x.grad, ref_x.grad)
    assert torch.equal(mlp.down_proj.weight.grad, ref.down_proj.weight.grad)


@pytest.mark.parametrize("reduction", ["mean", "sum", None])
def test_sequence_tiled_compute_equals_the_untiled_function(reduction):
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 5)
    x = torch.randn(2, 9, 8, requires_grad=True)
    mask = torch.rand(2, 9, 1)

    def fn(x, mask, scale):
        return linear(x) * mask * scale

    out = tiled.sequence_tiled_compute(fn, 9, 3, {"x": x, "mask": mask}, {"scale": 2.0}, "x",
                                       compute_params=[linear.weight, linear.bias],
                                       output_reduction=reduction)
    ref_x = x.detach().clone().requires_grad_()
    ref_linear = torch.nn.Linear(8, 5)
    ref_linear.load_state_dict(linear.state_dict())
    full = ref_linear(ref_x) * mask * 2.0
    # "mean" is DeepSpeed's mean over the tiles' outputs joined on dim 1: the mean of all
    ref = {"mean": full.mean(), "sum": full.sum(), None: full}[reduction]
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    g = torch.randn_like(ref)
    out.backward(g)
    ref.backward(g)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(linear.weight.grad, ref_linear.weight.grad, rtol=1e-5, atol=1e-6)
    assert linear.weight.ds_grad_is_ready is True   # ready again after the last tile


def test_sequence_tiled_compute_with_a_loss_per_tile():
    x = torch.randn(1, 8, 4, requires_grad=True)
    out = tiled.sequence_tiled_compute(lambda x: x.pow(2).sum(), 8, 4, {"x": x}, {}, "x",
                                       output_unshard_dimension=0, output_reduction="sum")
    torch.testing.assert_close(out, x.detach().pow(2).sum())
    out.backward()
    assert torch.equal(x.grad, 2 * x.detach())


@pytest.mark.parametrize("call,match", [
    (lambda x: tiled.TiledMLP.apply(_mlp_fn, 1.0, x, 0, []), "shards=0 must be at least 1"),
    (lambda x: tiled.TiledMLP.apply(_mlp_fn, 1.0, x, 11, []),
     r"sequence \(10\) is shorter than shards=11"),
    (lambda x: tiled.TiledMLP.apply(_mlp_fn, 1.0, x, 2.0, []), "shards must be an int"),
    (lambda x: tiled.TiledMLP.apply(_mlp_fn, 1.0, x[0, 0], 1, []), "TiledMLP: x must be"),
    (lambda x: tiled.sequence_tiled_compute(_mlp_fn, 10, 20, {"x": x}, {}, "x"),
     r"sequence_tiled_compute: the sequence \(10\) is shorter than shards=20"),
    (lambda x: tiled.sequence_tiled_compute(_mlp_fn, 9, 2, {"x": x}, {}, "x"),
     r"kwargs_to_shard\['x'\] must be a tensor \[batch, seqlen=9"),
    (lambda x: tiled.sequence_tiled_compute(_mlp_fn, 10, 2, {"x": x}, {}, "y"),
     "grad_requiring_tensor_key='y' is not a key"),
    (lambda x: tiled.sequence_tiled_compute(_mlp_fn, 10, 2, {"x": x}, {}, "x",
                                            output_reduction="max"), "output_reduction='max'"),
    (lambda x: tiled.TiledFusedLogitsLoss.apply(_mlp_fn, 1.0, x, x[..., 0], None, 2, [], "avg"),
     "output_reduction='avg'"),
    (lambda x: tiled.TiledFusedLogitsLoss.apply(_mlp_fn, 1.0, x, x[:, :4], None, 2, [], "sum"),
     r"differ in \[batch, seq\]"),
    (lambda x: tiled.TiledFusedLogitsLoss.apply(_mlp_fn, 1.0, x, x, x, 2, [], "sum"),
     "mask must be"),
    (lambda x: tiled.TiledFusedLogitsLoss.apply(_mlp_fn, 1.0, x, x, None, 21, [], "sum"),
     r"sequence \(20\) is shorter than shards=21"),
])
def test_bad_inputs_raise_one_named_error(call, match):
    x = torch.randn(2, 10, 3, requires_grad=True)
    with pytest.raises(TilingError, match=match) as err:
        call(x)
    assert "\n" not in str(err.value)


def _deepspeed_importable() -> bool:
    probe = subprocess.run([sys.executable, "-c", f"import {DS_MODULE}"], capture_output=True,
                           env={**os.environ, "PYTHONPATH": REAL_DEEPSPEED}, timeout=120)
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_against_the_real_deepspeed(tmp_path, scale):
    """The same seeded model, tiled by DeepSpeed 0.19.8 (a separate process) and by
    zerotrain: the same loss and the same gradients, except the head's. The model divides
    the tiled loss by its token count and backward may scale it (as the engine's
    accumulation or fp16 scale does); DeepSpeed computes the head's gradient inside
    forward with an incoming gradient of 1, so its head gradient is ``count / scale`` times
    the untiled one (Note "backward recomputes each tile" in sequence/tiled.py); ours is
    the untiled model's."""
    if not _deepspeed_importable():
        pytest.skip(f"DeepSpeed not importable from {REAL_DEEPSPEED or 'this environment'} "
                    "(ZEROTRAIN_DEEPSPEED_PATH)")
    out = tmp_path / "ds.pt"
    script = Path(T.__file__)
    subprocess.run([sys.executable, str(script), DS_MODULE, str(out), "4", "3", str(scale)],
                   check=True, capture_output=True, timeout=300,
                   env={**os.environ, "PYTHONPATH": f"{REAL_DEEPSPEED}:{script.parent}"})
    theirs = torch.load(out)
    ours, plain = T.gradients(4, 3, scale=scale), T.gradients(1, 1, scale=scale)
    assert torch.equal(theirs["loss"], ours["loss"])
    _close(plain, ours, 1e-6)
    rest = [n for n in ours if n != "lm_head.weight"]
    _close({n: theirs[n] for n in rest}, {n: ours[n] for n in rest}, 1e-6)
    count = (T.batch(0, 0)[1] != -100).sum().item()
    torch.testing.assert_close(theirs["lm_head.weight"] * scale / count, ours["lm_head.weight"],
                               rtol=1e-5, atol=1e-7)


def test_cross_entropy_sum_tiles_and_masks():
    """A masked loss in "sum" tiles, divided by the count outside, as DeepSpeed advises."""
    torch.manual_seed(1)
    head = torch.nn.Linear(6, 11, bias=False)
    x = torch.randn(2, 7, 6, requires_grad=True)
    y = torch.randint(0, 11, (2, 7))
    mask = torch.rand(2, 7) > 0.3

    def fn(self, x, y, mask):
        losses = F.cross_entropy(self(x), y, reduction="none")
        return (losses * mask).sum()

    loss = tiled.TiledFusedLogitsLoss.apply(fn, head, x, y, mask, 3, [head.weight], "sum")
    loss = loss / mask.sum()
    ref_head = torch.nn.Linear(6, 11, bias=False)
    ref_head.load_state_dict(head.state_dict())
    ref_x = x.detach().clone().requires_grad_()
    ref = (F.cross_entropy(ref_head(ref_x).view(-1, 11), y.view(-1), reduction="none")
           * mask.view(-1)).sum() / mask.sum()
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(head.weight.grad, ref_head.weight.grad, rtol=1e-5, atol=1e-7)
