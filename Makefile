# kvrelay developer entry points. `make demo` and `make test` are the README's two commands: each creates
# .venv on first use and installs what it needs (CPU build of torch; packages from PyPI only).
VENV ?= .venv
PY := $(VENV)/bin/python
# lm-eval and aiperf, which the e2e tests run as a user would, with their own pins (tests/e2e/clients/).
CLIENTS_VENV ?= .venv-clients
export KVRELAY_CLIENTS_VENV := $(abspath $(CLIENTS_VENV))
# A plain `torch` requirement pulls a multi-GB CUDA build; pin the CPU build explicitly for CPU machines.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# Loopback only: Ray binds 127.0.0.1 with this set; UCX (NIXL) uses the loopback device.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER ?= 0
export UCX_NET_DEVICES ?= lo
export RAY_USAGE_STATS_ENABLED ?= 0
export PYTHONUNBUFFERED := 1

.PHONY: venv clients-venv test test-gpu demo wheel-check protos clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

venv: $(VENV)/.installed

# The H200 image's triton (3.6; the venv's is newer), beside the venv: tests/cpu/test_h200_triton.py compiles the
# decode kernels for sm_90 with it, so a kernel the device's compiler rejects fails here, not in a device call
# (2026-12-04: a str constexpr default that triton 3.9 takes and 3.6 does not cost one).
H200_TRITON ?= triton==3.6.0
export KVRELAY_H200_TRITON_DIR := $(abspath $(VENV)/h200-triton)
$(VENV)/h200-triton/.installed: $(VENV)/.installed
	$(PY) -m pip install -q --no-deps --target $(VENV)/h200-triton "$(H200_TRITON)"
	touch $@

$(CLIENTS_VENV)/.installed: tests/e2e/clients/requirements.txt
	test -x $(CLIENTS_VENV)/bin/python || python3 -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/python -m pip install -q --upgrade pip
	$(CLIENTS_VENV)/bin/python -m pip install -q -r tests/e2e/clients/requirements.txt
	touch $@

clients-venv: $(CLIENTS_VENV)/.installed

# PYTHONSAFEPATH=1: `python -m` (here and in the tests' child processes) does not put the checkout on sys.path,
# where its top-level kernels/ (the kvrelay.kernels sources) shadows Hugging Face's `kernels` package, which
# transformers >= 5.25 imports when installed (its dependency): every HF-reference test failed on 2026-12-03.
test: $(VENV)/.installed $(VENV)/h200-triton/.installed $(CLIENTS_VENV)/.installed
	PYTHONSAFEPATH=1 $(PY) -m pytest tests/cpu tests/e2e -m "not gpu" -q -p no:cacheprovider $(PYTEST_ARGS)

# On the H200 machine (see README "GPU tests").
test-gpu:
	PYTHONSAFEPATH=1 python3 -m pytest tests/gpu -m gpu -q -p no:cacheprovider $(PYTEST_ARGS)

demo: $(VENV)/.installed
	$(PY) -m kvrelay.cluster.demo configs/cpu-tiny.yaml

protos: $(VENV)/.installed
	$(PY) -c "from kvrelay.protos import generate; generate()"

clean:
	rm -rf build dist *.egg-info .pytest_cache
