"""The import paths users, DeepSpeed scripts (through ``zerotrain.as_deepspeed``),
transformers and Accelerate rely on keep working when modules move between folders: every
module ``as_deepspeed.ALIASES`` forwards to, the names ``zerotrain`` exports, the classes
scripts import from their DeepSpeed-shaped homes, and every zerotrain import line in the
README, docs/ and examples/."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import zerotrain
from zerotrain import as_deepspeed

ROOT = Path(__file__).resolve().parents[1]

# (module, names) a script may import; moved modules must keep these homes.
PUBLIC = [
    ("zerotrain", ["initialize", "init_distributed", "ZeroEngine", "DeepSpeedEngine",
                   "ConfigError", "RepeatingLoader", "see_memory_usage", "add_config_arguments",
                   "get_accelerator", "zero", "comm", "checkpointing", "utils", "ops", "moe",
                   "pipe", "accelerator"]),
    ("zerotrain.engine", ["ZeroEngine"]),
    ("zerotrain.zero", ["Init", "GatheredParameters", "ZeroParamStatus"]),
    ("zerotrain.checkpointing", ["checkpoint", "configure"]),
    ("zerotrain.utils", ["safe_get_full_fp32_param", "set_z3_leaf_modules", "log_dist"]),
    ("zerotrain.comm", ["init_distributed", "Communicator"]),
    ("zerotrain.checkpoint", ["CheckpointError", "get_fp32_state_dict_from_zero_checkpoint"]),
    ("zerotrain.integrations.transformers", ["ZeroTrainer", "ZeroTrainingArguments"]),
    ("zerotrain.ops.adam", ["FusedAdam", "DeepSpeedCPUAdam"]),
]


@pytest.mark.parametrize("module,names", PUBLIC, ids=[m for m, _ in PUBLIC])
def test_public_names_import_from_their_homes(module, names):
    imported = importlib.import_module(module)
    missing = [name for name in names if not hasattr(imported, name)]
    assert not missing, f"{module} lacks {missing}"


def test_the_engine_class_is_one_object_under_every_name():
    from zerotrain.engine import ZeroEngine
    assert ZeroEngine is zerotrain.ZeroEngine is zerotrain.DeepSpeedEngine


def test_every_alias_target_of_the_deepspeed_switch_imports():
    targets = sorted({t for t in as_deepspeed.ALIASES.values() if t is not None})
    broken = []
    for target in targets:
        try:
            importlib.import_module(target)
        except ImportError as err:
            broken.append(f"{target}: {err}")
    assert not broken, broken


_IMPORT = re.compile(r"^\s*((?:from zerotrain[\w.]* import [^#\\]+?|import zerotrain[\w.]*"
                     r"(?: as \w+)?))\s*(?:#.*)?$")


def _documented_imports() -> list[tuple[str, str]]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "examples").glob("*.py"))]
    found = []
    for path in files:
        lines = path.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines, start=1):
            match = _IMPORT.match(line)
            if not match:
                continue
            statement = match.group(1).strip()
            if "(" in statement and ")" not in statement:  # continued: the names on this line
                head, names = statement.split("(", 1)
                names = names.strip().rstrip(",") or lines[number].strip().split(",")[0]
                statement = head + names.strip(" )")
            found.append((f"{path.relative_to(ROOT)}:{number}", statement.rstrip(",")))
    return found


def test_the_documented_imports_run():
    found = _documented_imports()
    assert len(found) >= 5, found  # the reader of this test: the lines exist
    broken = []
    for where, statement in found:
        try:
            exec(statement, {})  # noqa: S102 - the project's own documented import lines
        except ImportError as err:
            broken.append(f"{where}: {statement}: {err}")
    assert not broken, "\n".join(broken)
