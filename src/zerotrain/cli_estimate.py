"""``zerotrain estimate``: its arguments (bounded, named when refused) and its two forms,
the formula estimate (``estimate/``) and the traced peak of one step (``planner/``), with
``--fit`` and ``--write``. ``cli.py`` dispatches here."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from typing import Callable, Optional

from .estimate import (DTYPES, OPTIMIZERS, EstimateRequest, ModelShape, estimate, parse_bytes,
                       parse_count, shape_from_hf_config, shape_from_module_spec)
from .estimate.models import SequenceLengthError, check_positions


def _typed(parse: Callable[[str], int]) -> Callable[[str], int]:
    """An argparse ``type`` whose ValueError becomes "argument --flag: <why>"."""
    def convert(text: str) -> int:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = parse.__name__
    return convert


# Sane bounds, checked before any work: far above any machine or batch there is, and low
# enough that the traced world (a structure per rank) and the step's shapes stay small.
MAX_GPUS_PER_NODE = 1024
MAX_WORLD = 2**17           # GPUs in all (--gpus x --nodes): 131072
MAX_MICRO_BATCH = 2**16
MAX_SEQ_LEN = 2**24


def _whole(maximum: int) -> Callable[[str], int]:
    """A parser of whole numbers in 1..``maximum`` (ValueError naming the bound)."""
    def positive_int(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a whole number") from None
        if value < 1:
            raise ValueError(f"{text!r} must be at least 1")
        if value > maximum:
            raise ValueError(f"{text!r} is more than {maximum}")
        return value
    return positive_int




def add_estimate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("estimate", help="memory per GPU for each ZeRO stage, and a config",
                       description="Per-GPU memory of parameters, gradients and optimizer "
                       "state for plain data parallelism and ZeRO-1/2/3, with and without "
                       "offload; with --gpu-memory, the stage to use and its ds_config.json.")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=_typed(parse_count), metavar="N",
                      help="parameter count: 7B, 1.3B, 350M")
    what.add_argument("--model", metavar="CONFIG",
                      help="a Hugging Face config.json (GPT-2 and Llama-style layouts are "
                      "counted; any other, e.g. T5 or BART, is built on the meta device with "
                      "its causal-LM, masked-LM or seq2seq head) or module:callable returning "
                      "an nn.Module (built on the meta device). A traced step calls the model "
                      "as model(input_ids=ids, labels=ids), ids [micro-batch, seq-len] token "
                      "ids below config.vocab_size (256 without one), plus decoder_input_ids "
                      "for an encoder-decoder; the output's .loss (or the output) is the loss")
    p.add_argument("--gpus", type=_typed(_whole(MAX_GPUS_PER_NODE)), default=1, metavar="G",
                   help="GPUs per node (default 1)")
    p.add_argument("--nodes", type=_typed(_whole(MAX_WORLD)), default=1,
                   help="nodes (default 1)")
    p.add_argument("--dtype", choices=DTYPES, default="bf16",
                   help="training precision; bf16/fp16 mean mixed precision (default bf16)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adam",
                   help="default adam; adam-bf16: bf16 masters, gradients and moments "
                        "(bf16.bf16_master_weights_and_grads, bf16_optimizer_states)")
    p.add_argument("--tp", type=_typed(_whole(MAX_WORLD)), default=1, metavar="T",
                   help="tensor_parallel.autotp_size: AutoTP over groups of T GPUs (must "
                   "divide the GPUs and the model's heads; default 1)")
    p.add_argument("--sp", type=_typed(_whole(MAX_WORLD)), default=1, metavar="S",
                   help="sequence_parallel_size: Ulysses sequence parallelism over groups of "
                   "S GPUs (must divide the GPUs, the model's heads and --seq-len; "
                   "activations per GPU shrink by S; default 1)")
    p.add_argument("--tiled-mlp", action="store_true",
                   help="activations with DeepSpeed's TiledMLP in every layer")
    p.add_argument("--tiled-loss", type=_typed(_whole(MAX_SEQ_LEN)), default=1, metavar="N",
                   help="activations with TiledFusedLogitsLoss over N tiles (default 1: off)")
    p.add_argument("--gpu-memory", type=_typed(parse_bytes), metavar="SIZE",
                   help="memory per GPU (80GB, 24GiB): recommend a stage and print its config")
    p.add_argument("--cpu-memory", type=_typed(parse_bytes), metavar="SIZE",
                   help="host memory per node, checked for the offload recommendations")
    p.add_argument("--micro-batch", type=_typed(_whole(MAX_MICRO_BATCH)), metavar="B",
                   help="sequences per GPU per micro-step (activation estimate, with --model)")
    p.add_argument("--seq-len", type=_typed(_whole(MAX_SEQ_LEN)), metavar="S",
                   help="tokens per sequence (activation estimate, with --model)")
    p.add_argument("--write", metavar="PATH", help="write the recommended ds_config.json here")
    trace = p.add_argument_group(
        "the peak of one real step (with --model, --micro-batch and --seq-len)",
        "Any of these options traces one training step of the engine on fake tensors as "
        "rank 0 of the world (nothing is allocated) and prints the predicted peak per rank, "
        "where it happens and what is alive then.")
    trace.add_argument("--stage", type=int, choices=(0, 1, 2, 3), help="ZeRO stage (default 3)")
    trace.add_argument("--offload", choices=("none", "cpu", "nvme"),
                       help="where the optimizer state lives (default none)")
    trace.add_argument("--activation-checkpointing", action="store_true",
                       help="recompute activations in backward (transformers models)")
    trace.add_argument("--backend", choices=("nccl", "gloo"), default="nccl",
                       help="the collectives' backend: nccl (GPUs, default) or gloo (a CPU "
                       "run: its reduce-scatters hold a copy of their input)")
    trace.add_argument("--json", action="store_true",
                       help="print one JSON object (peak_bytes_per_rank, "
                       "peak_host_bytes_per_node, breakdown)")
    trace.add_argument("--fit", type=_typed(parse_bytes), metavar="SIZE",
                       help="memory per GPU (80GB): the fastest configuration whose traced "
                       "peak fits, keeping micro-batch x accumulation; --write saves it")
    trace.add_argument("--host-memory", type=_typed(parse_bytes), metavar="SIZE",
                       help="host memory per node, for --fit")
    p.set_defaults(subparser=p)  # its errors then read "zerotrain estimate: error: ..."


def _model_shape(parser: argparse.ArgumentParser, spec: str) -> ModelShape:
    """``--model`` as a config.json or module:callable; an argparse error otherwise."""
    if os.path.isdir(spec) and os.path.isfile(os.path.join(spec, "config.json")):
        spec = os.path.join(spec, "config.json")  # a downloaded model's folder
    is_file = spec.endswith(".json") or (os.path.isfile(spec) and not spec.endswith(".py"))
    try:
        if is_file:
            try:
                return shape_from_hf_config(spec)
            except ValueError as exc:
                if "cannot count model_type" not in str(exc):
                    raise
            from .planner.spec import shape_of_config   # a layout the arithmetic does not count
            try:
                return shape_of_config(spec)
            except ValueError:
                raise
            except Exception as built:   # noqa: BLE001 - transformers' own refusal
                raise ValueError(f"{spec}: transformers could not build it on the meta device "
                                 f"({type(built).__name__}: {str(built).splitlines()[0]})"
                                 ) from None
        if ":" in spec:
            return shape_from_module_spec(spec)
    except ValueError as exc:
        parser.error(f"argument --model: {exc}")
    parser.error(f"argument --model: {spec!r} is neither a config.json file nor "
                 "module:callable")


def _is_config_file(spec: str) -> bool:
    if os.path.isdir(spec):
        return os.path.isfile(os.path.join(spec, "config.json"))
    return spec.endswith(".json") or (os.path.isfile(spec) and not spec.endswith(".py"))


def _check_common(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """What every estimate checks before any work: the world's size and the folder
    ``--write`` writes into (a missing folder found after a long trace loses it)."""
    if args.gpus * args.nodes > MAX_WORLD:
        parser.error(f"argument --gpus/--nodes: {args.gpus} x {args.nodes} GPUs is more than "
                     f"{MAX_WORLD}")
    if (args.gpus * args.nodes) % args.tp:
        parser.error(f"argument --tp: {args.tp} does not divide the {args.gpus * args.nodes} "
                     f"GPUs ({args.gpus} x {args.nodes}); the ranks form a {args.tp} x "
                     f"(GPUs / {args.tp}) mesh")
    if args.write:
        target = os.path.abspath(args.write)
        folder = os.path.dirname(target)
        if os.path.isdir(target):
            parser.error(f"argument --write: {args.write} is a folder; name the file to write")
        if not os.path.isdir(folder):
            parser.error(f"argument --write: the folder {folder} does not exist")
        if not os.access(folder, os.W_OK | os.X_OK):
            parser.error(f"argument --write: the folder {folder} is not writable")


def _write_json(path: str, data: dict) -> None:
    """``data`` as JSON at ``path``, whole or not at all (a temporary file renamed)."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".zerotrain-", suffix=".json", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2)
            handle.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _traces(args: argparse.Namespace) -> bool:
    return bool(args.stage is not None or args.offload or args.activation_checkpointing
                or args.json or args.fit or args.host_memory)


