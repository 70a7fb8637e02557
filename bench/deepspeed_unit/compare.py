"""Count and compare two ``by_file.sh`` runs (zerotrain through the switch, DeepSpeed).

    python bench/deepspeed_unit/compare.py ZEROTRAIN_OUT[,MORE] DEEPSPEED_OUT[,MORE] [--list]

Only files finished on both sides (their ``summary`` lines) are counted. Prints each side's
passed / failed / error / skipped, the pairs of outcomes per test, and with ``--list`` every
test DeepSpeed passes and zerotrain does not, with zerotrain's message.
"""
from __future__ import annotations

import collections
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

OUTCOME = {"failure": "failed", "error": "error", "skipped": "skipped"}


def _outcomes(dirs: str) -> tuple[dict[str, tuple[str, str]], set[str]]:
    """{test id: (outcome, message)} and the finished files, over comma-separated dirs."""
    tests: dict[str, tuple[str, str]] = {}
    files: set[str] = set()
    for d in dirs.split(","):
        summary = Path(d) / "summary"
        if summary.exists():
            files |= {line.split()[0] for line in summary.read_text().splitlines() if line}
        for xml in Path(d).glob("*.xml"):
            for case in ET.parse(xml).getroot().iter("testcase"):
                outcome, message = "passed", ""
                for child in case:
                    if child.tag in OUTCOME:
                        outcome, message = OUTCOME[child.tag], child.get("message") or ""
                        break
                tests[f"{case.get('classname')}::{case.get('name')}"] = (outcome, message)
    return tests, files


def _in(test: str, files: set[str]) -> bool:
    cls = test.split("::")[0]
    return any(cls == f[:-3].replace("/", ".") or cls.startswith(f[:-3].replace("/", ".") + ".")
               for f in files)


def main(argv: list[str]) -> None:
    zt, zt_files = _outcomes(argv[1])
    ds, ds_files = _outcomes(argv[2])
    files = zt_files & ds_files
    print(f"files finished on both sides: {len(files)}")
    for label, res in (("zerotrain", zt), ("deepspeed", ds)):
        counts = collections.Counter(v[0] for k, v in res.items() if _in(k, files))
        print(f"{label}: {sum(counts.values())} tests, {dict(sorted(counts.items()))}")
    ids = sorted(k for k in set(zt) | set(ds) if _in(k, files))
    pairs = collections.Counter((zt.get(k, ("absent",))[0], ds.get(k, ("absent",))[0])
                                for k in ids)
    for (a, b), n in sorted(pairs.items(), key=lambda item: -item[1]):
        print(f"  zerotrain {a:8} deepspeed {b:8} {n}")
    if "--list" in argv:
        for k in ids:
            a, b = zt.get(k, ("absent", "")), ds.get(k, ("absent", ""))
            if b[0] == "passed" and a[0] != "passed":
                print(f"{a[0]:8} {k} | {a[1][:160]}")


if __name__ == "__main__":
    main(sys.argv)
