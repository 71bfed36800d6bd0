# Two commands on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.portcullis-installed

.PHONY: setup test soak serve lint clean

setup: $(STAMP)

# Re-run the install only when the project's metadata changed; otherwise set-up is instant.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	@touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The long reliability run: 10,000 mixed requests through `portcullis serve` (about 15 min on
# two cores); `make test` runs the same test with 300. PORTCULLIS_SOAK_REQUESTS=N for another size.
soak: $(STAMP)
	PORTCULLIS_SOAK=1 $(BIN)/python -m pytest -q --timeout 7200 tests/reliability/test_soak.py $(PYTEST_ARGS)

serve: $(STAMP)
	$(BIN)/portcullis serve $(SERVE_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check gateway engine kernels tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
