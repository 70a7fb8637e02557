#!/usr/bin/env bash
# DeepSpeed's unit tests file by file through run.sh: one pytest per file, so a test that
# hangs (DeepSpeed's harness then stops the whole pytest run) costs that file only.
#
#   bench/deepspeed_unit/by_file.sh zerotrain|deepspeed PYTHON DS_TESTS OUT FILE...
#
# Each FILE (relative to DS_TESTS, e.g. unit/v1/zero/test_zero.py) leaves OUT/<file>.xml
# (JUnit), OUT/<file>.log and a line in OUT/summary; compare.py counts them.
# DS_UNIT_FILE_TIMEOUT (seconds, default 1800) bounds each file.
set -uo pipefail
which=$1; python=$2; tests=$3; out=$4; shift 4
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)   # the junit file is written from DS_TESTS (run.sh cds there)
for file in "$@"; do
  name=$(echo "$file" | tr '/' '_')
  start=$(date +%s)
  SUBSET=args timeout "${DS_UNIT_FILE_TIMEOUT:-1800}" "$here/run.sh" "$which" "$python" "$tests" \
      -rA -q --junitxml="$out/$name.xml" "$file" > "$out/$name.log" 2>&1
  echo "$file rc=$? $(( $(date +%s) - start ))s" >> "$out/summary"
done
