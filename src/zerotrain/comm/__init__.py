"""Communication: the only package that calls torch.distributed collectives.

The rule: torch.distributed collectives are called only inside ``zerotrain.comm``
(``tests/test_layers.py`` enforces it). Every collective zerotrain runs goes through a
:class:`Communicator`, which records it in a :class:`CommLedger`. The ledger counts what each
call puts on the wire by the usual rule: ``all_reduce`` counts twice its tensor,
``reduce_scatter`` its input, ``all_gather`` its output, ``broadcast`` and ``all_to_all``
their input. Tests read the ledger to check the ZeRO volumes (2Ψ for stages 0-2) instead of
trusting the design.

One module per job, lowest first:

* ``setup``: the default process group (``init_distributed``), which backend serves which
  device, the training device, group timeouts (Note: the training device);
* ``ledger``: :class:`CommLedger` (Note: intra-node and cross-node bytes);
* ``failures``: what a collective was, turned into a ``CollectiveError`` naming it only
  when it fails (Note: named failures);
* ``coalesced``: several all-gathers launched together, one launch on a device and one by
  one on the host (Note: coalesced gathers);
* ``communicator``: :class:`Communicator`, the one place zerotrain's own collectives are
  launched (Note: collective devices);
* ``deepspeed_api``: DeepSpeed's ``deepspeed.comm`` functions (``get_rank``,
  ``all_reduce``...) for scripts that call them directly;
* ``agreement``: the vote by which ranks agree on where they are before a backward that
  reduces, or an update (Note: position votes).

Every name is importable from ``zerotrain.comm`` itself, as ``deepspeed.comm`` is.
"""
from __future__ import annotations

# torch, dist and teardown stay importable from here, as from the single module this was.
import torch
import torch.distributed as dist

from . import teardown
from ..errors import CollectiveError  # defined there; importable from here too
from .topology import Partition, Topology, group_of, local_node_entry
from .coalesced import _all_gather, _coalescing_manager, _drop_coalescing_state, _Launches
from .communicator import (_SUBGROUPS, Communicator, _describe, _DescribedWork, _reduce_op,
                           _reduce_scatter)
from .deepspeed_api import (ReduceOp, _require_group, all_gather, all_gather_coalesced,
                            all_gather_into_tensor, all_gather_object, all_reduce,
                            all_reduce_coalesced, all_to_all, all_to_all_single, allgather_fn,
                            barrier, broadcast, broadcast_object_list, destroy_process_group,
                            gather, get_all_ranks_from_group, get_backend, get_global_rank,
                            get_local_rank, get_rank, get_world_group, get_world_size,
                            has_all_gather_into_tensor, has_all_reduce_coalesced,
                            has_coalescing_manager, has_reduce_scatter_tensor,
                            inference_all_reduce, irecv, is_available, is_initialized, isend,
                            monitored_barrier, new_group, recv, reduce, reduce_scatter,
                            reduce_scatter_fn, reduce_scatter_tensor, scatter, send)
from .ledger import REACHES, CommLedger
from .setup import (DEFAULT_TIMEOUT, _backend_map, _elastic_store, group_backends,
                    group_timeout, init_distributed, select_device, set_group_timeout)
