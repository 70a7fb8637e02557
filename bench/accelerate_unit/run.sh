#!/usr/bin/env bash
# Accelerate's own DeepSpeed tests (its tests/deepspeed/), unmodified, against zerotrain
# (through the switch) or against a real DeepSpeed, on 2 CPU ranks. Harness-level
# adaptation only: sitecustomize.py installs the switch and lifts the GPU gates. See
# docs/from-deepspeed.md, "Accelerate's DeepSpeed tests".
#
#   bench/accelerate_unit/run.sh zerotrain PYTHON ACC_TESTS [pytest args...]
#   bench/accelerate_unit/run.sh deepspeed PYTHON ACC_TESTS [pytest args...]
#
# PYTHON: the interpreter (zerotrain: one where DeepSpeed is NOT importable; deepspeed: one
# with DeepSpeed installed), with accelerate, transformers and datasets; its bin/ goes first
# on PATH (the tests run `accelerate launch`). ACC_TESTS: the tests/deepspeed folder of an
# Accelerate checkout at the installed version, e.g.
#   git -C accelerate archive v1.15.0 tests/deepspeed | tar -x -C /tmp/acc
#   ACC_TESTS=/tmp/acc/tests/deepspeed
# The result lands in $OUT (default ./accelerate_unit_out): junit.xml and log.
set -uo pipefail
which=$1; python=$2; tests=$3; shift 3
case $python in /*) ;; */*) python=$PWD/$python ;; esac   # relative to the caller: we cd below
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${OUT:-$PWD/accelerate_unit_out}
mkdir -p "$out" && out=$(cd "$out" && pwd)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONDONTWRITEBYTECODE=1
export PATH=$(dirname "$python"):$PATH
case $which in
  zerotrain) export ZEROTRAIN_AS_DEEPSPEED=1
             export PYTHONPATH=$here:$root/src${PYTHONPATH:+:$PYTHONPATH} ;;
  deepspeed) unset ZEROTRAIN_AS_DEEPSPEED
             export PYTHONPATH=$here${PYTHONPATH:+:$PYTHONPATH} ;;
  *) echo "usage: $0 zerotrain|deepspeed PYTHON ACC_TESTS [pytest args]" >&2; exit 2 ;;
esac
cd "$tests"
"$python" -m pytest -p no:cacheprovider -o addopts="" -rA -q --junitxml="$out/junit.xml" \
  "$@" . > "$out/log" 2>&1
rc=$?
tail -n 1 "$out/log"
exit $rc
