# Two entry points: `make demo` and `make test`. Both create .venv when it is missing.
# `make test-fast` skips the tests marked slow (the inner loop); `make lint` runs ruff with
# the short rule set in pyproject.toml ([tool.ruff.lint]); `make typecheck` runs mypy on
# core/, comm/, stages/ and engine/, installing the pinned mypy when missing (.ci/run runs
# all three).
# `make gpu-check` is the first command on a GPU machine (bench/README.md); `make gpu-wheels`
# fetches, here, the wheels it installs there (needs PyPI; not part of `make test`).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU build of torch for development and CI (a plain `torch` pulls a multi-GB CUDA build).
TORCH_PIN := torch==2.13.0
MYPY_PIN := mypy==2.4.1

.PHONY: demo test test-fast lint typecheck install clean gpu-check gpu-wheels

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -c constraints-dev.txt -e ".[dev,demo]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m zerotrain.cli demo

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

# tests/dist is named on its own: ruff's default excludes skip every folder called "dist".
lint: install
	$(PY) -m ruff check src tests tests/dist bench examples

# torch's own annotations are read; packages without them (safetensors...) count as Any.
typecheck: install
	$(PY) -m mypy --version >/dev/null 2>&1 || $(PY) -m pip install -q "$(MYPY_PIN)"
	$(PY) -m mypy --ignore-missing-imports --follow-imports=silent src/zerotrain/core \
		src/zerotrain/comm src/zerotrain/stages src/zerotrain/engine

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .mypy_cache

# The GPU machine has torch but no network and no pydantic: it runs whichever python holds
# torch there, from src/ (nothing built); here the project's venv when it exists.
CHECK_PY = $(if $(wildcard $(PY)),$(PY),$(PYTHON))
# pydantic and what it needs, at the versions this machine's tests run with (safetensors is
# on the GPU machine already), for python 3.12 on manylinux x86_64, into the ignored .whl/
GPU_WHEELS := pydantic pydantic-core annotated-types typing-inspection typing-extensions
WHEEL_PLATFORMS := manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_28_x86_64

gpu-check:
	$(CHECK_PY) bench/gpu_check.py

gpu-wheels: install
	rm -rf .whl && mkdir -p .whl
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp $(addprefix --platform ,$(WHEEL_PLATFORMS)) -d .whl \
		$$($(PY) -c 'import importlib.metadata as m, sys; \
		print(" ".join(n + "==" + m.version(n) for n in sys.argv[1:]))' $(GPU_WHEELS))
	# the set is complete for python 3.12 there: pip resolves it from these files alone
	$(PY) -m pip install -q --dry-run --no-index --only-binary=:all: --python-version 3.12 \
		--implementation cp $(addprefix --platform ,$(WHEEL_PLATFORMS)) \
		--target .whl/.dry-run .whl/*.whl
	ls .whl
