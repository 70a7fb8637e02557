"""The dependency direction of src/zerotrain, read from the source with ``ast`` (no imports).

Rules:

* a module imports zerotrain modules only from rows above its own, or from an earlier tier
  of its own row (:data:`ROWS`); members of :data:`PEER_TIERS` may also import each other;
* inside a package, submodules may import each other, except in ``stages``: only
  ``stages/__init__`` imports the stages, and a stage imports only ``stages/base``; and in
  ``comm``, whose modules have their own rows (:data:`PACKAGE_ROWS`: ``setup`` and ``ledger``
  first, then ``communicator``) and import only from rows above their own;
* row 1 never imports ``torch.distributed``, and ``config`` does not import torch at all;
* only modules of ``zerotrain.comm`` call torch.distributed collectives;
* only ``engine``, ``utils``, ``planner``, ``integrations``, ``__init__`` and ``cli``
  import ``engine``
  (``engine/build`` is ``zerotrain.initialize``);
* ``checkpoint`` (full-weight export included) never imports ``stages`` or ``zero3``, although their row
  allows it: they see a stage only through their own protocols (:data:`NEVER_IMPORTS`);
* every module is placed in :data:`ROWS`, and every module of ``comm`` in
  :data:`PACKAGE_ROWS` (a new module fails until it is placed);
* no import cycle between modules of one package hides behind an import inside a function
  or under ``if TYPE_CHECKING:`` (move the shared piece into a module of its own instead);
* outside ``stages``, a stage is called, never probed nor written onto: no
  ``getattr``/``hasattr``/``setattr``/``delattr`` whose first argument is a stage (a name
  or attribute chain ending in ``stage``, ``_stage`` or ``inner``, or a call of one), and no
  assignment to or deletion of an attribute of one (Note "the contract" in
  ``stages/protocol.py``). ``tp/stage.py`` wraps its inner stage from outside ``stages``
  and keeps the rule too;
* no module is longer than :data:`MAX_LINES` lines.

Every import counts, including those inside functions and under ``if TYPE_CHECKING:``.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Optional

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "zerotrain"
PACKAGE = "zerotrain"

# --------------------------------------------------------------------------- the table
# Lowest row first. A row is a tuple of tiers, a tier a tuple of names. A name is a
# top-level module (``"errors"``: errors.py) or package (``"stages"``: every module under
# stages/); ``"__init__"`` is zerotrain/__init__.py. Names not present yet are fine.
# Add a new module here, in one place.
ROWS: tuple[tuple[tuple[str, ...], ...], ...] = (
    # 1. foundations: no torch.distributed (config: no torch at all)
    (("errors",), ("untrusted",), ("config", "core", "estimate", "unsupported"),
     ("moe", "pipe")),
    # 2. process-level services
    (("comm", "accelerator"),),
    # 3. building blocks of a stage
    (("muon",), ("optim", "schedules", "dataloader", "offload", "ops",
                 "offload_names", "launcher_names", "tp"),),
    # 4. the ZeRO stages and what user code sees of them
    (("stages",), ("recompute",), ("zero", "checkpointing"), ("sequence",)),
    # 5. persistence, and DeepSpeed's helpers over it
    (("checkpoint",),),
    # 6. the engine, DeepSpeed's helpers over it, then the entry points
    (("engine",), ("utils",), ("planner",),
     ("__init__", "cli", "cli_estimate", "launch", "demo", "__main__",
      "deepspeed_alias"),
     ("integrations",), ("deepspeed_aliases",), ("as_deepspeed", "deepspeed_alias_hook")),
)
# Tiers whose members may import one another (entry points).
PEER_TIERS: frozenset[tuple[str, ...]] = frozenset(
    {("__init__", "cli", "cli_estimate", "launch", "demo", "__main__", "deepspeed_alias")})
# Row-1 names: no torch.distributed; NO_TORCH: no torch import at all.
NO_DISTRIBUTED: frozenset[str] = frozenset(name for tier in ROWS[0] for name in tier)
NO_TORCH: frozenset[str] = frozenset({"config", "untrusted"})
# The one package allowed to call collectives, and who may import the engine.
COMM_MODULE = "comm"
ENGINE_IMPORTERS: frozenset[str] = frozenset({"engine", "__init__", "cli", "planner",
                                              "integrations", "utils"})
# Names a module never imports although its row may: checkpoints and full-weight export reach a stage
# only through checkpoint.state.ShardOwner and checkpoint.full_weights.FullWeights.
NEVER_IMPORTS: dict[str, frozenset[str]] = {
    "checkpoint": frozenset({"stages"}),
}
# Packages whose submodules must not import each other (see ``_package_rule``).
# (stages, once isolated this way, now has package rows: zero12 and zero3 share a row.)
ISOLATED_PACKAGES: dict[str, str] = {}  # package -> its shared module
# Packages whose submodules have rows of their own, lowest first (as in ROWS): a submodule
# imports only from rows above its own. comm: set-up and the ledger, then the named
# failures and the coalesced gathers, then the Communicator over them, then DeepSpeed's
# function API and the two-group collectives, then the package's re-exports.
PACKAGE_ROWS: dict[str, tuple[tuple[str, ...], ...]] = {
    "comm": (("trail", "teardown", "topology"), ("setup", "ledger"), ("failures", "coalesced"),
             ("communicator",),
             ("deepspeed_api", "hierarchy", "mesh", "agreement"), ("sequence",),
             ("parallel_state_sp", "groups"), ("__init__",)),
    "stages": (("protocol",), ("gradient_norm", "bucket_launch"), ("base", "buckets"),
               ("zero12", "zero3"), ("factory", "param_watch"), ("__init__",)),
    "engine": (("full_params", "parameter_offload", "vote_plan", "window"), ("group_gradients",),
               ("timers", "throughput", "lr_watch", "direct_backward", "ownership", "fingerprint",
                "optimizer_choice", "optimizer_views", "unused", "autocast", "sequence"),
               ("surface",), ("compile", "accumulation"),
               ("api", "reports", "persistence", "stepping"), ("engine",), ("resume",), ("build",),
               ("__init__",)),
    "core": (("flat", "quantize", "precision", "memory", "log"), ("records", "runtime_utils"), ("__init__",)),
}

COLLECTIVES = frozenset({
    "all_reduce", "all_reduce_coalesced", "all_reduce_multigpu", "broadcast",
    "broadcast_object_list", "all_gather", "all_gather_into_tensor", "all_gather_object",
    "all_gather_coalesced", "all_gather_single", "_all_gather_base", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base", "all_to_all",
    "all_to_all_single", "barrier", "monitored_barrier", "reduce", "gather", "gather_object",
    "scatter", "scatter_object_list", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "send_object_list", "recv_object_list"})
COLLECTIVE_STEMS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
                    "barrier")


def is_collective(name: str) -> bool:
    return name in COLLECTIVES or any(stem in name for stem in COLLECTIVE_STEMS)


# --------------------------------------------------------------------------- placement
def _placement() -> dict[str, tuple[int, int]]:
    where: dict[str, tuple[int, int]] = {}
    for r, row in enumerate(ROWS):
        for t, tier in enumerate(row):
            for name in tier:
                assert name not in where, f"{name} is placed twice in ROWS"
                where[name] = (r, t)
    return where


PLACEMENT = _placement()


def top_name(key: str) -> str:
    """``stages/zero12`` -> ``stages``; ``flat`` -> ``flat``; ``__init__`` -> ``__init__``."""
    return key.split("/", 1)[0]


def tier_of(name: str) -> tuple[str, ...]:
    r, t = PLACEMENT[name]
    return ROWS[r][t]


# --------------------------------------------------------------------------- source model
def load_modules(root: Path = SRC) -> dict[str, str]:
    """Module key (``stages/zero12``, ``__init__``) -> source text."""
    return {p.relative_to(root).with_suffix("").as_posix(): p.read_text(encoding="utf-8")
            for p in sorted(root.rglob("*.py"))}


def _package_parts(key: str) -> list[str]:
    """The dotted package (as parts, without ``zerotrain``) a module's relative imports use."""
    parts = key.split("/")
    return parts[:-1]  # a/b -> [a]; a/__init__ -> [a]; __init__ -> []


