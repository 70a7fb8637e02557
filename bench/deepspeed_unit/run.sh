#!/usr/bin/env bash
# DeepSpeed's own ZeRO unit tests, unmodified, against zerotrain (through the switch) or
# against a real DeepSpeed. Harness-level adaptation only: the switch is installed by
# sitecustomize.py, the world is 2 gloo ranks on the CPU (LOCAL_SIZE=2), no test body is
# edited (sitecustomize.py says what it changes). See docs/from-deepspeed.md, "DeepSpeed's own ZeRO unit tests".
#
#   bench/deepspeed_unit/run.sh zerotrain PYTHON DS_TESTS [pytest args...]
#   bench/deepspeed_unit/run.sh deepspeed PYTHON DS_TESTS [pytest args...]
#
# PYTHON: the interpreter (zerotrain: one where DeepSpeed is NOT importable; deepspeed: one
# with DeepSpeed installed). DS_TESTS: the tests/ folder of a DeepSpeed checkout, e.g.
#   git -C DeepSpeed archive v0.19.5 tests | tar -x -C /tmp/ds && DS_TESTS=/tmp/ds/tests
set -euo pipefail
which=$1; python=$2; tests=$3; shift 3
case $python in /*) ;; */*) python=$PWD/$python ;; esac   # relative to the caller: we cd below
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
export DS_ACCELERATOR=cpu LOCAL_SIZE=2 DS_UNITTEST_TIMEOUT=${DS_UNITTEST_TIMEOUT:-300}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONDONTWRITEBYTECODE=1
case $which in
  zerotrain) export ZEROTRAIN_AS_DEEPSPEED=1
             export PYTHONPATH=$here:$root/src${PYTHONPATH:+:$PYTHONPATH} ;;
  deepspeed) unset ZEROTRAIN_AS_DEEPSPEED
             export PYTHONPATH=$here${PYTHONPATH:+:$PYTHONPATH} ;;
  *) echo "usage: $0 zerotrain|deepspeed PYTHON DS_TESTS [pytest args]" >&2; exit 2 ;;
esac
# The subset, by SUBSET: quick (the default; 25 tests, about half an hour on 2 busy cores),
# core (181: v1/zero/test_zero.py, checkpoint/test_zero_optimizer.py, test_zero_context.py too) or full
# (every ZeRO runtime, v1 ZeRO and ZeRO checkpoint test; many hours on 2 cores) or args (only
# what the pytest args name, to run full in chunks).
quick=(unit/runtime/zero/test_zero_config.py unit/runtime/zero/test_ignore_unused_parameters.py
       unit/runtime/zero/test_zero_dynamic_class.py unit/runtime/zero/test_zero_context_return.py
       unit/runtime/zero/test_zero_grad_clip.py unit/runtime/zero/test_unwrap_model.py
       unit/v1/zero/test_zero_hook_count_regression.py)
case ${SUBSET:-quick} in
  quick) subset=("${quick[@]}") ;;
  core)  subset=("${quick[@]}" unit/v1/zero/test_zero.py unit/checkpoint/test_zero_optimizer.py
                 unit/runtime/zero/test_zero_context.py) ;;
  full)  subset=(unit/runtime/zero unit/v1/zero unit/checkpoint/test_zero_optimizer.py) ;;
  args)  subset=() ;;  # only the files or test ids given as pytest args (one chunk of full)
  *) echo "SUBSET must be quick, core, full or args" >&2; exit 2 ;;
esac
cd "$tests"
exec "$python" -m pytest -p no:cacheprovider -o addopts="" --continue-on-collection-errors \
  -m "not sequential and not nightly" "${subset[@]}" "$@"
