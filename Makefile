# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
OPS_LIB := kvexport/_lib/libkvexport_ops.so
CONFIG ?= configs/hstu-tiny.yaml
OUT ?= artifacts/hstu-tiny

.PHONY: demo test setup native clean

demo: setup
	$(VENV)/bin/kvexport score $(CONFIG)
	scripts/package.sh $(CONFIG) $(OUT) $(VENV)/bin/kvexport

test: setup
	$(PY) -m pytest -q

setup: $(STAMP) native

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[test,bench,serve]'
	touch $(STAMP)

native: $(STAMP)
	$(PY) -m kvexport.native

clean:
	rm -rf build kvexport/_lib
