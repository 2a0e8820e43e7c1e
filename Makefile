# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
OPS_LIB := kvexport/_lib/libkvexport_ops.so
CONFIG ?= configs/hstu-tiny.yaml
OUT ?= artifacts/hstu-tiny

# CUTLASS/CuTe's headers for the CUDA op library's Hopper attention path (and the CPU test that compiles
# it): header-only, so none of the distribution's Python dependencies is installed.
CUTLASS := nvidia-cutlass==4.2.0.0
# cuobjdump and nvdisasm, for the test that reads the Hopper kernel's machine code (CUDA's compiler is
# on the machine; its disassemblers may not be).
CUDA_DISASSEMBLERS := nvidia-cuda-cuobjdump==13.2.51 nvidia-cuda-nvdisasm==13.2.51

# The remote KV tier's server (tests) and client library (op library, found through pkg-config).
REMOTE_PACKAGES := redis-server libhiredis-dev pkg-config

.PHONY: demo test lint setup system-packages native perf-analyzer clean

demo: setup
	$(VENV)/bin/kvexport score $(CONFIG)
	scripts/package.sh $(CONFIG) $(OUT) $(VENV)/bin/kvexport

test: setup
	$(PY) -m pytest -q

# Python: ruff's lint rules and formatting (pyproject.toml's [tool.ruff]). C++ under csrc/: clang-format
# (.clang-format) where it is installed (system-packages installs it); where it is not, said in one line.
# Every check runs; the target fails if any did.
CPP_SOURCES = $(shell git ls-files 'csrc/*.cpp' 'csrc/*.h' 'csrc/*.cu' 'csrc/*.cuh')
lint: $(STAMP)
	@status=0; \
	echo "ruff check"; $(VENV)/bin/ruff check . || status=1; \
	echo "ruff format --check"; $(VENV)/bin/ruff format --check . || status=1; \
	if command -v clang-format >/dev/null 2>&1; then \
		echo "clang-format --dry-run --Werror ($(words $(CPP_SOURCES)) files under csrc/)"; \
		clang-format --dry-run --Werror $(CPP_SOURCES) || status=1; \
	else \
		echo "clang-format is not installed (apt-get install clang-format): C++ formatting not checked"; \
	fi; \
	exit $$status

setup: system-packages $(STAMP) native

# Installs what of REMOTE_PACKAGES and the tools below is missing when running as root with apt-get;
# otherwise names it in one line (the op library then builds without the remote tier, the runtime's C++
# unit tests are not built, and their tests skip; make lint skips the C++ check). Quick when present.
system-packages:
	@missing=""; \
	command -v redis-server >/dev/null 2>&1 || missing="$$missing redis-server"; \
	command -v pkg-config >/dev/null 2>&1 || missing="$$missing pkg-config"; \
	pkg-config --exists hiredis 2>/dev/null || missing="$$missing libhiredis-dev"; \
	command -v nginx >/dev/null 2>&1 || missing="$$missing nginx-light"; \
	pkg-config --exists gtest 2>/dev/null || missing="$$missing libgtest-dev"; \
	command -v clang-format >/dev/null 2>&1 || missing="$$missing clang-format"; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing$$missing (the remote KV tier; nginx: the load-balancer test; GoogleTest: the runtime's C++ unit tests; clang-format: make lint)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq$$missing >/dev/null; \
	else \
		echo "remote KV tier, load balancer, C++ unit tests, C++ lint: install$$missing (sudo apt-get install$$missing); until then their tests skip"; \
	fi

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[test,bench,serve]'
	$(PY) -m pip install --quiet --no-deps $(CUTLASS) $(CUDA_DISASSEMBLERS)
	touch $(STAMP)

native: $(STAMP)
	$(PY) -m kvexport.native

# Triton's load tool for benchmarks/serve_perf.py: the binary of the tritonclient==2.41.0 wheel (later
# wheels do not carry it), downloaded, never installed into the venv (its tritonclient stays the serve
# extra's). The script puts the serve extra's bundled libb64 and libcudart on its loader path.
PERF_ANALYZER := build/perf_analyzer/perf_analyzer
perf-analyzer: $(PERF_ANALYZER)
$(PERF_ANALYZER): | $(STAMP)
	$(PY) benchmarks/serve_perf.py --install

clean:
	rm -rf build kvexport/_lib
