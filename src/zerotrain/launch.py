"""``zerotrain launch``: torchrun under our name, with two options of ours.

Why a module of its own: the arguments before the script are torchrun's and ours
(``--auto-resume DIR``, ``--as-deepspeed``, ``--no_local_rank``), everything after it is the
script's, verbatim; telling them apart with torchrun's own parser, and rewriting the command
so an unmodified DeepSpeed script runs through ``zerotrain.as_deepspeed``, is one job apart
from the other subcommands (``cli.py``). Like ``cli.py`` it prints its usage errors.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

_AUTO_RESUME = "--auto-resume"   # ours, taken out before torchrun sees the arguments
_OURS = ("--as-deepspeed", "--no_local_rank")


def launch(argv: list[str]) -> int:
    """torchrun with ``argv``; ``--auto-resume DIR`` (ours, given before the script) makes
    the launched script's ``initialize`` load the newest complete checkpoint in DIR, so
    combine it with torchrun's ``--max-restarts N``. Everything after the script path is
    the script's, verbatim (``--``, its own ``--auto-resume`` or ``--a`` included).

    The directory travels in ``ZEROTRAIN_AUTO_RESUME`` together with
    ``ZEROTRAIN_AUTO_RESUME_LAUNCHER`` (this process's pid): ``initialize`` honours it only
    in a direct child of this process (torchrun's workers), so a job the script itself
    starts does not inherit the resume. The launcher owns both variables: without
    ``--auto-resume`` it clears them, so one left exported in the shell by an earlier job
    never makes an unrelated run resume from that job's folder (a note on stderr says so)."""
    split = _launch_options(argv)
    if split is None:
        return 2
    argv, ours = split
    _own_environment(ours.auto_resume)
    if ours.as_deepspeed:
        argv = _as_deepspeed(argv)
        if argv is None:
            return 2
    from torch.distributed.run import main as torchrun
    torchrun(argv)
    return 0


# The variables the launcher sets for its workers: each is set from this command's own
# options or removed, never passed through from the caller's shell.
_OWNED_ENV = ("ZEROTRAIN_AUTO_RESUME", "ZEROTRAIN_AUTO_RESUME_LAUNCHER")


def _own_environment(auto_resume: Optional[str]) -> None:
    """Set the workers' ``_OWNED_ENV`` from ``--auto-resume`` (read by ``initialize``), or
    clear what an earlier job left exported."""
    stale = os.environ.get("ZEROTRAIN_AUTO_RESUME")
    for name in _OWNED_ENV:
        os.environ.pop(name, None)
    if auto_resume is not None:
        os.environ["ZEROTRAIN_AUTO_RESUME"] = auto_resume
        os.environ["ZEROTRAIN_AUTO_RESUME_LAUNCHER"] = str(os.getpid())
    elif stale:
        print(f"zerotrain launch: not passing ZEROTRAIN_AUTO_RESUME={stale} from the "
              "environment to the workers (left from an earlier job?); give --auto-resume "
              "DIR to resume", file=sys.stderr)


def _launch_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "zerotrain launch"
    parser.add_argument("--auto-resume", dest="auto_resume", metavar="DIR", default=None,
                        help="load DIR's newest complete checkpoint in initialize()")
    parser.add_argument("--as-deepspeed", dest="as_deepspeed", action="store_true")
    parser.add_argument("--no_local_rank", dest="no_local_rank", action="store_true")
    return parser


def _full_option(parser: argparse.ArgumentParser, arg: str) -> Optional[str]:
    """The option ``arg`` names (exactly, or as the unique prefix argparse accepts)."""
    name = arg.partition("=")[0]
    known = parser._option_string_actions
    if name in known:
        return name
    matches = [o for o in known if o.startswith(name)] if name.startswith("--") else []
    return matches[0] if len(matches) == 1 else None


def _script_index(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    """Where the script path is in ``argv``: the first argument that is neither an option
    of ours or torchrun's nor an option's value (len(argv) when there is none). Options
    after it are never parsed: they are the script's."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return i + 1
        if not arg.startswith("-") or arg == "-":
            return i
        full = _full_option(parser, arg)
        takes_value = full is not None and parser._option_string_actions[full].nargs != 0
        i += 2 if takes_value and "=" not in arg else 1
    return len(argv)


def _launch_options(argv: list[str]) -> Optional[tuple[list[str], argparse.Namespace]]:
    """(the arguments without ``--auto-resume DIR``, our options): only what comes before
    the script (:func:`_script_index`) is parsed, by torchrun's own parser with ours added;
    ``--auto-resume`` is taken out of it (``--as-deepspeed`` is left to
    :func:`_as_deepspeed`). None (after argparse printed why) when they do not parse."""
    parser = _launch_parser()
    at = _script_index(parser, argv)
    try:
        parsed = parser.parse_args(argv[:at + 1])
    except SystemExit:
        return None
    if parsed.auto_resume == "":
        parser.print_usage(sys.stderr)
        print("zerotrain launch: --auto-resume needs a checkpoint directory", file=sys.stderr)
        return None
    options, i = [], 0
    while i < at:
        if _full_option(parser, argv[i]) != _AUTO_RESUME:
            options.append(argv[i])
            i += 1
            continue
        i += 1 if "=" in argv[i] else 2   # --auto-resume=DIR, or --auto-resume DIR
    return options + argv[at:], parsed


def _as_deepspeed(argv: list[str]) -> Optional[list[str]]:
    """torchrun arguments that run the script through ``zerotrain.as_deepspeed``, which
    makes ``deepspeed`` imports resolve to zerotrain in each worker and, like DeepSpeed's
    launcher, passes ``--local_rank`` (unless ``--no_local_rank`` is given). Our two flags
    count only before the script; after it they are the script's own arguments."""
    parser = _launch_parser()
    script = _script_index(parser, argv)
    prefix, script_args = argv[:script], argv[script + 1:]
    if "--as-deepspeed" not in prefix:
        return argv   # the flag belongs to the script
    torchrun_options = [a for a in prefix if a not in _OURS + ("-m", "--module")]
    try:
        parsed = parser.parse_args(argv[:script + 1])
    except SystemExit:
        return None
    if parsed.no_python:
        print("zerotrain launch: --as-deepspeed runs a Python script; it cannot be combined "
              "with --no-python", file=sys.stderr)
        return None
    runner = (["--no_local_rank"] if "--no_local_rank" in prefix else []) + (
        ["-m"] if parsed.module else [])
    return torchrun_options + ["-m", "zerotrain.as_deepspeed", *runner, parsed.training_script,
                               *script_args]
