# `make demo` and `make test` each set up (or refresh) the local virtualenv, then run.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test venv python clean

# Python 3.12 (megatron-core 0.19 requires it): $(PYTHON) when given, else python3.12 or
# python3 where it is 3.12, else pyenv's newest 3.12 (its shims run only the selected
# version, so the interpreter is taken from pyenv's own folder).
IS_312 := -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'
define FIND_PYTHON
for candidate in $(PYTHON) python3.12 python3; do \
  found=$$(command -v $$candidate) && $$found $(IS_312) 2>/dev/null \
    && { echo $$found; exit 0; }; \
done; \
root=$$(pyenv root 2>/dev/null) \
  && found=$$(ls -d $$root/versions/3.12.*/bin/python3.12 2>/dev/null | sort -V | tail -n 1) \
  && test -n "$$found" && $$found $(IS_312) && echo $$found
endef
# Looked for only when a recipe needs it; missing, make stops with one line saying so.
PYTHON312 = $(or $(shell $(FIND_PYTHON)),$(error Python 3.12 not found: install python3.12 \
(e.g. apt-get install python3.12-venv, or pyenv install 3.12), or pass PYTHON=/path/to/it))

venv: $(STAMP)

# Which interpreter the virtualenv is built from.
python:
	@echo $(PYTHON312)

# torch is installed first and pinned: PyPI's torch==2.13.0 (a CUDA build that runs on a CPU
# too); letting megatron-core resolve torch on its own could pick another version. A
# virtualenv of another Python (an older checkout's 3.11) is rebuilt. uv installs: it fetches
# and unpacks torch's 5 GB of wheels in parallel, a minute where pip takes three. It
# byte-compiles too: with PYTHONDONTWRITEBYTECODE set, as on this project's machines,
# nothing else would, and every process would compile torch from source.
UV := $(VENV)/bin/uv pip install --python $(PY) --quiet --compile-bytecode
$(STAMP): setup.py
	@$(PY) $(IS_312) 2>/dev/null || { rm -rf $(VENV) \
	  && echo "$(PYTHON312) -m venv $(VENV)" && $(PYTHON312) -m venv $(VENV); }
	$(PY) -m pip install --quiet 'uv>=0.5,<1'
	$(UV) torch==2.13.0
	$(UV) -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) scripts/demo.py --config configs/demo.yaml

# Lint first (ruff.toml): seconds, and a finding stops the run before the tests' minutes.
# Then the suite on TEST_JOBS workers (pytest-xdist, a test file per worker: a file's runs
# share its fixtures), and last, alone, the tests that compare step times (marked serial).
TEST_JOBS ?= 2
PYTEST := $(PY) -m pytest -q -p no:cacheprovider
test: $(STAMP)
	$(PY) -m ruff check .
	$(PYTEST) -n $(TEST_JOBS) --dist loadfile -m "not serial" tests
	$(PYTEST) -m serial tests

clean:
	rm -rf $(VENV) data/ runs/ checkpoints/
