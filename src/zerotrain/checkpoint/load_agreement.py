"""The agreement step of a load (Note "stage, agree, commit" in ``staged_load.py``): one
small all-reduce after every rank staged what it read, so every rank raises or none does,
all agree whether there is a checkpoint, and all staged the same save."""
from __future__ import annotations

from typing import Optional

import torch

from .manifest import CheckpointError


def agree(comm, failure: Optional[BaseException], *, found: bool, what: str, where: str,
          identity: int = 0) -> None:
    """One all-reduce (min of: the first failing rank, found, -found, the save identity and
    its negation): every rank raises, or none does, all agree whether there is a checkpoint
    to load, and all staged the same save (Note "one tag for every rank" in ``load.py``)."""
    flags = torch.tensor([comm.rank if failure else comm.world_size, int(found), -int(found),
                          identity, -identity], dtype=torch.int64, device=comm.device)
    if comm.world_size > 1:
        comm.all_reduce(flags, op="min", label="checkpoint load: agreement")
    first, all_found, any_found = int(flags[0]), int(flags[1]), -int(flags[2])
    same = int(flags[3]) == -int(flags[4])
    if isinstance(failure, CheckpointError):
        raise failure
    if failure is not None:   # the same kind of error on every rank, so callers can react
        raise CheckpointError(f"cannot load {what} {where}: {type(failure).__name__}: "
                              f"{failure}") from failure
    if first < comm.world_size:
        raise CheckpointError(f"rank {first} could not read {what} {where} (its error is in "
                              "its log); nothing was loaded, the training state is unchanged")
    if not same:
        raise CheckpointError(f"ranks read different saves of {what} {where} (it was saved "
                              "again while they loaded it); nothing was loaded, the training "
                              "state is unchanged")
    if all_found != any_found:
        raise CheckpointError(f"ranks disagree on whether {where} holds a checkpoint (is the "
                              "directory on storage every rank sees?); nothing was loaded")
