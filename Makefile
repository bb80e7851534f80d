# Set-up is part of every target: a fresh clone needs nothing but python3 (>= 3.10) and make.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; on a GPU machine install your CUDA torch (>= 2.6) first instead.
TORCH ?= torch==2.13.0

.PHONY: setup train test bench clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

train: setup
	$(VENV)/bin/allhands train

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) bench/overhead.py
	$(PY) bench/scaling.py
	$(PY) bench/pipeline_bubble.py

clean:
	rm -rf $(VENV) runs build src/*.egg-info
