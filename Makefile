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

# Two pytest-xdist workers: most of a test's time is spent starting processes (importing torch)
# and waiting on timeouts, so two at once fill two cores. Tests sharing a job or a network lab stay
# on one worker (tests/conftest.py); the `serial` ones time things, so they run alone afterwards.
test: setup
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "not serial"
	$(PY) -m pytest -q -m serial

bench: setup
	$(PY) bench/overhead.py
	$(PY) bench/scaling.py
	$(PY) bench/pipeline_bubble.py

clean:
	rm -rf $(VENV) runs build src/*.egg-info
