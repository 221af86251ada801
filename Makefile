# Replicaplane developer commands. Everything runs from a local virtualenv (.venv) that the
# targets create on first use, so a fresh machine needs only python3.

PY_SYS ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
BIN    := $(VENV)/bin
PROTOS := $(shell find protos -name '*.proto' | sort)

.PHONY: setup gen check-gen lint test e2e up down bench clean

$(VENV)/.installed: requirements.txt requirements-dev.txt pyproject.toml
	$(PY_SYS) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

setup: $(VENV)/.installed  ## Create .venv with every dependency.

gen: setup  ## Regenerate gen/python from protos/.
	rm -rf gen/python && mkdir -p gen/python
	PATH="$(abspath $(BIN)):$$PATH" $(PY) -m grpc_tools.protoc -I protos --python_out=gen/python --grpc_python_out=gen/python \
	  --mypy_out=gen/python --mypy_grpc_out=gen/python $(PROTOS)
	find gen/python/replicaplane -type d -exec touch {}/__init__.py \;

check-gen: gen  ## Fail if the committed generated code differs from a fresh generation.
	git diff --exit-code -- gen/
	test -z "$$(git status --porcelain -- gen/)"

lint: setup  ## ruff and buf lint.
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/buf lint
	$(BIN)/buf format -d --exit-code

test: setup  ## Run every test (unit, service, end to end).
	$(PY) -m pytest

up: setup  ## Start the local stack (controller, provisioner, prober) with the example service.
	$(PY) -m services.stack up --example examples/hello/service.yaml

down: setup  ## Stop a local stack started in the background.
	$(PY) -m services.stack down

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
