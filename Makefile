# Set-up is part of every target: a fresh clone needs nothing but python3 (>= 3.10) and make.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; on a GPU machine install your CUDA torch (>= 2.6) first instead.
TORCH ?= torch==2.13.0
# The rest is installed by uv (from PyPI): 3x faster than pip at the same pinned versions.
UV := uv==0.9.0

.PHONY: setup train test bench clean

# The test and dev tools are pinned in constraints.txt (pip freeze of a working venv, less torch
# and allhands): a fresh clone installs exactly what CI ran. A change to it or to pyproject.toml
# rebuilds the venv from scratch, so nothing stale survives.
$(VENV)/.installed: pyproject.toml constraints.txt Makefile
	python3 -m venv --clear $(VENV)
	$(PY) -m pip install -q "pip==26.3" "$(UV)"
	$(PY) -m pip install -q --no-compile "$(TORCH)"
	$(VENV)/bin/uv pip install -q --python $(PY) -c constraints.txt -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

train: setup
	$(VENV)/bin/allhands train

# Three pytest-xdist workers on two cores (docs/testing.md): a test spends part of its time
# waiting on a process's start or a timeout, and a third worker fills those gaps. Tests that share a machine-wide
# resource hold its lock (tests/isolation.py); the `serial` ones time things, so they run alone
# afterwards. tests/suite.py runs both parts whatever the first gives, then names every failure.
# Bytecode is written where it is first imported, also where PYTHONDONTWRITEBYTECODE is set
# (CI): else each of the suite's few hundred processes would compile torch's and allhands' modules
# again, and compiling all of the venv at set-up (33 s on 2 cores) compiles mostly what no test
# imports. Nothing is written outside the checkout: the venv, src/ and tests/.
test: setup
	env -u PYTHONDONTWRITEBYTECODE $(PY) tests/suite.py

bench: setup
	$(PY) bench/overhead.py
	$(PY) bench/scaling.py
	$(PY) bench/pipeline_bubble.py

clean:
	rm -rf $(VENV) runs build src/*.egg-info
