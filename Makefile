# pdctl's one entry point for set-up, demo, tests, lint and benchmarks.
# Everything a fresh Debian 12 machine (as root) needs is installed here.

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
APT_PACKAGES := debootstrap systemd-container iproute2 openssh-client python3-venv python3-pip util-linux
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: install apt venv demo test flake lint lint-python lint-ansible bench clean

install: apt venv

# Packages the lab and the tests need on this machine (debootstrap, nspawn,
# ip, ssh). Skipped when already present so re-runs stay fast and offline.
apt:
	@missing=""; for p in $(APT_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "apt-get install:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	# An editable install leaves pdctl uncompiled, and with PYTHONDONTWRITEBYTECODE set every
	# `pdctl` command would compile all of it again (0.13 s of its 0.4 s start).
	$(BIN)/python -m compileall -q pdctl
	touch $@

demo: install
	$(BIN)/python scripts/demo.py

# Three workers on 2 cores: the lab tests wait as well as compute (health checks, scaler
# windows), so they overlap. A fourth fills the cores' last idle time (16 % of a full run with
# three, 4 % with four) but costs as much in contention: the same tree used 22 % more CPU and
# took longer (23:01 with three, 24:41 with four). loadfile keeps a module (and the lab it
# boots) on one worker; the modules go out in collection order, longest first
# (tests/conftest.py, LONGEST_FIRST).
test: install
	$(BIN)/pytest -n 3 --dist loadfile --no-loadscope-reorder --durations=15

# Flaky tests show up here before CI: the unit and CLI tests FLAKE_RUNS times in a row with a
# CPU hog on one core; name lab modules to add them: make flake FLAKE_TESTS=tests/integration/test_scaler.py
FLAKE_RUNS ?= 10
FLAKE_TESTS ?=
flake: install
	$(BIN)/python scripts/flake.py --runs $(FLAKE_RUNS) $(FLAKE_TESTS)

# pdctl's Python beside the playbooks (Ansible's plugins and modules), linted with pdctl's.
ANSIBLE_PY = playbooks/lookup_plugins playbooks/library playbooks/strategy_plugins

# pdctl/onhost runs on the hosts' Python 3.9: ruff holds its syntax to 3.9 (pyproject.toml) and
# mypy checks it again at 3.10, the oldest it targets (a newer standard-library name fails).
# The Python and the Ansible halves run side by side (ansible-lint alone is half the time);
# each half's output is printed whole when it ends.
lint: install
	$(MAKE) --no-print-directory -j2 --output-sync=target lint-python lint-ansible

lint-python: install
	$(BIN)/ruff check pdctl tests bench scripts $(ANSIBLE_PY)
	$(BIN)/ruff format --check pdctl tests bench scripts $(ANSIBLE_PY)
	$(BIN)/mypy
	$(BIN)/mypy --python-version 3.10 pdctl/onhost
	$(BIN)/mypy $(ANSIBLE_PY) scripts/import_contracts.py
	$(BIN)/lint-imports

lint-ansible: install
	$(BIN)/yamllint -s .
	$(BIN)/ansible-lint

bench: install
	$(BIN)/python bench/run.py

clean:
	-$(BIN)/pdctl lab down
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