def _check_bf16_states(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--optimizer adam-bf16`` (bf16 masters and moments) needs bf16 parameters and, traced,
    a ZeRO stage 1-3, as ``initialize`` does."""
    if args.optimizer != "adam-bf16":
        return
    if args.dtype != "bf16":
        parser.error(f"argument --optimizer: adam-bf16 keeps bf16 master weights beside bf16 "
                     f"parameters; it needs --dtype bf16, not {args.dtype}")
    if getattr(args, "stage", None) == 0:
        parser.error("argument --optimizer: adam-bf16 (bf16.bf16_master_weights_and_grads) "
                     "needs ZeRO stage 1, 2 or 3, not --stage 0")


def run_trace(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The traced peak of one step (``zerotrain.planner``), or with ``--fit`` the fastest
    configuration that fits; the exit status."""
    if not args.model:
        parser.error("argument --stage/--offload/--activation-checkpointing/--json/--fit: "
                     "tracing a step needs --model (a config.json or module:callable)")
    if args.sp > 1 or args.tiled_mlp or args.tiled_loss > 1:
        parser.error("argument --sp/--tiled-mlp/--tiled-loss: the traced step does not run "
                     "sequence parallelism or tiling; drop --stage/--offload/"
                     "--activation-checkpointing/--json/--fit for the arithmetic estimate")
    if not (args.micro_batch and args.seq_len):
        parser.error("argument --micro-batch/--seq-len: tracing a step needs both")
    if args.write and not args.fit:
        parser.error("argument --write: with a traced step it needs --fit")
    _check_bf16_states(parser, args)
    if _is_config_file(args.model):   # its dimensions and positions, before the trace
        shape = _model_shape(parser, args.model)
        _check_seq_len(parser, args.seq_len, shape)
    if args.tp > 1:
        _tp_split(parser, args)
    from .planner import PlanError, StepSpec, ds_config_for, fit, plan_peak

    spec = StepSpec(args.model, micro_batch=args.micro_batch, seq_len=args.seq_len,
                    gpus=args.gpus, nodes=args.nodes, stage=3 if args.stage is None else
                    args.stage, offload=args.offload or "none", dtype=args.dtype,
                    activation_checkpointing=args.activation_checkpointing,
                    backend=args.backend, tp=args.tp,
                    optimizer="muon" if args.optimizer == "muon" else "adam",
                    bf16_states=args.optimizer == "adam-bf16")
    try:
        if not args.fit:
            result = plan_peak(spec)
        else:
            result = fit(spec, args.fit, args.host_memory)
    except SequenceLengthError as exc:
        parser.error(f"argument --seq-len: {exc}")
    except (ValueError, OSError) as exc:
        parser.error(f"argument --model: {exc}")
    except PlanError as exc:
        print(f"zerotrain estimate: {exc}", file=sys.stderr)
        return 1
    if args.fit and result is None:
        print(f"no configuration of {args.model} fits {_size(args.fit)} per GPU"
              + (f" and {_size(args.host_memory)} per node" if args.host_memory else "")
              + " (tried stages 0-3, activation checkpointing, smaller micro-batches with "
              "gradient accumulation, optimizer offload)", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(_render_peak(result, args.fit))
    if args.write:
        _write_json(args.write, ds_config_for(result.spec))
        if not args.json:
            print(f"\nwrote {args.write}")
    return 0


def _tp_split(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Optional[int]:
    """Ψ_s of ``--model`` by the AutoTP rules (built on the meta device), after checking
    that ``--tp`` divides its head counts; None without a model (all of Ψ counted split)."""
    if not args.model:
        return None
    from .estimate.tensor_parallel import check_tp_size
    from .planner.tp_split import split_of_model_spec

    try:
        _, split, heads = split_of_model_spec(args.model)
    except Exception as exc:   # noqa: BLE001 - transformers' or the user's own refusal
        parser.error(f"argument --model: {args.model} could not be built on the meta device "
                     f"to find its split layers ({type(exc).__name__}: "
                     f"{str(exc).splitlines()[0] if str(exc) else ''})")
    try:
        check_tp_size(args.tp, args.gpus * args.nodes, heads)
    except ValueError as exc:
        parser.error(f"argument --tp: {exc}")
    if not split:
        parser.error(f"argument --tp: {args.tp}, but no layer of {args.model} matches the "
                     "AutoTP rules (q/k/v/o, up/gate/down, c_attn/c_fc/c_proj), as "
                     "initialize would refuse")
    return split


def _check_sp(parser: argparse.ArgumentParser, args: argparse.Namespace,
              shape: Optional[ModelShape]) -> None:
    """``--sp`` against the world, the model's heads and the sequence; with ``--tp`` it is
    refused (the two are not planned together)."""
    from .estimate.models import check_sequence_parallel

    if args.tp > 1:
        parser.error("argument --sp: sequence parallelism with --tp is not planned; "
                     "use one of them")
    try:
        check_sequence_parallel(args.sp, args.gpus * args.nodes,
                                shape.num_heads if shape else None, args.seq_len)
    except ValueError as exc:
        parser.error(f"argument --sp: {exc}")


def _check_seq_len(parser: argparse.ArgumentParser, seq_len: int, shape: ModelShape) -> None:
    try:
        check_positions(seq_len, shape.max_positions, shape.positions_from)
    except SequenceLengthError as exc:
        parser.error(f"argument --seq-len: {exc}")


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"


def _render_peak(result, budget) -> str:
    s = result.spec
    lines = []
    if budget:
        why = [f"stage {s.stage}"] + ([f"tensor parallel {s.tp}"] if s.tp > 1 else [])
        if s.activation_checkpointing:
            why.append("activation checkpointing")
        if s.offload != "none":
            why.append(f"optimizer offload to {s.offload}")
        lines += [f"Fits {_size(budget)} per GPU: {', '.join(why)}, micro-batch "
                  f"{s.micro_batch} x {s.gradient_accumulation} accumulation steps.",
                  "Tried fastest first (no offload, no recomputation, larger micro-batch, "
                  "lower stage); this is the first whose traced peak fits.", ""]
    lines += [f"Peak of training on rank 0 of {s.world} (two steps of the engine traced on "
              "fake tensors)",
              f"  {s.model}: stage {s.stage}, offload {s.offload}, {s.dtype}, micro-batch "
              f"{s.micro_batch} x {s.seq_len} tokens, activation checkpointing "
              f"{'on' if s.activation_checkpointing else 'off'}"
              + (f", tensor parallel {s.tp} x data parallel {s.world // s.tp}" if s.tp > 1
                 else ""),
              f"  peak per rank: {_size(result.device_bytes)}, during {result.where}",
              f"  host per node: {_size(result.host_bytes * s.gpus)}",
              "  alive at the peak:"]
    lines += [f"    {name:<26}{_size(n):>12}" for name, n in result.breakdown.items()]
    return "\n".join(lines)


def run_estimate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Print the estimate (and write the config with ``--write``); the exit status."""
    _check_common(args, parser)
    if _traces(args):
        return run_trace(args, parser)
    if args.write and not args.gpu_memory:
        parser.error("argument --write: needs --gpu-memory to choose the stage to write")
    if (args.sp > 1 or args.tiled_mlp or args.tiled_loss > 1) and not (args.micro_batch
                                                                        and args.seq_len):
        parser.error("argument --sp/--tiled-mlp/--tiled-loss: they change the activation "
                     "estimate, which needs --model with --micro-batch and --seq-len")
    _check_bf16_states(parser, args)
    shape = _model_shape(parser, args.model) if args.model else None
    if (args.micro_batch or args.seq_len) and shape is None:
        parser.error("argument --micro-batch/--seq-len: the activation estimate needs "
                     "--model (a config.json or module:callable)")
    if args.seq_len:
        _check_seq_len(parser, args.seq_len, shape)
    split = _tp_split(parser, args) if args.tp > 1 else None
    if args.sp > 1:
        _check_sp(parser, args, shape)
    total = shape.total_params if shape else args.params
    request = EstimateRequest(
        total_params=total, tp=args.tp, split_params=None if split is None else min(split, total),
        gpus_per_node=args.gpus,
        nodes=args.nodes, dtype=args.dtype, optimizer=args.optimizer, shape=shape,
        micro_batch=args.micro_batch, seq_len=args.seq_len, gpu_memory=args.gpu_memory,
        cpu_memory=args.cpu_memory, sp=args.sp, tiled_mlp=args.tiled_mlp,
        loss_tiles=args.tiled_loss)
    report = estimate(request)
    print(report.render())
    if args.write:
        if report.config is None:
            print(f"not writing {args.write}: no configuration fits", file=sys.stderr)
            return 1
        _write_json(args.write, report.config)
        print(f"\nwrote {args.write}")
    return 0
