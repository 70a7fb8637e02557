"""Full weights out of a training job.

* ``zerotrain consolidate``: a sharded checkpoint (zerotrain's or DeepSpeed's) to full fp32
  weights (Hugging Face layout); the work is done by :mod:`zerotrain.checkpoint.consolidate`, needs no process
  group and never loads the whole model at once.
* :func:`save_16bit_model`: the live model's weights in their training dtype, asked of the
  stage (:class:`FullWeights`) parameter by parameter while one safetensors file is streamed
  (``engine.save_16bit_model``).
"""
from __future__ import annotations

import argparse
import logging
import os
from typing import Optional, Protocol

import torch
from torch import nn

from . import (CheckpointError, convert_zero_checkpoint_to_fp32_state_dict,
                         get_fp32_state_dict_from_zero_checkpoint)
from .stfile import TensorSpec, write_file
from ..comm import Communicator

__all__ = ["FullWeights", "consolidate_main", "convert_zero_checkpoint_to_fp32_state_dict",
           "get_fp32_state_dict_from_zero_checkpoint", "save_16bit_model"]

logger = logging.getLogger(__name__)

TORCH_SUFFIXES = (".bin", ".pt", ".pth")   # file names that torch.load is expected to read


def build_parser(prog: str = "zerotrain consolidate") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Write a zerotrain or DeepSpeed ZeRO checkpoint's full fp32 "
        "weights as safetensors shards with a model.safetensors.index.json (Hugging Face "
        "layout), or as one file when OUTPUT ends in .safetensors.")
    parser.add_argument("checkpoint_dir", help="the save directory (with 'latest') or one "
                        "tag directory")
    parser.add_argument("output_dir", help="where to write the model-*.safetensors files "
                        "(a name ending in .safetensors: one file)")
    parser.add_argument("--tag", default=None, help="which tag (default: the one 'latest' "
                        "names)")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="largest output file, e.g. 5GB or 500MiB (default 5GB)")
    parser.add_argument("--to", choices=sorted(_FORMATS), default="hf",
                        help="output format: hf (fp32 safetensors, the default), dcp (torch "
                        "Distributed Checkpoint with optimizer state, for FSDP2/torchtitan), "
                        "deepspeed (a DeepSpeed ZeRO checkpoint; needs --stage and "
                        "--world-size)")
    parser.add_argument("--stage", type=int, default=None,
                        help="--to deepspeed: the ZeRO stage of the DeepSpeed job (1, 2 or 3)")
    parser.add_argument("--world-size", type=int, default=None,
                        help="--to deepspeed: the data-parallel world size of the DeepSpeed job")
    return parser


_FORMATS = {"hf", "dcp", "deepspeed"}


