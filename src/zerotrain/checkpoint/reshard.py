"""Resharding from files alone: which byte ranges of which source files a target shard needs.

Note: element ranges
    Under a ``FlatLayout`` of world ``W`` a parameter of ``numel`` elements has chunk
    ``c = ceil(numel / W)``; shard rank ``r`` holds its elements ``[r*c, min((r+1)*c,
    numel))`` at offset ``layout.shard_slice(slot).start`` of its flat shard (zero padding
    after). So a target rank needs, per parameter, one element range of the *full* flat
    parameter, and that range is spread over consecutive source chunks: for source chunk
    ``r`` (source chunk size ``c'``) the overlap ``[lo, hi)`` sits at ``[start' + lo - r*c',
    start' + hi - r*c')`` of source rank ``r``'s shard. Everything is keyed by parameter
    name and this arithmetic, never by the position of a record, so a checkpoint of any
    world size and stage loads into any other (stage 3's many records per group included).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from ..core.flat import FlatLayout, ParamSlot
from .manifest import CheckpointError
from .stfile import DTYPES_BY_NAME, Reader


@dataclass(frozen=True, slots=True)
class SourceParam:
    """Where a parameter sits in the checkpoint: its record, that record's layout, its slot."""

    record: dict
    layout: FlatLayout
    slot: ParamSlot


def target_range(layout: FlatLayout, slot: ParamSlot, rank: int) -> tuple[int, int]:
    """Elements ``[a, b)`` of the full parameter that shard rank ``rank`` holds."""
    start = min(rank * slot.chunk, slot.numel)
    return start, min(start + slot.chunk, slot.numel)


def source_pieces(layout: FlatLayout, slot: ParamSlot, start: int,
                  end: int) -> Iterator[tuple[int, int, int, int]]:
    """``(source rank, shard begin, shard end, offset in [start, end))`` covering elements
    ``[start, end)`` of the full parameter (Note: element ranges)."""
    if end <= start:
        return
    chunk, base = slot.chunk, layout.shard_slice(slot).start
    for rank in range(start // chunk, (end - 1) // chunk + 1):
        lo, hi = max(start, rank * chunk), min(end, (rank + 1) * chunk)
        yield rank, base + lo - rank * chunk, base + hi - rank * chunk, lo - start


def layout_of(record: dict) -> FlatLayout:
    desc = record["layout"]
    layout = FlatLayout(desc["numels"], world=desc["world"], bucket_numel=desc["bucket_numel"])
    if layout.shard_numel != record["shard_numel"]:
        raise CheckpointError(f"record {record['key']!r}: the layout gives shards of "
                              f"{layout.shard_numel} elements, the manifest says "
                              f"{record['shard_numel']}")
    return layout


class SourceIndex:
    """The checkpoint's parameters by name, and reads of element ranges of them."""

    def __init__(self, manifest: dict) -> None:
        self.params: dict[str, SourceParam] = {}
        for record in manifest["records"]:
            layout = layout_of(record)
            for name, slot in zip(record["names"], layout.slots):
                self.params[name] = SourceParam(record, layout, slot)
        self.module_entries = {e["name"]: e for e in manifest["frozen"] + manifest["buffers"]}
        self.module_file = manifest["module_file"]
        self._checked: set[tuple[str, str]] = set()

    def read_into(self, reader: Reader, name: str, key: str, start: int, end: int,
                  out: torch.Tensor) -> None:
        """Copy elements ``[start, end)`` of parameter ``name``'s ``key`` (``master`` or an
        optimizer state such as ``exp_avg``) into the 1-D ``out``."""
        source = self.params.get(name)
        if source is None:
            self._read_module_entry(reader, name, key, start, end, out)
            return
        record = source.record
        if key != "master" and key not in record["state_tensors"]:
            raise CheckpointError(f"the checkpoint holds no optimizer state {key!r} for "
                                  f"parameter {name!r}")
        for rank, lo, hi, at in source_pieces(source.layout, source.slot, start, end):
            filename = record["files"][rank]
            tensor_key = f"{record['key']}/{key}"
            if (filename, tensor_key) not in self._checked:
                reader.check(filename, tensor_key, torch.float32, (record["shard_numel"],))
                self._checked.add((filename, tensor_key))
            out[at: at + hi - lo].copy_(reader.read_range(filename, tensor_key, lo, hi))

    def read_record_shard(self, reader: Reader, record: dict, key: str, rank: int,
                          out: torch.Tensor) -> None:
        """A whole source shard in one read (when source and target layouts are equal)."""
        filename, tensor_key = record["files"][rank], f"{record['key']}/{key}"
        reader.check(filename, tensor_key, torch.float32, (record["shard_numel"],))
        out.copy_(reader.read_range(filename, tensor_key, 0, record["shard_numel"]))

    def same_record(self, names: list[str], layout: FlatLayout) -> Optional[dict]:
        """The source record with exactly these names and this layout, if there is one."""
        first = self.params.get(names[0]) if names else None
        if first is None or first.record["names"] != names:
            return None
        return first.record if first.layout.describe() == layout.describe() else None

    def read_module(self, reader: Reader, name: str) -> torch.Tensor:
        """A frozen parameter or buffer, whole, in its saved dtype."""
        entry = self.module_entries[name]
        dtype = DTYPES_BY_NAME.get(entry["dtype"])
        if dtype is None:
            raise CheckpointError(f"{name!r} has unsupported dtype {entry['dtype']!r}")
        reader.check(self.module_file, entry["key"], dtype, tuple(entry["shape"]))
        return reader.read(self.module_file, entry["key"])

    def _read_module_entry(self, reader: Reader, name: str, key: str, start: int, end: int,
                           out: torch.Tensor) -> None:
        if name not in self.module_entries:
            raise CheckpointError(f"parameter {name!r} is not in the checkpoint")
        if key != "master":
            raise CheckpointError(f"parameter {name!r} was frozen when the checkpoint was "
                                  f"saved, so it has no optimizer state {key!r}; load with "
                                  "load_optimizer_states=False")
        full = self.read_module(reader, name).reshape(-1)
        out.copy_(full[start:end])
