"""ZeRO stage 3 under tensor parallelism: what the wrapper promises and what it refuses.

Note: tensor parallelism then stage 3
    The order is the one torchtitan uses for TP then FSDP. ``initialize`` first cuts the
    model over the tensor-parallel group (``apply.py``): each split layer holds its slice
    as an ordinary parameter. Only then does stage 3 (``stages/zero3/``, unchanged) take
    the model, over the data-parallel group ``mesh.dp`` alone. It therefore partitions the
    slices (and the replicated parameters) over the N/T data-parallel ranks, gathers each
    unit within that group before use, and reduce-scatters the gradients over it. The T
    ranks of a tensor-parallel group hold different slices, so they never exchange
    parameter shards: nothing of stage 3 crosses the world. The activation all-reduces of
    the split layers (``layers.py``) run inside the forward and backward of a unit that
    stage 3 has gathered, on the other group. Each group's collectives keep one order on
    all of its ranks, because every rank of a group runs the same model on the same
    schedule.

    The contract the stage sees is the same as at stages 0-2: parameters that are just
    smaller, and names that do not change. The wrapper (``stage.py``) adds what spans both
    dimensions: the norm over the world with replicated parameters counted once, and the
    gathered view for checkpoints. Stage 3 holds its records in the shapes of the slices
    (``ds_shape``), so the readers' "slice or whole" view needs no change.

    A model built under ``zero.Init`` is partitioned over the world, and the cut needs
    whole weights: ``initialize`` gathers it first, as stages 0-2 do.

    What this module refuses is untested with tensor parallelism, and each is named:
    frozen parameters (stage 3 partitions them outside the records the wrapper
    gathers for checkpoints), and the hierarchical layouts of ZeRO++ and MiCS (they build
    their groups from the node topology of the world, not of the data-parallel group).
    ``offload_optimizer`` and ``offload_param`` keep stage 3's masters and shards on the
    host, which changes nothing the wrapper sees: they train like one process.
"""
from __future__ import annotations

from torch import nn

from ..errors import ConfigError

_KEY = "tensor_parallel.autotp_size"


def check_stage3(zero_config, model: nn.Module, size: int) -> None:
    """Refuse, by name, what stage 3 with tensor parallelism T = ``size`` does not do
    (Note "tensor parallelism then stage 3"). Local; every rank sees the same model and
    config, so every rank refuses alike."""
    refused = [(key, what) for key, what in (
        ("zero_optimization.zero_hpz_partition_size",
         int(zero_config.zero_hpz_partition_size) > 1),
        ("zero_optimization.mics_shard_size", int(zero_config.mics_shard_size) > 0),
        ("zero_optimization.zero_quantized_weights", bool(zero_config.zero_quantized_weights)),
        ("zero_optimization.zero_quantized_gradients",
         bool(zero_config.zero_quantized_gradients)),
        ("zero_optimization.zero_quantized_nontrainable_weights",
         bool(zero_config.zero_quantized_nontrainable_weights))) if what]
    if refused:
        key = refused[0][0]
        raise ConfigError(key, f"with {_KEY} {size} at zero_optimization.stage 3 is not "
                          "supported (docs/tensor-parallel.md, \"What composes\")")
    for name, param in model.named_parameters():
        if not param.requires_grad:
            raise ConfigError(_KEY, f"{size} at zero_optimization.stage 3 trains models "
                              f"whose parameters all train: {name!r} is frozen "
                              "(requires_grad=False); use stage 1 or 2 with tensor "
                              "parallelism for a partly frozen model", value=size)
