"""Tiling lowers the activation peak where it should, measured by the live-storage peak
(``zerotrain.estimate.peak.PeakTracker``) of one forward and backward, as
bench/sequence_memory.py measures it (no timing).

* a Llama-shaped MLP (gate, up, down) at 4096 tokens: the tiled MLP's peak is a fraction of the plain MLP's (the
  plain one keeps three ``seq x intermediate`` tensors for backward and makes more in it;
  the tiled one only ``seq / shards`` rows of them at a time);
* the whole tiny Llama: tiled MLP and tiled loss each lower the step's peak, in the order
  the bench reports (the logits dominate at this vocabulary);
* Ulysses sequence parallelism: the per-rank peak at SP=2 is half SP=1's (the bench itself,
  through the switch).
"""
import pytest
import torch

SEQ = 1024       # the Llama step
MLP_SEQ = 4096   # the MLP alone


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=2048, hidden_size=64, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=SEQ, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def _mlp_fn(self, x):
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class _MLP(torch.nn.Module):
    """LlamaMLP's layout without importing transformers."""

    def __init__(self, hidden: int = 64, inter: int = 256) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.up_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.down_proj = torch.nn.Linear(inter, hidden, bias=False)
        self.act_fn = torch.nn.SiLU()


def _peak(run) -> int:
    from zerotrain.estimate.peak import PeakTracker
    tracker = PeakTracker()
    with tracker:
        run()
    return tracker.peak


@pytest.mark.slow
def test_tiled_mlp_lowers_the_mlp_activation_peak_by_a_measured_factor():
    from zerotrain.sequence.tiled import TiledMLP
    torch.manual_seed(0)
    mlp = _MLP()
    x = torch.randn(1, MLP_SEQ, 64, requires_grad=True)
    params = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]

    def plain():
        _mlp_fn(mlp, x).sum().backward()

    def tiled():
        TiledMLP.apply(_mlp_fn, mlp, x, 16, params).sum().backward()

    plain_peak, tiled_peak = _peak(plain), _peak(tiled)
    intermediate = MLP_SEQ * 256 * 4   # one seq x intermediate fp32 tensor
    assert plain_peak >= 3 * intermediate, plain_peak
    # tiled: x's gradient, the output and its gradient (seq x hidden each) plus one tile
    assert tiled_peak * 4 <= plain_peak, (plain_peak, tiled_peak)


@pytest.mark.slow
def test_tiled_mlp_and_tiled_loss_lower_a_llama_step_peak():
    from transformers.models.llama import modeling_llama

    from zerotrain.sequence.tiled import TiledFusedLogitsLoss, TiledMLP
    model = _llama()
    ids = torch.randint(0, 2048, (1, SEQ), generator=torch.Generator().manual_seed(1))
    labels = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:]

    def loss_fn(self, x, y):
        logits = self.lm_head(x).float()
        return torch.nn.functional.cross_entropy(logits.view(-1, 2048), y.view(-1),
                                                 reduction="sum", ignore_index=-100)

    def step(mlp_tiles, loss_tiles):
        original = modeling_llama.LlamaMLP.forward
        if mlp_tiles > 1:
            modeling_llama.LlamaMLP.forward = lambda self, x: TiledMLP.apply(
                _mlp_fn, self, x, mlp_tiles, list(self.parameters()))
        try:
            def run():
                hidden = model.model(input_ids=ids).last_hidden_state
                if loss_tiles > 1:
                    loss = TiledFusedLogitsLoss.apply(loss_fn, model, hidden, labels, None,
                                                      loss_tiles, [model.lm_head.weight], "sum")
                else:
                    loss = loss_fn(model, hidden, labels)
                loss.backward()
            model.zero_grad(set_to_none=True)
            return _peak(run)
        finally:
            modeling_llama.LlamaMLP.forward = original

    off, mlp, loss, both = step(1, 1), step(64, 1), step(1, 8), step(64, 8)
    assert both < loss < mlp < off, (off, mlp, loss, both)
    assert off - mlp >= 2 * SEQ * 256 * 4, (off, mlp)    # at least two intermediates less
    assert loss * 2 <= off, (off, loss)                  # the logits were most of it


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_sequence_parallel_halves_the_per_rank_activation_peak(tmp_path):
    """bench/sequence_memory.py through the switch at SP 1 and 2 (untiled, 2048 tokens): the
    per-rank peak at SP=2 is about half SP=1's, and the summed loss is the same."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "rows.json"
    env = dict(os.environ, PYTHONPATH=os.path.join(root, "src") + os.pathsep
               + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, os.path.join(root, "bench", "sequence_memory.py"), "--backend",
         "zerotrain", "--seq", "2048", "--sp", "1,2", "--tiled", "off", "--port",
         str(_free_port()), "--json", str(out)], env=env, capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = json.loads(out.read_text())
    assert (one["sp"], two["sp"]) == (1, 2)
    assert 0.4 * one["peak_mib"] <= two["peak_mib"] <= 0.6 * one["peak_mib"], (one, two)
    assert abs(one["loss"] - two["loss"]) <= 1e-4 * abs(one["loss"]), (one, two)