def consolidate_main(argv: Optional[list[str]] = None) -> int:
    """Run ``zerotrain consolidate CHECKPOINT_DIR OUTPUT_DIR [--tag T] [--max-shard-size S]``.

    Returns the process exit status: 0 on success, 1 when the checkpoint cannot be read or
    written (the reason is logged as an error). Bad arguments exit through argparse (2).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.to == "deepspeed") != (args.stage is not None and args.world_size is not None) \
            or (args.to != "deepspeed" and (args.stage is not None or args.world_size is not None)):
        parser.error("--stage and --world-size go together with --to deepspeed, and it needs both")
    try:
        if args.to == "deepspeed":
            from .deepspeed.write import export_deepspeed
            written = export_deepspeed(args.checkpoint_dir, args.output_dir, stage=args.stage,
                                       world_size=args.world_size, tag=args.tag)
        elif args.to == "dcp":
            from .dcp import export_dcp
            written = export_dcp(args.checkpoint_dir, args.output_dir, tag=args.tag)
        else:
            written = convert_zero_checkpoint_to_fp32_state_dict(
                args.checkpoint_dir, args.output_dir, tag=args.tag,
                max_shard_size=args.max_shard_size)
    except (CheckpointError, OSError) as exc:
        logger.error("zerotrain consolidate: %s", exc)
        return 1
    logger.info("wrote %d files to %s", len(written), args.output_dir)
    return 0


class FullWeights(Protocol):
    """What an export needs from a stage: the module's tensors whole, one at a time (every
    stage has these; stage 3 gathers each partitioned parameter for its copy)."""

    def full_shape(self, tensor: torch.Tensor) -> torch.Size:
        """The full shape of one of the module's parameters or buffers."""

    def full_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous host copy of it, full. Collective: every rank calls it for the same
        tensors in the same order."""


def save_16bit_model(module: nn.Module, weights: FullWeights, comm: Communicator,
                     save_dir: str, save_filename: str = "model.safetensors",
                     exclude_frozen_parameters: bool = False) -> str:
    """Write the module's full state dict, in its training dtype, to one safetensors file;
    a name ending in ``.bin``, ``.pt`` or ``.pth`` (DeepSpeed's default is
    ``pytorch_model.bin``) gets the format the name promises, a ``torch.save`` file of
    tensors only (``torch.load(weights_only=True)`` reads it), gathered on rank 0 first.

    Collective: every rank calls it; rank 0 writes. ``weights`` (the stage) hands over one
    full tensor at a time while the file is streamed, so no rank holds more than one full
    parameter beyond its shards. Returns the path written.
    """
    entries = [(name, p) for name, p in module.named_parameters()
               if p.requires_grad or not exclude_frozen_parameters]
    entries += [(name, b) for name, b in _persistent_buffers(module)]
    specs = [TensorSpec(name, t.dtype, tuple(weights.full_shape(t))) for name, t in entries]
    tensors = dict(entries)

    def produce(spec: TensorSpec) -> torch.Tensor:
        return weights.full_copy(tensors[spec.key])

    path = os.path.join(save_dir, save_filename)
    if comm.rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        if save_filename.endswith(TORCH_SUFFIXES):   # DeepSpeed's pytorch_model.bin
            torch.save(_with_tied_names(module, {spec.key: produce(spec) for spec in specs}),
                       path + ".tmp")
        else:
            write_file(path + ".tmp", specs, produce, metadata={"format": "pt"})
        os.replace(path + ".tmp", path)
    else:
        for spec in specs:  # take part in the same gathers, in the same order
            produce(spec)
    comm.barrier(label="save_16bit_model: written")
    return path


def consolidated_state_dict(module: nn.Module, weights: FullWeights, rank: int,
                            exclude_frozen_parameters: bool = False
                            ) -> Optional[dict[str, torch.Tensor]]:
    """The module's full state dict in its training dtype on rank 0 (host tensors, tied names
    included), None on the others: DeepSpeed's ``_zero3_consolidated_16bit_state_dict``,
    which Accelerate and the Trainer call to save. Collective: every rank calls it."""
    entries = [(name, p) for name, p in module.named_parameters()
               if p.requires_grad or not exclude_frozen_parameters]
    entries += list(_persistent_buffers(module))
    state = {name: weights.full_copy(t) for name, t in entries}   # every rank gathers
    return _with_tied_names(module, state) if rank == 0 else None


def _with_tied_names(module: nn.Module, state: dict[str, torch.Tensor]
                     ) -> dict[str, torch.Tensor]:
    """Add each tied parameter's other names (``lm_head.weight`` beside
    ``transformer.wte.weight``), sharing one tensor, so ``load_state_dict`` finds every key
    of the plain module's ``state_dict()``, as in DeepSpeed's file."""
    first: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
        if name not in state and first[id(p)] in state:
            state[name] = state[first[id(p)]]
    return state


def _persistent_buffers(module: nn.Module):
    for prefix, sub in module.named_modules():
        for name, buf in sub.named_buffers(recurse=False):
            if buf is not None and name not in sub._non_persistent_buffers_set:
                yield (f"{prefix}.{name}" if prefix else name), buf
