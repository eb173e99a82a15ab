# loopwarden: every set-up step lives here, so a fresh machine needs only `make run` / `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: install test run bench lint clean

$(STAMP): pyproject.toml
	@echo "==> installing loopwarden and its test tools into $(VENV)"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/pip install --quiet --disable-pip-version-check --upgrade pip
	@$(BIN)/pip install --quiet --disable-pip-version-check -e '.[worker,dev]'
	@rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

## make test: install, fetch the Kafka jars, start a local broker (unless KAFKA_BOOTSTRAP_SERVERS is set), run every test.
test: install
	@$(BIN)/python scripts/kafka_local.py resolve
	@$(BIN)/python -m pytest

## make run: a local Kafka (unless KAFKA_BOOTSTRAP_SERVERS is set), a worker and a simulated fleet of
## agents guarded through the SDK; ends with what was halted. Ctrl-C stops everything.
run: install
	@$(BIN)/python scripts/kafka_local.py exec -- $(BIN)/loopwarden demo

## make bench: benchmarks that print figures (never part of make test).
bench: install
	@$(BIN)/python -m bench.core

lint: install
	@$(BIN)/ruff check stream_app tests bench scripts

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
