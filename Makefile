# `make demo` and `make test` each set up (or refresh) the local virtualenv, then run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test venv clean

venv: $(STAMP)

# torch is installed first and pinned: `pip install torch==2.13.0` takes the CPU wheel;
# letting a dependency resolve torch on its own would pull a multi-GB CUDA build.
$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) scripts/demo.py --config configs/demo.yaml

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests

clean:
	rm -rf $(VENV) data/ runs/ checkpoints/
