#!/usr/bin/env bash
# Version matrix for the Hugging Face paths (Trainer --deepspeed, Accelerate's DeepSpeed plugin,
# the switch): runs their tests in one fresh venv per version and writes a markdown table.
#
#   bash bench/compat_matrix.sh                 # the default matrix (below), one venv at a time
#   TRANSFORMERS_VERSIONS="5.24.0" TORCH_VERSIONS="" bash bench/compat_matrix.sh   # one row
#
# Rows: each of the last three transformers releases (the newest patch of the three newest
# minor versions on the package index) with torch $BASE_TORCH, then each torch in
# $TORCH_VERSIONS (CPU wheels, asked for as torch==V+cpu) with the newest of those
# transformers. Accelerate is left to pip (the newest that installs beside them); the table
# records the version it got. A version pip cannot install is a row that says so.
# Not part of CI: heavy (about ten minutes of tests per row on two cores, plus the installs).
#
# Environment:
#   TRANSFORMERS_VERSIONS  space-separated; default: the last three releases (asks pip)
#   TORCH_VERSIONS         space-separated; default "2.10.0 2.11.0 2.12.0 2.13.0"
#   BASE_TORCH             torch for the transformers rows; default 2.13.0
#   COMPAT_TESTS           pytest paths; default: the list below
#   COMPAT_WORK            where the venvs and logs go; default /tmp/zerotrain-compat
#   COMPAT_OUT             the table; default docs/compat_matrix.md
#   COMPAT_TIMEOUT         seconds for one row's pytest; default 1800
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
WORK=${COMPAT_WORK:-/tmp/zerotrain-compat}
OUT=${COMPAT_OUT:-$ROOT/docs/compat_matrix.md}
BASE_TORCH=${BASE_TORCH:-2.13.0}
TORCH_VERSIONS=${TORCH_VERSIONS-"2.10.0 2.11.0 2.12.0 2.13.0"}
TIMEOUT=${COMPAT_TIMEOUT:-1800}
# The tests that drive zerotrain through transformers and Accelerate: the names they read
# (test_hf_names), the switch and its metadata (test_as_deepspeed), transformers' zero.Init
# path (test_zero_init_hf), the Trainer options (test_trainer, test_trainer_options) and the
# whole-script runs: a Trainer script with --deepspeed at stages 2/3 and Accelerate's plugin,
# each against the plain 2-rank run (test_hf_switch).
COMPAT_TESTS=${COMPAT_TESTS:-"tests/unit/test_hf_names.py tests/test_as_deepspeed.py \
tests/dist/test_zero_init_hf.py tests/dist/test_trainer.py tests/dist/test_trainer_options.py \
tests/test_hf_switch.py"}
mkdir -p "$WORK"

last_three() {  # newest patch of the three newest minor releases of transformers
  "$PY" -m pip index versions transformers 2>/dev/null | "$PY" -c '
import re, sys
text = sys.stdin.read()
found = re.search(r"Available versions: (.*)", text)
seen = {}
for v in (found.group(1).split(", ") if found else []):
    if re.fullmatch(r"\d+\.\d+\.\d+", v):
        seen.setdefault(tuple(v.split(".")[:2]), v)   # the list is newest first
print(" ".join(list(seen.values())[:3]))'
}

TRANSFORMERS_VERSIONS=${TRANSFORMERS_VERSIONS:-$(last_three)}
if [ -z "$TRANSFORMERS_VERSIONS" ]; then
  echo "compat_matrix: could not list transformers releases (set TRANSFORMERS_VERSIONS)" >&2
  exit 2
fi
NEWEST_TF=${TRANSFORMERS_VERSIONS%% *}

ROWS=()
for tf in $TRANSFORMERS_VERSIONS; do ROWS+=("$BASE_TORCH $tf"); done
for t in $TORCH_VERSIONS; do
  [ "$t" = "$BASE_TORCH" ] || ROWS+=("$t $NEWEST_TF")
done

TABLE="$WORK/table.md"
{
  echo "| torch | transformers | accelerate | passed | failed | skipped | errors | wall | note |"
  echo "|---|---|---|---|---|---|---|---|---|"
} > "$TABLE"

for row in "${ROWS[@]}"; do
  set -- $row
  torch_v=$1 tf_v=$2
  name="torch${torch_v}-tf${tf_v}"
  venv="$WORK/$name"
  log="$WORK/$name.log"
  echo "== $name" >&2
  rm -rf "$venv"
  note=""
  if ! "$PY" -m venv "$venv" > "$log" 2>&1; then
    note="venv failed"
  elif ! "$venv/bin/pip" install -q "torch==${torch_v}+cpu" >> "$log" 2>&1; then
    note="no CPU wheel torch==${torch_v}+cpu on the reachable indexes"
  elif ! "$venv/bin/pip" install -q "transformers==$tf_v" accelerate pydantic safetensors \
        pytest hypothesis numpy >> "$log" 2>&1; then
    note="transformers==$tf_v did not install"
  fi
  if [ -n "$note" ]; then
    echo "| $torch_v | $tf_v | - | - | - | - | - | - | $note (log: $log) |" >> "$TABLE"
    rm -rf "$venv"
    continue
  fi
  acc_v=$("$venv/bin/python" -c "import accelerate; print(accelerate.__version__)" 2>/dev/null)
  start=$(date +%s)
  (cd "$ROOT" && PYTHONPATH="$ROOT/src" timeout "$TIMEOUT" "$venv/bin/python" -m pytest -q \
     -p no:cacheprovider --junitxml="$WORK/$name.xml" $COMPAT_TESTS) >> "$log" 2>&1
  rc=$?
  wall=$(( $(date +%s) - start ))
  counts=$("$PY" - "$WORK/$name.xml" <<'EOF'
import sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    print("- - - -"); sys.exit()
suites = [root] if root.tag == "testsuite" else list(root)
t = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
print(t["tests"] - t["failures"] - t["errors"] - t["skipped"], t["failures"], t["skipped"], t["errors"])
EOF
)
  set -- $counts
  note=""
  [ $rc -eq 124 ] && note="timed out after ${TIMEOUT}s"
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ "$2" = "0" ] && [ "$4" = "0" ] && note="pytest exit $rc"
  fails=$(grep -E "^(FAILED|ERROR) " "$log" | sed -E 's/^(FAILED|ERROR) ([^ ]+).*/\2/' | tr '\n' ' ')
  [ -n "$fails" ] && note="${note:+$note; }$fails"
  echo "| $torch_v | $tf_v | $acc_v | $1 | $2 | $3 | $4 | $((wall / 60))m$((wall % 60))s | $note |" >> "$TABLE"
  rm -rf "$venv"   # a venv is ~1 GB; the log and junit file stay
done

{
  echo "# Version matrix: Trainer, Accelerate and the switch"
  echo
  echo "Written by \`bash bench/compat_matrix.sh\` on $(date -u +%Y-%m-%d) ($(uname -m), $(nproc) cores,"
  echo "Python $("$PY" -c 'import platform; print(platform.python_version())')): one fresh venv per row, the tests below"
  echo "run with \`PYTHONPATH=src\` and no DeepSpeed installed."
  echo
  echo "Tests: $(echo $COMPAT_TESTS | sed 's/ /, /g')."
  echo
  cat "$TABLE"
} > "$OUT"
echo "wrote $OUT" >&2
cat "$OUT"
