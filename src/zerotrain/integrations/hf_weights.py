"""Hugging Face models whose parameters are partitioned (ZeRO stage 3): build, load, save.

Note: why transformers needs help under zero.Init
    transformers (5.x) initialises weights after construction, in ``post_init``, through
    copies of the ``torch.nn.init`` functions it took at import time, and only switches to
    a gathering variant when DeepSpeed is installed and configured. Under ``zero.Init`` the
    parameters are already partitioned by then, so those inits would write into empty
    tensors and the model would keep torch's default init. :func:`zero3_init` therefore
    also replaces ``PreTrainedModel.initialize_weights`` while it is active: each module's
    parameters (and its direct children's, which ``_init_weights`` may touch) are gathered
    around its init function, every rank runs it with the same random stream, and rank 0's
    values are kept. The values equal those of a plain construction with the same seed.
    ``from_pretrained`` cannot be used inside the context either (it compares the
    checkpoint's shapes with the empty placeholders and refuses), so :func:`from_pretrained`
    builds from the config and then copies the checkpoint in module by module.
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoConfig, GenerationConfig, PreTrainedModel
from transformers import initialization as hf_init
from transformers.utils import cached_file

from .. import untrusted
from ..config import read_config_dict
from ..errors import ConfigError
from ..stages.factory import partitions_parameters
from ..zero import GatheredParameters, Init
from .hf_config import zero_stage

__all__ = ["config_dict", "from_pretrained", "gathered_state_dict", "zero3_init"]

logger = logging.getLogger(__name__)
_INDEX_MAX_BYTES = 64 << 20     # a safetensors index lists names: never this large
_HEADER_MAX_BYTES = 100 << 20   # the safetensors library's own limit on a header


def config_dict(args_or_config: Any) -> dict:
    """The raw zerotrain config from ZeroTrainingArguments, a dict, a JSON path or None."""
    source = getattr(args_or_config, "zerotrain", args_or_config)
    return read_config_dict(source)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# ----------------------------------------------------------------------------- build
@contextlib.contextmanager
def zero3_init(args_or_config: Any = None, *, enabled: bool = True) -> Iterator[None]:
    """Build models partitioned when the config is ZeRO stage 3; a no-op otherwise.

    ``with zero3_init(training_args): model = AutoModelForCausalLM.from_config(cfg)``.
    Every rank must build the same models in the same order (the parameters are
    broadcast and partitioned as each module is built). See the module Note.
    """
    if not enabled or not partitions_parameters(zero_stage(config_dict(args_or_config))):
        yield
        return
    original = PreTrainedModel.initialize_weights
    with Init():
        PreTrainedModel.initialize_weights = _initialize_weights_gathered
        try:
            yield
        finally:
            PreTrainedModel.initialize_weights = original


def _initialize_weights_gathered(self: PreTrainedModel) -> None:
    """``PreTrainedModel.initialize_weights`` over partitioned parameters (module Note).

    Visits modules in the order transformers does (children first, a nested
    PreTrainedModel with its own init function), so the random stream is the same.
    """
    custom = self.is_custom_code()

    def visit(module: nn.Module, init_fn) -> None:
        for child in module.children():
            visit(child, child._initialize_weights if isinstance(child, PreTrainedModel)
                  else init_fn)
        if getattr(module, "_is_hf_initialized", False):
            return  # init_fn would return at once; skip the gather
        params = list(module.parameters(recurse=False))
        for child in module.children():
            if not isinstance(child, PreTrainedModel):
                params.extend(child.parameters(recurse=False))
        with GatheredParameters(params, modifier_rank=0):
            init_fn(module, custom)

    with torch.no_grad(), hf_init.guard_torch_init_functions():
        visit(self, self._initialize_weights)


def from_pretrained(model_class: Any, pretrained_model_name_or_path: str,
                    args_or_config: Any = None, **kwargs: Any) -> PreTrainedModel:
    """``model_class.from_pretrained(...)`` that also works at ZeRO stage 3.

    Below stage 3 this is ``from_pretrained`` itself. At stage 3 the model is built
    partitioned from its config and the checkpoint's safetensors are copied in one module
    at a time, through ``GatheredParameters(modifier_rank=0)``: rank 0 reads the
    parameters, every rank reads the (small) buffers, so no rank holds the whole model.
    Collective at stage 3. Keyword arguments go to ``AutoConfig.from_pretrained`` (hub
    options such as ``revision``) and the model constructor (``dtype``,
    ``attn_implementation``).
    """
    if not partitions_parameters(zero_stage(config_dict(args_or_config))):
        return model_class.from_pretrained(pretrained_model_name_or_path, **kwargs)
    hub = {k: kwargs.pop(k) for k in ("revision", "cache_dir", "token", "local_files_only",
                                      "subfolder") if k in kwargs}
    hf_config = kwargs.pop("config", None) or AutoConfig.from_pretrained(
        pretrained_model_name_or_path, **hub)
    build = getattr(model_class, "from_config", None) or model_class._from_config
    with zero3_init(args_or_config):
        model = build(hf_config, **kwargs)
    load_checkpoint_gathered(model, _safetensors_files(pretrained_model_name_or_path, hub))
    if model.can_generate():
        try:
            model.generation_config = GenerationConfig.from_pretrained(
                pretrained_model_name_or_path, **hub)
        except OSError:  # no generation_config.json: keep the one derived from the config
            pass
    model.eval()  # as from_pretrained returns it
    return model


def _safetensors_files(name_or_path: str, hub: dict) -> list[str]:
    index = cached_file(name_or_path, "model.safetensors.index.json",
                        _raise_exceptions_for_missing_entries=False, **hub)
    if index is not None:
        try:
            weight_map = untrusted.read_json(index, what="safetensors index", root=_root(index),
                                             max_bytes=_INDEX_MAX_BYTES)["weight_map"]
            shards = sorted(set(weight_map.values()))
        except untrusted.UnsafeFile as exc:
            raise ConfigError("from_pretrained", str(exc)) from None
        except (KeyError, TypeError, AttributeError):
            raise ConfigError("from_pretrained", f"{index} has no weight_map of shard "
                              "file names") from None
        bad = [s for s in shards if not isinstance(s, str) or os.path.basename(s) != s
               or s in ("", ".", "..")]
        if bad:
            raise ConfigError("from_pretrained", f"{index} names the shard {bad[0]!r}, which "
                              "is not a file name beside it")
        return [cached_file(name_or_path, shard, **hub) for shard in shards]
    single = cached_file(name_or_path, "model.safetensors",
                         _raise_exceptions_for_missing_entries=False, **hub)
    if single is None:
        raise ConfigError("from_pretrained", f"{name_or_path} has no model.safetensors; "
                          "zerotrain reads only safetensors (never pickled .bin files): "
                          "convert it once with from_pretrained + save_pretrained")
    return [single]


# ----------------------------------------------------------------------------- load
def _checkpoint_key(names: list[str], keys: dict, prefix: str) -> Optional[str]:
    """The checkpoint key for a parameter known by ``names`` (tied parameters have several),
    allowing for the base-model prefix being present on one side only."""
    for name in names:
        for candidate in (name, f"{prefix}.{name}",
                          name[len(prefix) + 1:] if prefix and name.startswith(prefix + ".")
                          else None):
            if candidate and candidate in keys:
                return candidate
    return None


def _root(file: str) -> str:
    """The folder a weights file must lie in once its symlinks are resolved: a hub cache's
    repository folder (``models--org--name``, whose ``snapshots/<rev>/`` files link into
    its ``blobs/``), else the file's own folder."""
    snapshot = os.path.dirname(os.path.abspath(file))
    if os.path.basename(os.path.dirname(snapshot)) == "snapshots":
        return os.path.dirname(os.path.dirname(snapshot))
    return snapshot


