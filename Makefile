# Set-up is part of every target: a fresh clone needs nothing but python3 (>= 3.10) and make.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; on a GPU machine install your CUDA torch (>= 2.6) first instead.
TORCH ?= torch==2.13.0

.PHONY: setup train test bench clean

# The test and dev tools are pinned in constraints.txt (pip freeze of a working venv, less torch
# and allhands): a fresh clone installs exactly what CI ran. A change to it or to pyproject.toml
# rebuilds the venv from scratch, so nothing stale survives.
$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv --clear $(VENV)
	$(PY) -m pip install -q "pip==26.3"
	$(PY) -m pip install -q --no-compile "$(TORCH)"
	$(PY) -m pip install -q --no-compile -c constraints.txt -e ".[dev]"
	@# The bytecode pip would write one file at a time, on every core (16 s less of set-up on 2).
	@# Files that are not Python 3 (test data inside packages) fail here as they did under pip.
	-@$(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null
	touch $@

setup: $(VENV)/.installed

train: setup
	$(VENV)/bin/allhands train

# Two pytest-xdist workers: most of a test's time is spent starting processes (importing torch)
# and waiting on timeouts, so two at once fill two cores. Tests that share a machine-wide
# resource hold its lock (tests/isolation.py); the `serial` ones time things, so they run alone
# afterwards. tests/suite.py runs both parts whatever the first gives, then names every failure.
# The package's and the tests' bytecode first: where PYTHONDONTWRITEBYTECODE is set (CI) no
# process writes it, and each of the suite's few hundred would compile allhands again (~0.5 s).
test: setup
	-$(PY) -m compileall -q src tests
	$(PY) tests/suite.py

bench: setup
	$(PY) bench/overhead.py
	$(PY) bench/scaling.py
	$(PY) bench/pipeline_bubble.py

clean:
	rm -rf $(VENV) runs build src/*.egg-info
