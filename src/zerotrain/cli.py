"""The ``zerotrain`` command.

    zerotrain estimate --params 7B --gpus 8 [--gpu-memory 80GB]   memory per GPU at each stage
    zerotrain estimate --model config.json --micro-batch B --seq-len S --gpus 8 --fit 80GB
                                                                  the traced peak of a step; the
                                                                  fastest configuration that fits
    zerotrain demo [--stage 3] [--nproc 2]                        train a small GPT on CPUs
    zerotrain launch [torchrun options] script.py [args]          torchrun, under our name
    zerotrain launch --as-deepspeed [torchrun options] script.py   ... an unmodified DeepSpeed
                                                                  script (`deepspeed` imports
                                                                  resolve to zerotrain)
    zerotrain consolidate CHECKPOINT_DIR OUTPUT_DIR [--tag T]      sharded checkpoint -> files
    zerotrain install-deepspeed-alias [--target DIR]              a `deepspeed` distribution
                                                                  that is zerotrain, for
                                                                  `accelerate launch`
    zerotrain uninstall-deepspeed-alias [--target DIR]            removes it

``launch`` hands everything to torchrun (``torch.distributed.run``), multi-node rendezvous
included (``launch.py``); zerotrain has no launcher of its own. This module, ``launch.py``
and ``demo/`` are the only places that print.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from .cli_estimate import add_estimate, run_estimate
from .launch import launch

_PASSTHROUGH = ("launch", "consolidate")  # their arguments go untouched to another parser


def _add_demo(sub: argparse._SubParsersAction) -> None:
    from .demo import add_arguments

    p = sub.add_parser("demo", help="train a small byte-level GPT with ZeRO on CPU processes",
                       description="Trains a byte-level GPT on the Python standard library's "
                       "source, on --nproc CPU processes launched by torchrun's machinery, "
                       "and reports losses, a sample, memory per rank and a loss curve.")
    add_arguments(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerotrain", description=__doc__.split("\n\n")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_estimate(sub)
    _add_demo(sub)
    sub.add_parser("launch", add_help=False,
                   help="run a training script under torchrun (all torchrun options, plus "
                   "--auto-resume DIR to continue from DIR's latest checkpoint after a restart, "
                   "and --as-deepspeed to run an unmodified DeepSpeed script)")
    sub.add_parser("consolidate", add_help=False,
                   help="turn a sharded checkpoint into safetensors files: "
                   "CHECKPOINT_DIR OUTPUT_DIR [--tag T] [--max-shard-size 5GB]")
    for name, what in (("install-deepspeed-alias", "write a `deepspeed` distribution that "
                        "is zerotrain into site-packages (for `accelerate launch "
                        "--use_deepspeed`); refused where DeepSpeed is installed"),
                       ("uninstall-deepspeed-alias", "remove what install-deepspeed-alias "
                        "wrote")):
        p = sub.add_parser(name, help=what, description=what)
        p.add_argument("--target", metavar="DIR", default=None,
                       help="the site-packages folder (default: this interpreter's)")
    return parser


def _deepspeed_alias(args: argparse.Namespace) -> int:
    from .deepspeed_alias import AliasError, install, uninstall

    try:
        if args.command == "install-deepspeed-alias":
            print(f"installed the deepspeed alias: {install(args.target)} (remove it with "
                  "`zerotrain uninstall-deepspeed-alias`)")
        else:
            removed = uninstall(args.target)
            print(f"removed {len(removed)} file(s) of the deepspeed alias" if removed else
                  "the deepspeed alias is not installed there")
    except AliasError as exc:
        print(f"zerotrain {args.command}: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _consolidate(argv: list[str]) -> int:
    """Hand ``argv`` to ``zerotrain.checkpoint.full_weights.consolidate_main``, imported only when asked for."""
    try:
        from .checkpoint.full_weights import consolidate_main
    except ImportError as exc:
        print(f"zerotrain consolidate: not available in this installation ({exc}); it needs "
              "zerotrain.checkpoint.full_weights, which comes with checkpoint support", file=sys.stderr)
        return 2
    return int(consolidate_main(argv) or 0)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one subcommand; returns the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:
        return launch(argv[1:])
    if argv[:1] == ["consolidate"]:
        return _consolidate(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "estimate":
        try:
            return run_estimate(args, args.subparser)
        except BrokenPipeError:  # `zerotrain estimate ... | head`: not an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
    if args.command == "demo":
        from .demo import run_demo
        return run_demo(args)
    if args.command in ("install-deepspeed-alias", "uninstall-deepspeed-alias"):
        return _deepspeed_alias(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
