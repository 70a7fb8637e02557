"""The first forward checks that the ranks of each tensor-parallel group were given the
same inputs, as DeepSpeed's AutoTP training does (``check_dataloader_inputs_same_across_ranks``,
a forward pre-hook on the model that removes itself after one call).

Note: one batch per group
    The split layers of a group sum partial results that each rank computed on its own
    inputs. Different inputs on two ranks of a group give a sum of unrelated halves, and
    training goes on with no error on what is noise (docs/tensor-parallel.md, "The
    batch"). DeepSpeed broadcasts the first forward's arguments from the group's first
    rank, compares them on every other rank (tensors with ``torch.equal``, other values
    with ``!=``, Hugging Face caches by type only) and fails the group with an assertion.
    Here each rank sends a digest of the same top-level values instead of the tensors
    themselves: a SHA-256 of each tensor's bytes with its dtype and shape, the value of a
    number, string or None, the type of anything else. One ``all_gather_object`` over the
    group gives every rank every digest, so all ranks of a group raise together, and the
    error names the ranks whose inputs differ from the first rank's, and which argument.
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

from ..comm.communicator import Communicator
from ..errors import ZeroTrainError

_PLAIN = (bool, int, float, str, type(None))


class TensorParallelInputError(ZeroTrainError, ValueError):
    """The ranks of one tensor-parallel group were given different inputs."""


def _digest(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        data = value.detach().reshape(-1).contiguous().cpu().view(torch.uint8)
        return (f"tensor {str(value.dtype).replace('torch.', '')} {tuple(value.shape)} "
                f"sha256 {hashlib.sha256(data.numpy().tobytes()).hexdigest()[:16]}")
    if isinstance(value, _PLAIN):
        return repr(value)
    return f"a {type(value).__name__}"


def input_digests(args: tuple, kwargs: dict) -> dict[str, str]:
    """``{"args[i]" | "name": digest}`` of the top-level arguments of one call."""
    out = {f"args[{i}]": _digest(value) for i, value in enumerate(args)}
    out.update((name, _digest(kwargs[name])) for name in sorted(kwargs))
    return out


def check_same_inputs(tp: Communicator, args: tuple, kwargs: dict) -> None:
    """Raise TensorParallelInputError on every rank of ``tp`` when its ranks' ``args`` and
    ``kwargs`` differ (Note "one batch per group"). Collective over ``tp``."""
    everyone = tp.all_gather_object(input_digests(args, kwargs),
                                    label="tensor-parallel input check")
    first = everyone[0]
    differ = {}
    for tp_rank, digests in enumerate(everyone[1:], start=1):
        names = sorted(set(first) | set(digests))
        wrong = [n for n in names if first.get(n) != digests.get(n)]
        if wrong:
            differ[tp.ranks[tp_rank]] = wrong[0]
    if differ:
        ranks = ", ".join(f"rank {r} ({name})" for r, name in sorted(differ.items()))
        raise TensorParallelInputError(
            f"the tensor-parallel group of ranks {list(tp.ranks)} was given different "
            f"inputs on its first forward: {ranks} differ from rank {tp.ranks[0]}. The ranks of a group must see the same "
            "batch; shard the data by engine.get_data_parallel_rank() and "
            "engine.dp_world_size (docs/tensor-parallel.md, \"The batch\")")


def check_first_inputs(model: nn.Module, tp: Communicator) -> None:
    """Register the one-call check on ``model``'s forward (prepended, so it sees the
    caller's arguments); it removes itself after the first forward."""
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        handle.remove()
        check_same_inputs(tp, args, kwargs)

    handle = model.register_forward_pre_hook(hook, prepend=True, with_kwargs=True)
