"""DeepSpeed's ``parallel_state_sp``: the sequence-parallel groups as a Megatron-style mpu.

Ulysses sequence parallelism is configured through a module, not an object: DeepSpeed's
``UlyssesSPAttentionHF.register_with_transformers`` calls
``initialize_sequence_parallel(S)`` here and returns this module as the ``mpu`` that
``initialize(..., mpu=...)`` takes, and ``deepspeed.utils.groups`` reads it after that. So
this module holds the one process-wide :class:`SequenceMesh` (Note "the sequence mesh" in
``sequence.py``); :func:`release` drops it (a new world needs new groups).

The getters return ``torch.distributed`` process groups, as DeepSpeed's do;
:func:`sequence_mesh` gives zerotrain's code the :class:`Communicator` objects.
"""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from .communicator import Communicator
from .sequence import SequenceMesh, build_sequence_mesh

_MESH: Optional[SequenceMesh] = None
_WORLD = None   # the default group the mesh was built in


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Build the sequence-parallel and sequence-data-parallel groups (collective over the
    default group: every rank calls it with the same size). Raises, as DeepSpeed does, when
    the size is 1 or less, larger than the world or does not divide it, or when the groups
    exist already (with another size: :func:`release` first)."""
    if not dist.is_initialized():
        raise RuntimeError("initialize_sequence_parallel needs the process group: call "
                           "deepspeed.init_distributed() (zerotrain.init_distributed) first")
    world_size = dist.get_world_size()
    if world_size < sequence_parallel_size:
        raise RuntimeError(f"world_size ({world_size}) is less than sequence_parallel_size "
                           f"{sequence_parallel_size}")
    if sequence_parallel_size <= 1:
        raise ValueError(f"sequence_parallel_size must be greater than 1, got "
                         f"{sequence_parallel_size}")
    if _MESH is not None and _WORLD is dist.group.WORLD:
        if _MESH.sp_size == sequence_parallel_size:
            return   # the same groups again (the Trainer registers once per prepare)
        raise RuntimeError(f"sequence parallel groups of size {_MESH.sp_size} exist already; "
                           f"cannot make them of size {sequence_parallel_size}")
    try:
        mesh = build_sequence_mesh(Communicator(), sequence_parallel_size)
    except ValueError as exc:
        raise RuntimeError(str(exc)) from None
    adopt(mesh)


def sequence_mesh() -> SequenceMesh:
    """The mesh built by :func:`initialize_sequence_parallel` (AssertionError before, or
    after the world it was built in was destroyed, as DeepSpeed's getters assert)."""
    assert _MESH is not None and _WORLD is dist.group.WORLD, \
        "sequence parallel group is not initialized"
    return _MESH


def current() -> Optional[SequenceMesh]:
    """The mesh of this world, or None."""
    return _MESH if _MESH is not None and _WORLD is dist.group.WORLD else None


def adopt(mesh: SequenceMesh) -> None:
    """Make ``mesh`` the process-wide one, belonging to the current default group."""
    global _MESH, _WORLD
    _MESH, _WORLD = mesh, dist.group.WORLD


def release() -> None:
    """Forget the groups (after the world they belong to was destroyed)."""
    global _MESH, _WORLD
    _MESH = _WORLD = None


def get_sequence_parallel_group():
    """The process group of this rank's sequence-parallel group."""
    return sequence_mesh().sp.group


def get_sequence_data_parallel_group():
    """The process group of every rank (ZeRO's group under sequence parallelism)."""
    return sequence_mesh().world.group or dist.group.WORLD


def get_sequence_parallel_world_size() -> int:
    return sequence_mesh().sp_size


def get_sequence_data_parallel_world_size() -> int:
    return sequence_mesh().world.world_size


def get_sequence_parallel_rank() -> int:
    return sequence_mesh().sp_rank


def get_sequence_data_parallel_rank() -> int:
    return sequence_mesh().world.rank


get_model_parallel_rank = get_sequence_parallel_rank
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_group = get_sequence_parallel_group
