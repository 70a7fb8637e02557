"""Per-rank memory follows the ZeRO table, measured by counting live tensor storages.

bf16 parameters with bf16 gradient accumulation, after backward (optimizer state exists
from the first step): stage 0 16Ψ, stage 1 4Ψ + 12Ψ/N, stage 2 2Ψ + 14Ψ/N, stage 3 16Ψ/N
bytes (persistence threshold 0: every parameter partitioned).
"""
import pytest
import torch

from memory_probe import held_tensors, measure_two_steps


WIDTH, DEPTH = 192, 4


def _model():
    torch.manual_seed(0)
    layers = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH + 1), torch.nn.GELU(),
                   torch.nn.Linear(WIDTH + 1, WIDTH)]
    return torch.nn.Sequential(*layers)


def _measure(rank, world, stages, optimizer="AdamW"):
    import zerotrain
    from zerotrain.core.memory import live_tensor_bytes
    out = {}
    for stage in stages:
        held = held_tensors()
        baseline = live_tensor_bytes()
        model = _model()
        psi = sum(p.numel() for p in model.parameters())
        config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True, "auto_cast": True},
                  "data_types": {"grad_accum_dtype": "bf16"},
                  "optimizer": {"type": optimizer, "params": {"lr": 1e-3}},
                  "zero_optimization": {"stage": stage, "reduce_bucket_size": 20_000,
                                        "allgather_bucket_size": 20_000,
                                        "stage3_param_persistence_threshold": 0,
                                        "stage3_max_reuse_distance": 0}}
        engine, *_ = zerotrain.initialize(model=model, config=config)
        measured, breakdown = measure_two_steps(engine, torch.randn(2, WIDTH), baseline)
        out[stage] = {"psi": psi, "measured": measured, "breakdown": breakdown}
        del engine, model, held
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_memory_per_rank_follows_zero_table(worlds, world):
    per_rank = worlds.run(world, _measure, [0, 1, 2, 3])
    for rank, results in enumerate(per_rank):
        for stage, res in results.items():
            psi, n = res["psi"], world
            expected = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n,
                        3: 16 * psi / n}[stage]
            assert abs(res["measured"] - expected) <= 0.10 * expected, (rank, stage, res)
            b = res["breakdown"]
            shard = psi / (1 if stage == 0 else n)
            assert abs(b["parameters"] - 2 * psi * (1 if stage < 3 else 1 / n)) <= 64 * n
            grad_expected = 2 * psi if stage < 2 else 2 * shard
            assert abs(b["gradients"] - grad_expected) <= 0.02 * grad_expected, (stage, b)
            assert abs(b["optimizer_state"] - 12 * shard) <= 0.02 * 12 * shard + 64, (stage, b)


def test_muon_memory_per_rank_keeps_momentum_only_for_matrices(worlds):
    """Muon (bf16 as above, N = 2): the weights keep one fp32 momentum (4 bytes) instead of
    Adam's two moments (8), the biases keep Adam's: stage 0 16Ψ - 4Ψm, stage 1
    4Ψ + (12Ψ - 4Ψm)/N, stage 2 2Ψ + (14Ψ - 4Ψm)/N, stage 3 (16Ψ - 4Ψm)/N bytes, Ψm the
    matrices' elements."""
    world = 2
    per_rank = worlds.run(world, _measure, [0, 1, 2, 3], "Muon")
    model = _model()
    psi_m = sum(p.numel() for p in model.parameters() if p.ndim >= 2)
    for rank, results in enumerate(per_rank):
        for stage, res in results.items():
            psi, n = res["psi"], world
            expected = {0: 16 * psi - 4 * psi_m, 1: 4 * psi + (12 * psi - 4 * psi_m) / n,
                        2: 2 * psi + (14 * psi - 4 * psi_m) / n,
                        3: (16 * psi - 4 * psi_m) / n}[stage]
            assert abs(res["measured"] - expected) <= 0.02 * expected, (rank, stage, res)
            shard = psi / (1 if stage == 0 else n)
            state = 12 * shard - 4 * psi_m / (1 if stage == 0 else n)
            b = res["breakdown"]
            assert abs(b["optimizer_state"] - state) <= 0.02 * state + 64, (stage, b)
            print(f"muon stage {stage}: {res['measured'] / psi:.2f} bytes per parameter")
