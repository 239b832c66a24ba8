# celery-safe-time: every target installs what it needs into .venv first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=
ARGS ?=
# make demo BROKER=amqp: the demo on a throwaway RabbitMQ node (leases and locks stay on Redis).
# make demo BROKER=sqs: the demo on a local SQS-compatible endpoint it starts (moto, from the dev extra).
BROKER ?= redis
# make demo COORD=postgres: leases, fired slots, locks, idempotency (and the store) in a throwaway
# database of the machine's PostgreSQL; with BROKER=amqp too, no Redis process at all.
COORD ?= redis
# Most tests wait on real processes (leases, ttls, workers starting, countdowns): six pytest workers
# keep the two cores 76-87% busy and end the run in 756-850 s on a quiet machine (five: 76%, 941 s;
# docs/benchmarks.md).
# Tests go out longest first
# (tests/durations.json, sorted in tests/conftest.py), one at a time as workers free up (--dist load
# --maxschedchunk 1: a worker holds at most two ahead), so no long test starts last and holds the
# run's tail. Every test brings its own throwaway servers where it restarts one, so nothing needs to
# run alone.
TEST_WORKERS ?= 6
# Every run here starts hundreds of Python processes (workers, beats, pytest's own). Their imports
# come from bytecode compiled once: the venv's packages at install (--compile-bytecode), the
# project's modules and pytest's rewritten test modules on first import. A machine that sets
# PYTHONDONTWRITEBYTECODE (this one does) would have every process compile them again: SQLAlchemy's
# import takes 0.51 CPU-seconds from source and 0.16 from bytecode, and collecting the suite 10.7
# against 3.1.
unexport PYTHONDONTWRITEBYTECODE

# make compat: the unit and contract tests against the built wheel (not the checkout) on the oldest and
# the newest supported combination (tox.ini says why tox). tox finds python3.10/python3.13 on PATH;
# pyenv's interpreters are put first when pyenv has them.
PYENV_ROOT ?= $(HOME)/.pyenv
COMPAT_ENVS ?= py310-celery54-django42,py313-celery57-django52

.PHONY: help venv test test-unit compat test-integration lint format type demo bench bench-quick soak soak-quick check clean

help:
	@echo "make demo   - run the live demo (three beats, two workers, a kill -9, a Redis flush)"
	@echo "             BROKER=amqp: the same on a throwaway RabbitMQ node; DEMO_REDIS_URL: lend it a Redis (README)"
	@echo "             BROKER=sqs: the same on a local SQS-compatible endpoint (moto) it starts"
	@echo "             COORD=postgres: coordination in PostgreSQL (with BROKER=amqp: no Redis at all)"
	@echo "make test   - run the whole test suite against the local services"
	@echo "make check  - lint, types, unit tests and the store contract (under two minutes)"
	@echo "make compat - unit + contract tests on the built wheel: Python 3.10 + Celery 5.4 + Django 4.2, Python 3.13 + Celery 5.7 + Django 5.2"
	@echo "make lint   - ruff check + format check;  make type - mypy"
	@echo "make bench  - benchmarks (docs/benchmarks.md); make bench-quick - CI-sized smoke run"
	@echo "make soak   - the long fault-injection soak; make soak-quick - a short one"

# pip brings uv (from PyPI, like everything else) and uv installs the rest: it downloads and unpacks
# in parallel, a fresh .venv in less than half pip's time (docs/benchmarks.md, "The CI run"). pip
# stays in the venv, up to date (tests/integration/test_installed_wheel.py runs `python -m pip --python`).
$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip uv
	$(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python -e ".[dev,django,postgres]"
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist load --maxschedchunk 1 --durations=25 $(PYTEST_ARGS)

# The fast feedback loop: lint, types, the unit tests and the store contract (real databases).
check: lint type
	$(BIN)/python -m pytest -n 2 --dist worksteal tests/unit tests/contract $(PYTEST_ARGS)

test-unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

compat: $(STAMP)
	PATH="$$(ls -d $(PYENV_ROOT)/versions/3.1[0-3].*/bin 2>/dev/null | tr '\n' ':')$$PATH" $(BIN)/tox -e $(COMPAT_ENVS) $(ARGS)

test-integration: $(STAMP)
	$(BIN)/python -m pytest tests/integration $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

type: $(STAMP)
	$(BIN)/mypy

demo: $(STAMP)
	$(BIN)/python -m demo_project.run --broker $(BROKER) --coord $(COORD) $(ARGS)

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run $(ARGS)

bench-quick: $(STAMP)
	$(BIN)/python -m benchmarks.run --quick $(ARGS)

soak: $(STAMP)
	SAFE_TIME_SOAK=1 $(BIN)/python -m pytest -m "soak or slow" tests $(PYTEST_ARGS)

soak-quick: $(STAMP)
	$(BIN)/python -m pytest -m soak tests/faults $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .tox build dist *.egg-info .mypy_cache .ruff_cache celery_safe_time.sqlite3
