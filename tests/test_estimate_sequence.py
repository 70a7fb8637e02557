"""``zerotrain estimate`` with sequence parallelism (``--sp``) and tiling, and for
encoder-decoder models (T5, BART), which it once refused for want of a causal-LM or
masked-LM head."""
from __future__ import annotations

import json

import pytest

from zerotrain.cli import main
from zerotrain.estimate.models import activation_bytes, shape_from_hf_config

LLAMA = {"model_type": "llama", "vocab_size": 4096, "hidden_size": 64,
         "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 4, "max_position_embeddings": 65536}
T5 = {"model_type": "t5", "vocab_size": 320, "d_model": 32, "d_kv": 8, "d_ff": 64,
      "num_layers": 2, "num_decoder_layers": 2, "num_heads": 4}
BART = {"model_type": "bart", "vocab_size": 320, "d_model": 32, "encoder_layers": 2,
        "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
        "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "max_position_embeddings": 128}


def _write(tmp_path, name, cfg):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _acts(**kw):
    shape = shape_from_hf_config(LLAMA)
    return activation_bytes(shape, micro_batch=1, seq_len=8192, dtype="fp32",
                            checkpointing=False, fused_attention=True, **kw)


def test_activations_per_rank_shrink_by_the_sp_size_plus_the_all_to_all_buffers():
    one, two, four = _acts(), _acts(sp=2), _acts(sp=4)
    h, s = 64, 8192
    # the all-to-all's send and receive copies of q, k, v: 12 * s/S * h bytes (16-bit),
    # doubled in fp32, for one layer
    assert two == pytest.approx(one / 2 + 2 * 12 * s / 2 * h)
    assert four == pytest.approx(one / 4 + 2 * 12 * s / 4 * h)


def test_tiled_mlp_and_loss_drop_the_intermediates_and_the_logits():
    plain, mlp, loss = _acts(), _acts(tiled_mlp=True), _acts(loss_tiles=8)
    s, h, layers, vocab = 8192, 64, 2, 4096
    assert plain - mlp == pytest.approx(2 * (16 * s * h * layers - 16 * h * h))
    assert plain - loss == pytest.approx(4 * s * vocab * (1 - 1 / 8))
    # the order the bench measures (docs/sequence-parallel.md, "Memory"): the loss first
    assert _acts(tiled_mlp=True, loss_tiles=8) < loss < mlp < plain


def test_estimate_sp_option_prints_it_and_writes_it_into_the_config(tmp_path, capsys):
    model, out = _write(tmp_path, "llama", LLAMA), tmp_path / "ds.json"
    assert main(["estimate", "--model", model, "--micro-batch", "1", "--seq-len", "8192",
                 "--gpus", "4", "--sp", "4", "--gpu-memory", "1GB", "--write", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Sequence parallel S = 4" in text
    assert json.loads(out.read_text())["sequence_parallel_size"] == 4
    assert main(["estimate", "--model", model, "--micro-batch", "1", "--seq-len", "8192",
                 "--gpus", "4"]) == 0
    assert "Sequence parallel" not in capsys.readouterr().out


@pytest.mark.parametrize("argv, words", [
    (["--gpus", "4", "--sp", "3"], "3 does not divide the 4 GPUs"),
    (["--gpus", "8", "--sp", "8"], "8 does not divide the model's 4 attention heads"),
    (["--gpus", "2", "--sp", "2", "--seq-len", "8191"], "2 does not divide --seq-len 8191"),
    (["--gpus", "4", "--sp", "2", "--tp", "2"], "with --tp is not planned"),
    (["--gpus", "2", "--sp", "2", "--stage", "3"], "the traced step does not run"),
])
def test_sp_errors_are_one_line_naming_the_option(tmp_path, capsys, argv, words):
    model = _write(tmp_path, "llama", LLAMA)
    base = ["estimate", "--model", model, "--micro-batch", "1"]
    if "--seq-len" not in argv:
        base += ["--seq-len", "8192"]
    with pytest.raises(SystemExit):
        main(base + argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "argument --sp" in err and words in err, err


def test_sp_without_an_activation_estimate_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["estimate", "--params", "7B", "--gpus", "4", "--sp", "2"])
    assert "argument --sp/--tiled-mlp/--tiled-loss" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("name, cfg, head", [("t5", T5, "T5ForConditionalGeneration"),
                                             ("bart", BART, "BartForConditionalGeneration")])
def test_encoder_decoder_configs_are_counted_and_traced(tmp_path, capsys, name, cfg, head):
    model = _write(tmp_path, name, cfg)
    assert main(["estimate", "--model", model, "--micro-batch", "2", "--seq-len", "64",
                 "--gpus", "2"]) == 0
    text = capsys.readouterr().out
    assert head in text and "Activations per GPU" in text
    assert main(["estimate", "--model", model, "--micro-batch", "2", "--seq-len", "64",
                 "--gpus", "2", "--stage", "3", "--backend", "gloo", "--dtype", "fp32",
                 "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["breakdown"].get("activations", 0) > 0 and got["peak_bytes_per_rank"] > 0


def test_the_seq2seq_step_gets_decoder_inputs_shifted_right(tmp_path):
    import torch

    from zerotrain.planner.spec import StepSpec, build_model
    from zerotrain.planner.trace import step_inputs

    spec = StepSpec(_write(tmp_path, "t5", T5), micro_batch=2, seq_len=6, dtype="fp32")
    with torch.device("meta"):
        model = build_model(spec)
    inputs = step_inputs(spec, model)
    assert set(inputs) == {"input_ids", "labels", "decoder_input_ids"}
    assert torch.equal(inputs["decoder_input_ids"][:, 1:], inputs["labels"][:, :-1])
    assert (inputs["decoder_input_ids"][:, 0] == 0).all()
