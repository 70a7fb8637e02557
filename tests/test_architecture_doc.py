"""docs/architecture.md's module table names every module tests/test_layers.py places, in
the same row, so the map readers see cannot drift from the one the tests enforce."""
import re
from pathlib import Path

import test_layers as L

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def _doc_rows() -> dict[int, set[str]]:
    rows = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        match = re.match(r"\| (\d) \| (.*?) \|", line)
        if match:
            names = re.findall(r"`([A-Za-z_0-9]+)/?`", match.group(2))
            rows.setdefault(int(match.group(1)), set()).update(names)
    return rows


def test_every_placed_module_is_in_its_row_of_the_table():
    rows = _doc_rows()
    assert sorted(rows) == list(range(1, len(L.ROWS) + 1))
    for number, tiers in enumerate(L.ROWS, start=1):
        present = {name for tier in tiers for name in tier
                   if (L.SRC / f"{name}.py").exists() or (L.SRC / name).is_dir()}
        missing = present - rows[number]
        assert not missing, f"docs/architecture.md row {number} lacks {sorted(missing)}"