@contextlib.contextmanager
def _open_weights(file: str) -> Iterator[Any]:
    """``safe_open`` through the one opener (a regular file inside its folder)."""
    try:
        with untrusted.open_safetensors(file, what="safetensors weights file",
                                        root=_root(file),
                                        max_header_bytes=_HEADER_MAX_BYTES) as handle:
            yield handle
    except untrusted.UnsafeFile as exc:
        raise ConfigError("from_pretrained", str(exc)) from None


def load_checkpoint_gathered(model: nn.Module, files: list[str]) -> None:
    """Copy safetensors ``files`` into ``model`` (parameters partitioned or not).

    Collective. Every rank computes the same key mapping first, so a missing key raises
    on every rank before any gather.
    """
    keys: dict[str, str] = {}
    for file in files:
        with _open_weights(file) as f:
            keys.update({key: file for key in f.keys()})
    prefix = getattr(model, "base_model_prefix", "") or ""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    plan: dict[int, str] = {}
    missing = []
    for pid, aliases in names.items():
        key = _checkpoint_key(aliases, keys, prefix)
        if key is None:
            missing.append(aliases[0])
        else:
            plan[pid] = key
    if missing:
        raise ConfigError("from_pretrained", f"the checkpoint lacks {len(missing)} parameters "
                          f"of the model, e.g. {missing[:3]}")
    used = set(plan.values())
    with torch.no_grad():
        for module in model.modules():
            params = [p for p in module.parameters(recurse=False) if id(p) in plan]
            if not params:
                continue
            with GatheredParameters(params, modifier_rank=0):
                if _rank() == 0:
                    for p in params:
                        p.data.copy_(_read(keys, plan[id(p)]).view_as(p.data))
        for name, buffer in model.named_buffers():
            key = _checkpoint_key([name], keys, prefix)
            if key is not None:
                buffer.copy_(_read(keys, key).view_as(buffer))
                used.add(key)
    unused = sorted(set(keys) - used)
    if unused:
        logger.warning("%d checkpoint tensors are not used by the model, e.g. %s",
                       len(unused), unused[:3])


def _read(keys: dict[str, str], key: str) -> torch.Tensor:
    with _open_weights(keys[key]) as f:
        return f.get_tensor(key)


# ----------------------------------------------------------------------------- save
def gathered_state_dict(module: nn.Module) -> Optional[dict[str, torch.Tensor]]:
    """The module's full ``state_dict`` on rank 0's CPU, gathered one parameter at a time;
    None on the other ranks. Collective: every rank calls it. Tied parameters stay one
    tensor under both names, as ``save_pretrained`` expects."""
    rank = _rank()
    out: dict[str, torch.Tensor] = {}
    copies: dict[int, Optional[torch.Tensor]] = {}  # every rank: gather each tensor once
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) not in copies:
            with GatheredParameters([tensor]):
                copies[id(tensor)] = (tensor.detach().to("cpu", copy=True) if rank == 0
                                      else None)
        if rank == 0:
            out[name] = copies[id(tensor)]
    return out if rank == 0 else None


def is_saved_checkpoint(path: Optional[str]) -> bool:
    """Whether ``path`` holds a zerotrain checkpoint (``engine.save_checkpoint`` output)."""
    return bool(path) and os.path.isfile(os.path.join(path, "latest"))