def _key_of(parts: list[str], modules: Mapping[str, str]) -> Optional[str]:
    """The module key for dotted parts below zerotrain, or None if no such module."""
    if not parts:
        return "__init__"
    name = "/".join(parts)
    if name in modules:
        return name
    if f"{name}/__init__" in modules:
        return f"{name}/__init__"
    return None


def _zerotrain_parts(dotted: str) -> Optional[list[str]]:
    parts = dotted.split(".")
    return parts[1:] if parts[0] == PACKAGE else None


def imported_modules(key: str, tree: ast.AST, modules: Mapping[str, str]) -> Iterator[
        tuple[str, int]]:
    """(target key, line) for every zerotrain module ``key``'s source imports.

    ``from X import name`` targets ``X.name`` when that is a module, else ``X`` itself.
    A target that does not exist is reported by its dotted path below zerotrain.
    """
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = _zerotrain_parts(alias.name)
                if parts is not None:
                    yield _key_of(parts, modules) or "/".join(parts), node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_parts(key)
                if node.level > 1:
                    base = base[: len(base) - (node.level - 1)]
                base = base + (node.module.split(".") if node.module else [])
            else:
                parts = _zerotrain_parts(node.module or "")
                if parts is None:
                    continue
                base = parts
            for alias in node.names:
                sub = _key_of(base + [alias.name], modules)
                yield sub or _key_of(base, modules) or "/".join(base), node.lineno


