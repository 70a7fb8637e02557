"""Which parameters Muon steps: DeepSpeed's ``use_muon`` flags and its Muon/Adam halves.

Why a module of its own: the flags are a property of the parameters, set from the model
before any stage exists, and the halves decide the optimizer groups every stage shards; both
follow DeepSpeed 0.19.8 (``set_optimizer_flags`` in ``deepspeed/__init__.py`` and
``DeepSpeedEngine._muon_param_groups``) so that a config moves over unchanged.

Note: the flags
    As in DeepSpeed, ``initialize`` tags every parameter of the model: ``use_muon`` is True
    for a parameter whose layer shape (``ds_shape`` under ``zero.Init``) has two or more
    dimensions and whose name holds neither ``embed`` nor ``lm_head``, False otherwise; a
    flag set beforehand is overwritten (DeepSpeed does the same). A parameter in
    ``model_parameters`` without the flag is an error naming it.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from ..errors import ConfigError

MUON_KEYS = ("lr", "momentum", "weight_decay", "ns_method")
ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")
MUON_DEFAULTS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0, "ns_method": "gram"}
ADAM_DEFAULTS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0}


def layer_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The parameter's shape as a layer (``ds_shape`` when ``zero.Init`` partitioned it)."""
    shape = getattr(param, "ds_shape", None)
    return tuple(param.shape) if shape is None else tuple(shape)


def tag_model(model: nn.Module) -> None:
    """Set ``use_muon`` on every parameter of ``model`` (Note: the flags)."""
    for name, param in model.named_parameters():
        lowered = name.lower()
        param.use_muon = (len(layer_shape(param)) >= 2
                          and "embed" not in lowered and "lm_head" not in lowered)


def muon_param_groups(model_parameters: Iterable[Any], optimizer_params: dict,
                      names: dict[int, str] | None = None) -> list[dict]:
    """Each incoming group split into its Muon and Adam halves (DeepSpeed's
    ``_muon_param_groups``): settings resolve as the config's shared value, then
    ``muon_lr`` / ``adam_lr``, then the group's own; each half gets DeepSpeed's defaults for
    what is still unset. ``names``: id -> name, for the error naming unflagged parameters."""
    groups, loose = [], []
    for item in model_parameters:
        (groups if isinstance(item, dict) else loose).append(item)
    if loose or not groups:
        groups.append({"params": loose})
    groups = [dict(g, params=[g["params"]] if isinstance(g["params"], torch.Tensor)
                   else list(g["params"])) for g in groups]
    missing = [p for g in groups for p in g["params"] if not hasattr(p, "use_muon")]
    if missing:
        named = [(names or {}).get(id(p), f"<parameter of shape {tuple(p.shape)}>")
                 for p in missing]
        raise ConfigError("model_parameters", f"the Muon optimizer needs every parameter "
                          f"tagged with use_muon, and {len(missing)} are not: "
                          + ", ".join(named) + ". initialize tags the model's parameters; "
                          "set `param.use_muon = True / False` on these or pass them as part "
                          "of the model")
    halves = ((True, "muon", MUON_KEYS, _defaults(optimizer_params, MUON_KEYS, "muon_lr")),
              (False, "adam", ADAM_KEYS, _defaults(optimizer_params, ADAM_KEYS, "adam_lr")))
    out = []
    for index, group in enumerate(groups):
        overrides = {k: v for k, v in group.items() if k != "params"}
        trainable = [p for p in group["params"] if p.requires_grad]
        for use_muon, label, keys, defaults in halves:
            half = [p for p in trainable if bool(p.use_muon) is use_muon]
            if not half:
                continue
            settings = dict(MUON_DEFAULTS if use_muon else ADAM_DEFAULTS)
            settings.update(defaults)
            settings.update({k: v for k, v in overrides.items() if k in keys})
            if "betas" in settings:
                settings["betas"] = tuple(settings["betas"])
            prefix = overrides.get("name") or (f"group{index}" if len(groups) > 1 else None)
            name = f"{prefix}-{label}-params" if prefix else f"{label}-params"
            out.append(dict(params=half, use_muon=use_muon, name=name, **settings))
    return out


def _defaults(params: dict, keys: tuple[str, ...], lr_override: str) -> dict:
    out = {k: params[k] for k in keys if k in params}
    if lr_override in params:
        out["lr"] = params[lr_override]
    return out
