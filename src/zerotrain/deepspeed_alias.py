"""``zerotrain install-deepspeed-alias``: a ``deepspeed`` distribution in site-packages that is
zerotrain, for launchers that run outside the switch.

Why: ``accelerate launch --use_deepspeed`` (and an Accelerate config with
``distributed_type: DEEPSPEED``) checks for a ``deepspeed`` distribution in its own
process and in each process it starts; ``zerotrain launch --as-deepspeed`` cannot reach
those. This command, run once in an environment without DeepSpeed, writes three things
into site-packages (``purelib``):

* ``deepspeed-<version>.dist-info/`` (``METADATA`` naming zerotrain, ``INSTALLER``,
  ``RECORD``, ``top_level.txt``): ``importlib.metadata`` finds a ``deepspeed``
  distribution of the DeepSpeed release zerotrain follows;
* ``_zerotrain_deepspeed_alias.py`` and ``zerotrain-deepspeed-alias.pth``: at interpreter
  start a finder is appended to ``sys.meta_path`` (``deepspeed_alias_hook.py``); the first
  ``deepspeed`` import installs the switch (``as_deepspeed.install()``), nothing earlier.

It refuses when a real DeepSpeed is installed (nothing is shadowed) and is removed by
``zerotrain uninstall-deepspeed-alias`` (or ``pip uninstall deepspeed``, which reads the
``RECORD``). Only files that carry the alias's marker are ever removed.
"""
from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import sysconfig
from typing import Optional

from .errors import ZeroTrainError

MARKER = "zerotrain-deepspeed-alias"
PTH = "zerotrain-deepspeed-alias.pth"
LOADER = "_zerotrain_deepspeed_alias.py"
_LOADER_SOURCE = f'''"""Written by `zerotrain install-deepspeed-alias` ({MARKER}); removed by
`zerotrain uninstall-deepspeed-alias`."""
import importlib.util as _util
import os as _os

_spec = _util.find_spec("zerotrain")
if _spec is not None and _spec.submodule_search_locations:
    _path = _os.path.join(list(_spec.submodule_search_locations)[0], "deepspeed_alias_hook.py")
    if _os.path.isfile(_path):
        _hook = _util.spec_from_file_location("_zerotrain_deepspeed_alias_hook", _path)
        _module = _util.module_from_spec(_hook)
        _hook.loader.exec_module(_module)
        _module.register()
'''


class AliasError(ZeroTrainError, RuntimeError):
    """The alias cannot be installed or removed here (the message says why)."""


def site_packages(target: Optional[str] = None) -> str:
    return target or sysconfig.get_paths()["purelib"]


def _dist_info(where: str) -> Optional[str]:
    for name in sorted(os.listdir(where)):
        if name.lower().startswith("deepspeed-") and name.endswith(".dist-info"):
            return os.path.join(where, name)
    return None


def _is_ours(dist_info: str) -> bool:
    try:
        with open(os.path.join(dist_info, "INSTALLER"), encoding="utf-8") as f:
            return f.read().strip() == MARKER
    except OSError:
        return False


def install(target: Optional[str] = None) -> str:
    """Write the alias into ``target`` (site-packages by default); return the dist-info path."""
    from . import DEEPSPEED_VERSION, __version__

    where = site_packages(target)
    existing = _dist_info(where)
    if existing is not None and _is_ours(existing):
        return existing   # already there
    if existing is not None:
        raise AliasError(f"a deepspeed distribution is installed ({existing}); zerotrain will "
                         "not shadow it (uninstall DeepSpeed first, or use it)")
    try:
        real = md.distribution("deepspeed")
    except md.PackageNotFoundError:
        real = None
    if real is not None and (real.read_text("INSTALLER") or "").strip() != MARKER:
        raise AliasError(f"a deepspeed distribution is installed ({real.locate_file('')}); "
                         "zerotrain will not shadow it (uninstall DeepSpeed first, or use it)")
    spec = importlib.util.find_spec("deepspeed")   # the alias is absent: a real one, if any
    if spec is not None:
        raise AliasError(f"a deepspeed module is importable ({spec.origin or spec.name}); "
                         "zerotrain will not shadow it")
    if not os.access(where, os.W_OK):
        raise AliasError(f"{where} is not writable; pass --target or run where it is")
    dist_info = os.path.join(where, f"deepspeed-{DEEPSPEED_VERSION}.dist-info")
    files = {
        os.path.join(dist_info, "METADATA"): (
            f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {DEEPSPEED_VERSION}\n"
            f"Summary: zerotrain {__version__} standing in for DeepSpeed {DEEPSPEED_VERSION} "
            "(zerotrain install-deepspeed-alias)\nAuthor: zerotrain\n"),
        os.path.join(dist_info, "INSTALLER"): MARKER + "\n",
        os.path.join(dist_info, "top_level.txt"): "deepspeed\n",
        os.path.join(where, LOADER): _LOADER_SOURCE,
        os.path.join(where, PTH): f"import {LOADER[:-3]}\n",
    }
    record = os.path.join(dist_info, "RECORD")
    os.makedirs(dist_info, exist_ok=True)
    try:
        for path, text in files.items():
            _write_new(path, text)
        _write_new(record, "".join(f"{os.path.relpath(p, where)},,\n"
                                   for p in [*files, record]))
    except BaseException:
        uninstall(where)
        raise
    return dist_info


def _write_new(path: str, text: str) -> None:
    """Write ``path`` through a temporary file and a rename (nothing written in place)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def uninstall(target: Optional[str] = None) -> list[str]:
    """Remove the alias from ``target``; return the paths removed (none if it is absent)."""
    where = site_packages(target)
    removed = []
    dist_info = _dist_info(where)
    if dist_info is not None and not _is_ours(dist_info):
        raise AliasError(f"{dist_info} is not zerotrain's alias (a real DeepSpeed?); "
                         "nothing removed")
    loader = os.path.join(where, LOADER)
    for path in (os.path.join(where, PTH), loader):
        if os.path.isfile(path) and (path != loader or MARKER in _read(path)):
            os.remove(path)
            removed.append(path)
    if dist_info is not None:
        for name in sorted(os.listdir(dist_info)):
            os.remove(os.path.join(dist_info, name))
            removed.append(os.path.join(dist_info, name))
        os.rmdir(dist_info)
        removed.append(dist_info)
    return removed


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()
