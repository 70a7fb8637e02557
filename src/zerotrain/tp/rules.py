"""DeepSpeed's AutoTP rules: which linear layers are split, and how (no torch.distributed).

Column-parallel (output features split): the attention's q/k/v projections and the MLP's
up/gate projections, GPT-2's fused ``c_attn`` (three sections) and ``c_fc``, the fused
``gate_up_proj`` (two sections). Row-parallel (input features split, outputs summed): the
attention output (``o_proj``, ``out_proj``, GPT-2's ``c_proj``) and the MLP's ``down_proj``
(``fc2``, ``w2``, ``dense_4h_to_h``). Everything else stays whole on every rank:
embeddings, norms, ``lm_head``, and any linear layer no rule names.
``tensor_parallel.partition_config.layer_specs`` adds rules by weight name, tried first.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

# module name's last component -> (kind, fused sections)
DEFAULT_RULES: dict[str, tuple[str, int]] = {
    **{n: ("column", 1) for n in ("q_proj", "k_proj", "v_proj", "up_proj", "gate_proj",
                                  "c_fc", "fc1", "w1", "w3", "dense_h_to_4h")},
    "c_attn": ("column", 3),
    "gate_up_proj": ("column", 2),
    **{n: ("row", 1) for n in ("o_proj", "down_proj", "c_proj", "out_proj", "fc2", "w2",
                               "wo", "dense_4h_to_h")},
}


@dataclass(frozen=True, slots=True)
class Rule:
    kind: str        # "column", "row" or "skip" (kept whole)
    sections: int = 1


class Rules:
    """The rules of one ``tensor_parallel`` section, applied to module names."""

    def __init__(self, partition_config=None) -> None:
        specs = list(getattr(partition_config, "layer_specs", []) or [])
        self.use_defaults = getattr(partition_config, "use_default_specs", True)
        self.user: list[tuple[re.Pattern, Rule]] = []
        for i, spec in enumerate(specs):
            if spec.get("shape") is not None or spec.get("partition_dim") is not None:
                raise ValueError(f"tensor_parallel.partition_config.layer_specs[{i}]: shape "
                                 "and partition_dim (fused weights) are not supported; "
                                 "zerotrain splits c_attn and gate_up_proj by its own rules")
            for pattern in spec["patterns"]:
                self.user.append((re.compile(pattern), Rule(spec["partition_type"])))

    def rule_for(self, module_name: str) -> Optional[Rule]:
        """The rule for the linear layer ``module_name`` (None: kept whole)."""
        weight = f"{module_name}.weight"
        for pattern, rule in self.user:
            if pattern.search(weight):
                return None if rule.kind == "skip" else rule
        if not self.use_defaults:
            return None
        found = DEFAULT_RULES.get(module_name.rsplit(".", 1)[-1])
        return Rule(*found) if found else None