def external_imports(tree: ast.AST) -> Iterator[tuple[str, int]]:
    """Dotted names of non-relative imports (``from torch import distributed`` gives
    ``torch.distributed`` as well as ``torch``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            yield node.module, node.lineno
            for alias in node.names:
                yield f"{node.module}.{alias.name}", node.lineno


# --------------------------------------------------------------------------- checks
def _package_row(key: str) -> Optional[int]:
    """The row of a submodule of a :data:`PACKAGE_ROWS` package, or None if not placed."""
    package, _, sub = key.partition("/")
    sub = sub.split("/", 1)[0]  # a subpackage (stages/zero3/unit) has the row of its folder
    for r, row in enumerate(PACKAGE_ROWS.get(package, ())):
        if sub in row:
            return r
    return None


def unplaced(modules: Mapping[str, str]) -> list[str]:
    missing = {top_name(k) for k in modules if top_name(k) not in PLACEMENT}
    missing |= {k for k in modules
                if top_name(k) in PACKAGE_ROWS and "/" in k and _package_row(k) is None}
    return sorted(missing)


def _package_rule(importer: str, target: str) -> Optional[str]:
    """None if an import inside one package is allowed, else why not."""
    package = top_name(importer)
    if package in PACKAGE_ROWS:
        mine, theirs = _package_row(importer), _package_row(target)
        inner = importer.split("/")[1:2], target.split("/")[1:2]
        if inner[0] == inner[1] and importer.count("/") > 1 and target.count("/") > 1:
            return None  # inside one subpackage (stages/zero3): free, like a package
        if mine is None or theirs is None:
            return None if mine is None else f"{target} is not placed in PACKAGE_ROWS"
        if theirs >= mine:
            return (f"{importer} imports only from rows above its own in "
                    f"PACKAGE_ROWS[{package!r}] ({target} is in row {theirs + 1}, "
                    f"{importer} in row {mine + 1})")
        return None
    shared = ISOLATED_PACKAGES.get(package)
    if shared is None:
        return None
    if importer == f"{package}/__init__":
        return None
    if target == f"{package}/{shared}":
        return None
    return (f"{package} modules do not import each other: only {package}/__init__ imports "
            f"them and they share only {package}/{shared}")


def layer_violations(modules: Mapping[str, str]) -> list[str]:
    problems = []
    for key, source in modules.items():
        name = top_name(key)
        if name not in PLACEMENT:
            continue  # reported by unplaced()
        tree = ast.parse(source, filename=key)
        for target, line in imported_modules(key, tree, modules):
            if target == key:
                continue
            where = f"{key}.py:{line} imports {target}"
            tname = top_name(target)
            if tname not in PLACEMENT:
                problems.append(f"{where}, which is not placed in ROWS")
                continue
            if tname == name and name != "__init__":
                why = _package_rule(key, target)
                if why:
                    problems.append(f"{where}: {why}")
                continue
            (r, t), (tr, tt) = PLACEMENT[name], PLACEMENT[tname]
            same_peer_tier = (r, t) == (tr, tt) and tier_of(name) in PEER_TIERS
            if not (tr < r or (tr == r and tt < t) or same_peer_tier):
                problems.append(f"{where}: row {r + 1} ({name}) may not import row {tr + 1} "
                                f"({tname})" + (" of the same tier" if (r, t) == (tr, tt)
                                                else ""))
            if tname == "engine" and name not in ENGINE_IMPORTERS:
                problems.append(f"{where}: only {sorted(ENGINE_IMPORTERS)} import the engine")
    return problems


def never_import_violations(modules: Mapping[str, str]) -> list[str]:
    problems = []
    for key, source in modules.items():
        banned = NEVER_IMPORTS.get(top_name(key), frozenset())
        if not banned:
            continue
        for target, line in imported_modules(key, ast.parse(source, filename=key), modules):
            if top_name(target) in banned:
                problems.append(f"{key}.py:{line} imports {target}: {top_name(key)} never "
                                f"imports {sorted(banned)} (it sees a stage only through "
                                "its protocol)")
    return problems


def torch_import_violations(modules: Mapping[str, str]) -> list[str]:
    problems = []
    for key, source in modules.items():
        name = top_name(key)
        if name not in NO_DISTRIBUTED and name not in NO_TORCH:
            continue
        for dotted, line in external_imports(ast.parse(source, filename=key)):
            if name in NO_TORCH and (dotted == "torch" or dotted.startswith("torch.")):
                problems.append(f"{key}.py:{line} imports {dotted}: {name} must not use torch")
            elif dotted == "torch.distributed" or dotted.startswith("torch.distributed."):
                problems.append(f"{key}.py:{line} imports {dotted}: row 1 does not "
                                "communicate")
    return problems


def _distributed_aliases(tree: ast.AST) -> tuple[set[str], set[str], list[tuple[str, int]]]:
    """Names bound to torch.distributed, names bound to torch, and collectives imported
    by name (``from torch.distributed import all_reduce``)."""
    dist_names, torch_names, direct = {"dist"}, set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch.distributed" and alias.asname:
                    dist_names.add(alias.asname)
                elif alias.name == "torch" or alias.name.startswith("torch."):
                    torch_names.add(alias.asname if alias.name == "torch" and alias.asname
                                    else "torch")
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for alias in node.names:
                bound = alias.asname or alias.name
                if node.module == "torch" and alias.name == "distributed":
                    dist_names.add(bound)
                elif node.module.startswith("torch.distributed") and is_collective(alias.name):
                    direct.append((f"{node.module}.{alias.name}", node.lineno))
    return dist_names, torch_names, direct


def _is_distributed(node: ast.AST, dist_names: set[str], torch_names: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id in dist_names
    return (isinstance(node, ast.Attribute) and node.attr == "distributed"
            and isinstance(node.value, ast.Name) and node.value.id in torch_names)


def collective_violations(modules: Mapping[str, str]) -> list[str]:
    problems = []
    for key, source in modules.items():
        if top_name(key) == COMM_MODULE:
            continue
        tree = ast.parse(source, filename=key)
        dist_names, torch_names, direct = _distributed_aliases(tree)
        found = list(direct)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and is_collective(node.attr)
                    and _is_distributed(node.value, dist_names, torch_names)):
                found.append((f"torch.distributed.{node.attr}", node.lineno))
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id == "getattr" and len(node.args) >= 2
                  and _is_distributed(node.args[0], dist_names, torch_names)
                  and isinstance(node.args[1], ast.Constant)
                  and isinstance(node.args[1].value, str) and is_collective(node.args[1].value)):
                found.append((f"torch.distributed.{node.args[1].value}", node.lineno))
        problems += [f"{key}.py:{line} uses {what}: only zerotrain.{COMM_MODULE} calls "
                     "collectives (go through Communicator)" for what, line in found]
    return problems


# Where a stage is held outside ``stages``: the last name of the expression.
STAGE_NAMES = frozenset({"stage", "_stage", "inner"})
PROBES = frozenset({"getattr", "hasattr", "setattr", "delattr"})
# Probes allowed for now: (module, attribute probed); none are left.
PENDING_PROBES: frozenset[tuple[str, str]] = frozenset()


def _is_stage(node: ast.AST) -> bool:
    """``stage``, ``self._stage``, ``engine.stage``, ``self.inner``, ``self._stage()``..."""
    if isinstance(node, ast.Call):
        node = node.func
    name = (node.id if isinstance(node, ast.Name)
            else node.attr if isinstance(node, ast.Attribute) else None)
    return name is not None and (name in STAGE_NAMES or name.endswith("_stage"))


def stage_probe_violations(modules: Mapping[str, str]) -> list[str]:
    """Probes of a stage and writes onto one outside ``stages`` (the contract)."""
    problems = []
    for key, source in modules.items():
        if top_name(key) == "stages":
            continue
        for node in ast.walk(ast.parse(source, filename=key)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in PROBES and node.args and _is_stage(node.args[0])):
                attr = node.args[1] if len(node.args) > 1 else None
                name = attr.value if isinstance(attr, ast.Constant) else "?"
                if (key, name) not in PENDING_PROBES:
                    problems.append(f"{key}.py:{node.lineno} {node.func.id}(<stage>, {name!r}):"
                                    " call the stage's protocol member instead")
                continue
            targets: list[ast.AST] = []
            if isinstance(node, (ast.Assign, ast.Delete)):
                targets = list(node.targets)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for target in targets:
                for part in ast.walk(target):
                    if (isinstance(part, ast.Attribute)
                            and isinstance(part.ctx, (ast.Store, ast.Del))
                            and _is_stage(part.value)):
                        problems.append(f"{key}.py:{node.lineno} writes {part.attr!r} onto a "
                                        "stage: keep the engine's records in "
                                        "engine/ownership.py, hand the stage what it needs "
                                        "through a protocol member")
    return problems


def _runtime_imports(key: str, tree: ast.AST, modules: Mapping[str, str]) -> Iterator[
        tuple[str, int, bool]]:
    """(target key, line, lazy) for every zerotrain import of ``key``; ``lazy``: inside a
    function or under ``if TYPE_CHECKING:`` (it runs after, or never at, import time)."""
    def visit(node: ast.AST, lazy: bool) -> Iterator[tuple[str, int, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target, line in imported_modules(key, child, modules):
                    yield target, line, lazy
                continue
            deferred = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            deferred = deferred or (isinstance(child, ast.If)
                                    and "TYPE_CHECKING" in ast.unparse(child.test))
            yield from visit(child, lazy or deferred)
    return visit(tree, False)


def lazy_cycles(modules: Mapping[str, str]) -> list[str]:
    """Each import cycle between modules of one package that closes through a lazy import
    (:func:`_runtime_imports`), as ``a.py:line -> b -> ... -> a``."""
    graph: dict[str, dict[str, tuple[int, bool]]] = {}
    for key, source in modules.items():
        for target, line, lazy in _runtime_imports(key, ast.parse(source, filename=key),
                                                   modules):
            if target != key and target in modules and top_name(target) == top_name(key):
                edges = graph.setdefault(key, {})
                if target not in edges or (edges[target][1] and not lazy):
                    edges[target] = (line, lazy)

    def path(start: str, goal: str) -> Optional[list[str]]:
        seen, stack = {start}, [[start]]
        while stack:
            trail = stack.pop()
            if trail[-1] == goal:
                return trail
            for nxt in sorted(graph.get(trail[-1], {})):
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(trail + [nxt])
        return None

    problems = []
    for key, edges in sorted(graph.items()):
        for target, (line, lazy) in sorted(edges.items()):
            back = path(target, key) if lazy else None
            if back:
                problems.append(f"{key}.py:{line} imports {target} lazily, closing the cycle "
                                + " -> ".join([key, *back]))
    return problems


def _report(problems: Iterable[str]) -> str:
    return "\n".join(problems)


# --------------------------------------------------------------------------- the real tree
@pytest.fixture(scope="module")
def modules() -> dict[str, str]:
    found = load_modules()
    assert "__init__" in found and "errors" in found, f"no zerotrain sources under {SRC}"
    return found


def test_every_module_is_placed_in_a_row(modules):
    missing = unplaced(modules)
    assert not missing, (f"modules {missing} are not in any row: place them in ROWS (or a "
                         "package's module in PACKAGE_ROWS) at the top of tests/test_layers.py "
                         "(lowest row they may sit in)")


MAX_LINES = 400   # a module longer than this has more than one job: split it


def test_no_module_is_longer_than_400_lines(modules):
    long = {key: source.count("\n") for key, source in modules.items()
            if source.count("\n") > MAX_LINES}
    assert not long, (f"modules over {MAX_LINES} lines: {long}; split each along a job "
                      "of its own (a mixin, a helper module)")


def test_modules_import_only_from_lower_rows(modules):
    problems = layer_violations(modules)
    assert not problems, _report(problems)


def test_checkpoint_and_export_never_import_stages_or_zero3(modules):
    problems = never_import_violations(modules)
    assert not problems, _report(problems)


def test_row_one_does_not_import_torch_distributed_and_config_not_torch(modules):
    problems = torch_import_violations(modules)
    assert not problems, _report(problems)


def test_only_comm_calls_torch_distributed_collectives(modules):
    problems = collective_violations(modules)
    assert not problems, _report(problems)


def test_no_import_cycle_inside_a_package_hides_behind_a_lazy_import(modules):
    problems = lazy_cycles(modules)
    assert not problems, _report(problems) + ("\nmove what both modules need into a module "
                                              "of its own that imports neither")


def test_a_stage_is_called_never_probed_nor_written_onto_outside_stages(modules):
    problems = stage_probe_violations(modules)
    assert not problems, _report(problems)


def test_the_collective_detector_sees_comms_own_collectives(modules):
    """Guards the detector: run on comm's modules as if they were another module, it must
    fire."""
    own = [key for key in modules if top_name(key) == COMM_MODULE]
    assert own, f"no {COMM_MODULE} modules under {SRC}"
    problems = [p for key in own for p in collective_violations({"optim": modules[key]})]
    for name in ("all_reduce", "broadcast", "barrier", "all_gather_object"):
        assert any(f"torch.distributed.{name}" in p for p in problems), (name, problems)


def test_the_row_table_names_are_unique_and_known_rules_refer_to_placed_names():
    assert len(PLACEMENT) == sum(len(tier) for row in ROWS for tier in row)
    banned = {name for names in NEVER_IMPORTS.values() for name in names}
    for name in (NO_TORCH | ENGINE_IMPORTERS | {COMM_MODULE} | set(ISOLATED_PACKAGES)
                 | set(PACKAGE_ROWS)
                 | set(NEVER_IMPORTS) | banned):
        assert name in PLACEMENT, name
    for tier in PEER_TIERS:
        assert any(tier in row for row in ROWS), tier


# --------------------------------------------------------------------------- the checker
def _tree(**sources: str) -> dict[str, str]:
    """A synthetic package: keyword ``stages_zero12`` means ``stages/zero12``."""
    return {k.replace("_", "/", 1) if k.startswith(("stages_", "demo_", "checkpoint_", "comm_"))
            else k: v for k, v in sources.items()}


def test_checker_flags_an_upward_import():
    fake = _tree(errors="from .engine import ZeroEngine\n", engine="", __init__="")
    problems = layer_violations(fake)
    assert any("errors.py:1 imports engine" in p for p in problems), problems


def test_checker_resolves_absolute_relative_and_module_imports():
    fake = _tree(dataloader="import zerotrain.checkpoint\n", checkpoint="",
                 comm="from zerotrain import planner\n", planner="",
                 unsupported="from . import optim\n", optim="",
                 untrusted="import zerotrain\n", __init__="")
    problems = _report(layer_violations(fake))
    assert "dataloader.py:1 imports checkpoint" in problems
    assert "comm.py:1 imports planner" in problems
    assert "unsupported.py:1 imports optim" in problems
    assert "untrusted.py:1 imports __init__" in problems


def test_checker_allows_same_row_imports_only_from_earlier_tiers_or_peer_tiers():
    fake = _tree(config="from .errors import ConfigError\n", errors="",
                 estimate="from .config import x\n",
                 planner="from .engine import ZeroEngine\n", engine="",
                 cli="from . import demo\n", demo="import zerotrain\n", __init__="")
    problems = layer_violations(fake)
    assert len(problems) == 1 and "estimate.py:1 imports config" in problems[0], problems


def test_checker_flags_stages_importing_each_other_but_not_base_or_init():
    fake = _tree(stages___init__="from .zero12 import A\nfrom .base import B\n",
                 stages_base="", stages_zero12="from .base import B\n",
                 stages_zero3="from .zero12 import A\nfrom . import base\n")
    problems = layer_violations(fake)
    assert len(problems) == 1 and "stages/zero3.py:1 imports stages/zero12" in problems[0], \
        problems


def test_checker_orders_comm_modules_by_their_package_rows():
    fake = _tree(comm___init__="from .communicator import C\nfrom .setup import x\n",
                 comm_setup="from .communicator import C\n",
                 comm_ledger="from .setup import x\n",
                 comm_communicator="from .ledger import L\nfrom .setup import x\n",
                 comm_deepspeed_api="from .communicator import y\n",
                 comm_mystery="", optim="from .comm.mystery import z\n")
    problems = _report(layer_violations(fake))
    assert "comm/setup.py:1 imports comm/communicator" in problems
    assert "comm/ledger.py:1 imports comm/setup" in problems
    assert len(layer_violations(fake)) == 2, problems
    assert unplaced(fake) == ["comm/mystery"]


def test_checker_flags_engine_imported_outside_its_users():
    fake = _tree(demo_run="from zerotrain.engine import ZeroEngine\n", engine="",
                 cli="from .engine import ZeroEngine\n", __init__="")
    problems = layer_violations(fake)
    assert len(problems) == 1 and "demo/run.py:1" in problems[0], problems


def test_checker_flags_checkpoint_or_export_importing_stages_or_zero3():
    fake = _tree(checkpoint_load="from ..stages.base import FROZEN\nfrom ..records import x\n",
                 checkpoint_state="import zerotrain.stages.zero3.partition\n",
                 checkpoint_full_weights="from ..stages.zero3.init import GatheredParameters\n"
                                         "from ..core import flat\n",
                 engine="from .stages import base\n", stages_base="", records="", flat="")
    problems = _report(never_import_violations(fake))
    assert "checkpoint/load.py:1 imports stages/base" in problems
    assert "checkpoint/state.py:1 imports stages/zero3/partition" in problems
    assert "checkpoint/full_weights.py:1 imports stages/zero3/init" in problems
    assert len(never_import_violations(fake)) == 3, problems


def test_checker_flags_unplaced_modules_and_imports_of_them():
    fake = _tree(mystery="", optim="from .mystery import x\n")
    assert unplaced(fake) == ["mystery"]
    assert any("not placed in ROWS" in p for p in layer_violations(fake))


def test_checker_flags_torch_in_config_and_distributed_in_row_one():
    fake = _tree(config="import torch\n", estimate="from torch import distributed as d\n",
                 errors="import torch.distributed.rpc\n", comm="import torch.distributed\n")
    problems = _report(torch_import_violations(fake))
    assert "config.py:1 imports torch" in problems
    assert "estimate.py:1 imports torch.distributed" in problems
    assert "errors.py:1 imports torch.distributed.rpc" in problems
    assert "comm.py" not in problems


@pytest.mark.parametrize("source", [
    "import torch.distributed as d\nd.all_reduce(x)\n",
    "import torch\ntorch.distributed.barrier()\n",
    "from torch import distributed\ndistributed.broadcast(x, 0)\n",
    "from torch.distributed import reduce_scatter_tensor\n",
    "import torch.distributed as dist\nf = getattr(dist, 'all_gather_into_tensor')\n",
    "from .comm import dist\ndist.all_gather(out, x)\n",
])
def test_checker_flags_collectives_outside_comm(source):
    assert collective_violations({"buckets": source})
    assert not collective_violations({"comm": source})
    assert not collective_violations({"comm/communicator": source})


@pytest.mark.parametrize("source", [
    "x = getattr(stage, 'grad_norm', None)\n",
    "if hasattr(self.stage, 'unused_parameters'):\n    pass\n",
    "n = getattr(engine.stage, 'split_of', None)\n",
    "w = getattr(state.stage, 'tensor_parallel_world_size', 1)\n",
    "h = hasattr(self._stage(), 'scheduler')\n",
    "setattr(self.inner, 'grad_norm', norm)\n",
    "stage.zerotrain_closed = True\n",
    "self.stage.x = 1\n",
    "engine.stage.zerotrain_engine = ref\n",
    "self.inner.grad_norm = norm\n",
    "held_stage.count += 1\n",
    "stage.a, other.b = 1, 2\n",
    "del stage.zerotrain_params\n",
])
def test_checker_flags_probes_of_and_writes_onto_a_stage_outside_stages(source):
    assert stage_probe_violations({"engine/engine": source})
    assert stage_probe_violations({"tp/stage": source})   # the wrapper keeps the rule too
    assert not stage_probe_violations({"stages/zero12": source})


@pytest.mark.parametrize("source", [
    "x = stage.grad_norm\nstage.use_grad_norm(norm)\n",
    "self.stage = stage\nself.inner = stage\n",
    "ref = getattr(p, '_zerotrain_stage', None)\n",
    "n = getattr(engine, 'stage_count', 0)\n",
    "stage.buckets.reduce_scatter\n",
])
def test_checker_allows_plain_calls_and_other_objects(source):
    assert not stage_probe_violations({"engine/optimizer_views": source})


def test_checker_flags_a_probe_through_a_call_chain():
    source = "handles = getattr(self.engine().stage, 'forward_hook_handles', None)\n"
    assert stage_probe_violations({"engine/optimizer_views": source})


def test_checker_allows_non_collective_torch_distributed_calls():
    source = "import torch.distributed as dist\ndist.get_backend()\ndist.get_rank()\n"
    assert not collective_violations({"initialize": source})


def test_checker_flags_a_cycle_closed_by_a_function_or_type_checking_import():
    fake = _tree(checkpoint_write="from .write3 import w3\n",
                 checkpoint_write3="def f():\n    from .write import x\n",
                 offload_storage="from .host import H\n",
                 offload_host="from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from .storage import S\n",
                 checkpoint_fs="def g():\n    from ..offload import storage\n",
                 offload___init__="", comm_a="def h():\n    from .b import y\n",
                 comm_b="")
    fake = {k.replace("offload_", "offload/", 1) if k.startswith("offload_") else k: v
            for k, v in fake.items()}
    problems = _report(lazy_cycles(fake))
    assert "checkpoint/write3.py:2 imports checkpoint/write lazily" in problems, problems
    assert "offload/host.py:3 imports offload/storage lazily" in problems, problems
    assert len(lazy_cycles(fake)) == 2, problems   # across packages, or no cycle: fine


def test_checker_frees_a_subpackage_inside_and_orders_it_by_its_folder():
    fake = {"stages/zero3/unit": "from .wire import W\nfrom ..buckets import B\n",
            "stages/zero3/wire": "", "stages/buckets": "from .zero3.unit import U\n",
            "stages/zero12": "from .zero3 import wire\n"}
    problems = _report(layer_violations(fake))
    assert "stages/buckets.py:1 imports stages/zero3/unit" in problems
    assert "stages/zero12.py:1 imports stages/zero3/wire" in problems
    assert len(layer_violations(fake)) == 2, problems
