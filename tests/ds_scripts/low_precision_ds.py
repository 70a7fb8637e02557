"""Trains tests/reference.py's model with DeepSpeed's bf16 masters (``bf16_master_weights_and_grads``
with ``bf16_optimizer_states``) and with ``torch_autocast`` at stages 1-3, on 2 gloo ranks, and
writes each run's losses and full weights as JSON. Run under torchrun with the real DeepSpeed
on the path; tests/dist/test_low_precision.py runs zerotrain on the same data and compares."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import low_precision_cases as C  # noqa: E402


def run(mode: str, stage: int) -> dict:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param
    config = C.config(mode, stage)
    config["optimizer"]["params"]["torch_adam"] = True
    for key in ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm"):
        config["zero_optimization"].pop(key)
    config["bf16"].pop("auto_cast", None)
    model = C.model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    rank = torch.distributed.get_rank()
    losses = []
    for step in range(C.STEPS):
        x, y = C.batch(mode, step, rank)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    weights = {n: safe_get_full_fp32_param(p).float().tolist()
               for n, p in model.named_parameters()}
    engine.destroy()
    return {"losses": losses, "weights": weights}


def main() -> None:
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    results = {f"{mode}/{stage}": run(mode, stage) for mode in C.MODES for stage in (1, 2, 3)}
    if torch.distributed.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
