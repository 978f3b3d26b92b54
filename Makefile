# Everything a newcomer needs: `make demo` (the main job) and `make test` (every test), from a fresh clone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench proto clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m kvtier.demo

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -rs

bench: $(STAMP)
	$(PY) bench/rpc.py
	$(PY) bench/index_memory.py
	$(PY) bench/fragmentation.py

proto: $(STAMP)
	$(PY) proto/generate.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
