"""Checkpoints other frameworks wrote, loaded into a running zerotrain job at any world size
and stage through the one load sequence (Note "stage, agree, commit" in
``checkpoint/staged_load.py``).

A DeepSpeed ZeRO tag (:class:`DeepSpeedCheckpoint`: every file opened through the
restricted unpickler, memory-mapped), a DeepSpeed Universal folder
(:class:`UniversalCheckpoint`) and a torch DCP folder (``dcp.DcpCheckpoint``) all read
the same way: parameters by name, element ranges of the fp32 masters and of Adam's moments
(``layout.py``, Note: DeepSpeed's partitions), frozen parameters and buffers whole, and the
small state as pickled values. :class:`ForeignSource` turns any of them into the
sequence's ``LoadSource``.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ...core.records import FROZEN
from ..manifest import MALFORMED, CheckpointError
from ..match import check_model, json_group_values
from ..staged_load import LoadOptions, load_staged
from ..state import CheckpointReport, LoadResult, TrainingState
from .source_checks import malformed


def load_foreign(state: TrainingState, path: str, open_checkpoint: Callable[[str], Any], *,
                 what: str, options: LoadOptions) -> LoadResult:
    """Load ``path``, opened with ``open_checkpoint(path)`` (``DeepSpeedCheckpoint``,
    ``UniversalCheckpoint`` or a DCP reader), into ``state``. Collective; a load that raises
    leaves every tensor, hyperparameter and counter as it was."""
    def open_source(where: str) -> ForeignSource:
        try:
            return ForeignSource(open_checkpoint(where), what)
        except CheckpointError:
            raise
        except MALFORMED as exc:
            raise malformed(where, exc) from None
    return load_staged(state, lambda: path, open_source, what=what, where=path,
                       options=options)


class ForeignSource:
    """A checkpoint another framework wrote, as a ``LoadSource``. ``ckpt`` has
    :class:`DeepSpeedCheckpoint`'s reading methods (``read_into``, ``state_keys``,
    ``module_tensor``, the name lists and the small state)."""

    def __init__(self, ckpt: Any, what: str) -> None:
        self.ckpt, self.what = ckpt, what
        self.path = ckpt.path
        self.state_where = ckpt.model_file
        self.elements_read = 0

    @property
    def groups_where(self) -> str:
        return self.ckpt.optim_files[0]

    def validate(self, module: torch.nn.Module, records: list,
                 param_groups: Optional[list]) -> None:
        ckpt = self.ckpt
        saved = ({n: ckpt.full_shape(n) for n in ckpt.trainable_names() + ckpt.frozen_names()},
                 {n: ckpt.full_shape(n) for n in ckpt.buffer_names()})
        check_model(saved, module, records, f"{self.what} {self.path}",
                    aliases=ckpt.shared_params())
        if param_groups is not None:
            self._check_optimizer(param_groups, records)

    def _check_optimizer(self, param_groups: list, records: list) -> None:
        ckpt = self.ckpt
        if not ckpt.has_optimizer:
            raise CheckpointError(f"{ckpt.path} has no zero_pp_rank_*_optim_states.pt files; "
                                  "load with load_optimizer_states=False to take the weights "
                                  "only")
        groups = ckpt.param_groups()
        if groups and len(groups) != len(param_groups):
            raise CheckpointError(f"{self.what} {ckpt.path} has {len(groups)} optimizer "
                                  f"parameter groups, this optimizer has "
                                  f"{len(param_groups)}; load with "
                                  "load_optimizer_states=False to take only the weights")
        for record in records:
            for name in record.names:
                source = ckpt.params.get(name)
                if record.group_index != FROZEN and source is not None \
                        and groups and source.group != record.group_index:
                    raise CheckpointError(f"parameter {name!r} is in optimizer group "
                                          f"{source.group} of {ckpt.path} but in group "
                                          f"{record.group_index} here")

    def read_range(self, name: str, key: str, start: int, end: int,
                   out: torch.Tensor) -> None:
        self.ckpt.read_into(name, key, start, end, out)
        self.elements_read += end - start

    def read_same_shard(self, names, layout, key: str, rank: int, out: torch.Tensor) -> bool:
        return False   # DeepSpeed's partitions never have zerotrain's layout

    def optimizer_state_spec(self, names) -> tuple[list, dict]:
        """Adam's moments and ``step`` (a float32 tensor, as torch keeps it)."""
        found = [self.ckpt.state_keys(n) for n in names if n in self.ckpt.params]
        if not found:
            return [], {}
        for other in found[1:]:
            if other != found[0]:
                raise CheckpointError(f"parameters {list(names)} come from DeepSpeed "
                                      f"optimizer states that differ ({found[0]} vs {other}); "
                                      "cannot merge them into one shard")
        keys, step = found[0]
        return list(keys), ({"step": (step, torch.float32)} if step is not None and keys
                            else {})

    def saved_module_tensor(self, name: str) -> Optional[torch.Tensor]:
        if name in self.ckpt.params:   # trainable when saved: read_range reads its master
            return None
        value = self.ckpt.module_tensor(name)
        self.elements_read += value.numel()
        return value

    def left_out(self) -> frozenset:
        return frozenset()   # a parameter missing from these formats is an error

    def rng_state(self, comm) -> None:
        return None   # DeepSpeed's generator state is not zerotrain's

    def client_state(self) -> Any:
        return self.ckpt.client_state()

    def saved_param_groups(self, live_groups: list) -> list:
        """Each group's saved hyperparameters that the live group has, in the JSON form
        the zerotrain format's check takes (``match.json_group_values``)."""
        return [{k: v for k, v in g.items() if k in live}
                for g, live in zip(json_group_values(self.ckpt.hyperparameters()),
                                   live_groups)]

    def loss_scaler_state(self) -> Any:
        return self.ckpt.loss_scaler_state()

    def lr_scheduler_state(self) -> Any:
        return self.ckpt.lr_scheduler_state()

    def data_loader_state(self) -> None:
        return None

    def counters(self) -> dict:
        return self.ckpt.counters()

    def identity(self) -> int:
        return self.ckpt.identity()

    def report(self) -> CheckpointReport:
        return CheckpointReport(path=self.path, elements_read=self.elements_read,
                                bytes_read=4 * self.elements_read,
                                files_opened=len(self.ckpt.optim_files) + 1)

    def malformed(self, exc: Exception) -> Exception:
        return malformed(self.path, exc)

    def close(self) -> None:
        pass
