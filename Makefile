# The README's first command: `make demo`. `make test` runs every test (tox).
PYTHON ?= python3
VENV ?= .venv
DEMO_ARGS ?=
UV := $(shell command -v uv 2>/dev/null)

.PHONY: demo test

# Creates $(VENV) (uv if installed, else python -m venv) and installs the workspace
# into it, then runs the bank demo against a `waltz dev` cluster it starts in a
# temporary directory and stops at the end.
demo: $(VENV)/.waltz-installed
	$(VENV)/bin/python -m waltz_bank $(DEMO_ARGS)

$(VENV)/.waltz-installed: requirements/workspace.txt
ifdef UV
	test -x $(VENV)/bin/python || $(UV) venv --python 3.11 $(VENV)
	VIRTUAL_ENV=$(VENV) $(UV) pip install -q -r requirements/workspace.txt
else
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
	  { echo "make demo needs Python 3.11+: install uv, or run make demo PYTHON=python3.11"; exit 1; }
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q -r requirements/workspace.txt
endif
	touch $@

# Installs what the tests need and is missing (scripts/install-test-deps: Debian
# packages as root, else a list of them; tox and uv from PyPI), then runs every test
# environment of tox.ini's env_list, two at a time (.ci/toxpar.py: each one's output
# printed whole at the end, the failing ones' last, then a summary; `make test JOBS=1`
# runs them one after another). `.ci/run` is this command.
JOBS ?= 2
test:
	scripts/install-test-deps
	python3 .ci/toxpar.py --jobs $(JOBS)
