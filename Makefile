# Two commands (README): `make demo` sets up and runs the main job; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test clean
$(VENV)/.installed: setup.py moe_ft/store/_mfh64.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e ".[test]" --config-settings editable_mode=compat
	touch $@

setup: $(VENV)/.installed

demo: setup
	PATH="$(abspath $(VENV))/bin:$$PATH" bash examples/quickstart.sh

# ruff (ruff.toml) and mypy (mypy.ini) run before the tests, and must pass. The tests run on TEST_WORKERS
# pytest-xdist workers, one module per worker at a time (module fixtures are built once); the longest
# modules start first (tests/conftest.py).
TEST_WORKERS ?= 2
test: setup
	$(PY) -m ruff check . && $(PY) -m mypy && $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15 tests

clean:
	rm -rf $(VENV) data runs .mypy_cache .ruff_cache
