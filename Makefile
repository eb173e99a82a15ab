# loopwarden: every set-up step lives here, so a fresh machine needs only `make run` / `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: install deploy-tools kafka-jars test-setup test test-deploy run bench chaos lint clean

# The integrations' extras are installed too, so their tests run against the real libraries
# (claude-agent-sdk's wheel bundles its CLI: about 380 MB). The native replay engine (native/, Rust via
# maturin and the machine's cargo) is built into the venv as well: about a minute the first time.
NATIVE_SOURCES := native/Cargo.toml native/Cargo.lock native/pyproject.toml $(wildcard native/src/*.rs)
$(STAMP): pyproject.toml $(NATIVE_SOURCES)
	@echo "==> installing loopwarden and its test tools into $(VENV)"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/pip install --quiet --disable-pip-version-check --upgrade pip
	@$(BIN)/pip install --quiet --disable-pip-version-check -e '.[worker,dev,otel,langchain,openai-agents,mcp,claude-agent-sdk]'
	@echo "==> building the native replay engine (native/)"
	@$(BIN)/pip install --quiet --disable-pip-version-check ./native
	@rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

## make deploy-tools: helm, compose-check, promtool/prometheus/alertmanager/amtool for the deploy tests
## (built or installed once, cached in .cache/tools; see scripts/install-deploy-tools).
deploy-tools:
	@scripts/install-deploy-tools

## Set-up that test runs need: the venv and the Kafka jars, side by side with the deploy tools (on a
## fresh machine compiling helm takes minutes; the venv and the jars are mostly downloads meanwhile).
test-setup:
	@$(MAKE) --no-print-directory -j2 kafka-jars deploy-tools

kafka-jars: install
	@$(BIN)/python -m scripts.kafka_local resolve

## make test: install, fetch the Kafka jars and the deploy tools, start a local broker (unless
## KAFKA_BOOTSTRAP_SERVERS is set), run every test (the native engine's Rust unit tests first), with one
## short trial of each chaos scenario (make chaos runs the full suite).
test: test-setup lint
	@cargo test --quiet --release --manifest-path native/Cargo.toml
	@$(BIN)/python -m pytest -n 2 --dist loadfile

## make test-deploy: only the deploy tier (compose, Helm chart, alert rules, Prometheus against a worker).
test-deploy: test-setup
	@$(BIN)/python -m pytest -m deploy

## make run: a local Kafka (unless KAFKA_BOOTSTRAP_SERVERS is set), a worker and a simulated fleet of
## agents guarded through the SDK; ends with what was halted. Ctrl-C stops everything.
run: install
	@$(BIN)/python -m scripts.kafka_local exec -- $(BIN)/loopwarden demo

## make bench: the core benchmark, then the Kafka benchmarks (a local broker unless KAFKA_BOOTSTRAP_SERVERS
## is set, real workers); rewrites BENCHMARKS.md and bench/results/ (never part of make test; ~15 min).
bench: install
	@$(BIN)/python -c "import matplotlib" 2>/dev/null || $(BIN)/pip install --quiet --disable-pip-version-check -e '.[worker,dev,bench]'
	@$(BIN)/python -m bench

## make chaos: the full fault-injection suite (20 worker crashes, rebalances, broker restarts, slow
## workers, a bad-input flood, a 30-minute soak) on a real broker; regenerates RELIABILITY.md (also when
## a trial fails).
## The soak's million distinct runs in 30 min (98% one call, 2% four-call runaways) are ~590 events/s:
## a few percent of one worker's sustained rate here (BENCHMARKS.md): the soak is about state growth and eviction.
## Not part of make test.
CHAOS_RESULTS := var/chaos-results.jsonl
chaos: install
	@$(BIN)/python -m scripts.kafka_local resolve
	@mkdir -p var && rm -f $(CHAOS_RESULTS)
	@status=0; CHAOS_TRIALS=$${CHAOS_TRIALS:-20} CHAOS_SOAK_MINUTES=$${CHAOS_SOAK_MINUTES:-30} \
	  CHAOS_SOAK_RUNS=$${CHAOS_SOAK_RUNS:-1000000} CHAOS_RESULTS=$(CHAOS_RESULTS) \
	  $(BIN)/python -m pytest tests/chaos -m chaos -v -s --timeout=4000 || status=$$?; \
	  $(BIN)/python -m tests.chaos.report $(CHAOS_RESULTS) RELIABILITY.md; exit $$status

## make lint: ruff (the rule set and each ignore's reason are in pyproject.toml) over the code, and mypy
## --strict over the package and scripts (part of make test, hence of CI).
lint: install
	@$(BIN)/ruff check stream_app tests bench scripts
	@$(BIN)/mypy
	@cargo fmt --check --manifest-path native/Cargo.toml

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis native/target
