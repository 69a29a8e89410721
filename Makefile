# Quick start: `make chat` (set up, then chat with the bundled model) and `make test`.
# Both create .venv when missing and install what they need; the first install compiles
# llama.cpp from source (about 2 minutes on 2 cores; the wheel is kept afterwards).

SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -ec
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEPS := pyproject.toml setup.py native/adaptive.c constraints.txt
# Every install takes the versions CI tested (constraints.txt), so that a green CI means a
# green fresh machine; `make constraints` rewrites it from .venv, on purpose.
PIN := -c constraints.txt
# Show the llama.cpp build's progress ([n/87] lines) instead of minutes of silence.
PROGRESS := grep --line-buffered -E '^\s*\[[0-9]+/[0-9]+\]|Successfully installed|rror' | cut -c1-110

.PHONY: chat test chromium bench eval asan sanitize clean constraints

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade $(PIN) pip

# llama.cpp always with its RPC backend (docs/distributed.md), without the multimodal library
# (libmtmd: llama-cpp-python loads it only for image chat handlers, which the package does not
# use; a quarter of the build), plus whatever CMAKE_ARGS adds (-DGGML_CUDA=on for an NVIDIA GPU). pip's wheel cache ignores CMake flags, so an earlier
# build without RPC would be reused silently: the wheel is built here without pip's cache,
# once per version and set of flags, and kept in a folder of its own.
LLAMA_VERSION := $(shell sed -n 's/^llama_cpp_python==//p' constraints.txt)
LLAMA_CMAKE_ARGS := -DGGML_RPC=ON -DLLAVA_BUILD=OFF $(CMAKE_ARGS)
LLAMA_KEY := $(LLAMA_VERSION)-$(shell echo '$(LLAMA_CMAKE_ARGS) '"$$($(PYTHON) -c 'import sys; print(sys.implementation.cache_tag)')" | md5sum | cut -c1-10)
LLAMA_WHEELS ?= $(HOME)/.cache/adaptive-llama/wheels/$(LLAMA_KEY)

# llama-cpp-python also forces on llama.cpp's common library, which only libmtmd links: it is
# built from its source with that one switch off (or as it is, with a note, where a later
# version moved the line).
LLAMA_COMMON_ON := set(LLAMA_BUILD_COMMON ON CACHE BOOL

$(VENV)/.llama-$(LLAMA_KEY): constraints.txt | $(PY)
	if ! ls $(LLAMA_WHEELS)/llama_cpp_python-$(LLAMA_VERSION)-*.whl >/dev/null 2>&1; then \
	    echo "Building llama-cpp-python $(LLAMA_VERSION) with $(LLAMA_CMAKE_ARGS) (about 2 minutes on 2 cores, once)..."; \
	    rm -rf $(LLAMA_WHEELS).tmp && mkdir -p $(LLAMA_WHEELS).tmp; \
	    $(PY) -m pip download --quiet --no-deps --no-binary :all: -d $(LLAMA_WHEELS).tmp "llama-cpp-python==$(LLAMA_VERSION)"; \
	    tar -xzf $(LLAMA_WHEELS).tmp/*.tar.gz -C $(LLAMA_WHEELS).tmp; \
	    source=$$(ls -d $(LLAMA_WHEELS).tmp/*/); \
	    if grep -qF '$(LLAMA_COMMON_ON)' $$source/CMakeLists.txt; then \
	        sed -i 's/$(LLAMA_COMMON_ON)/set(LLAMA_BUILD_COMMON OFF CACHE BOOL/' $$source/CMakeLists.txt; \
	    else echo "Note: llama-cpp-python $(LLAMA_VERSION) builds llama.cpp's common library too (a longer build)."; fi; \
	    CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip wheel -v --no-deps --no-cache-dir \
	        -w $(LLAMA_WHEELS).tmp $$source 2>&1 | $(PROGRESS); \
	    mkdir -p $(LLAMA_WHEELS) && mv $(LLAMA_WHEELS).tmp/llama_cpp_python-*.whl $(LLAMA_WHEELS)/ && rm -rf $(LLAMA_WHEELS).tmp; \
	fi
	@# This build in place of any other of the same version, then what it needs.
	$(PY) -m pip install --quiet --force-reinstall --no-deps $(LLAMA_WHEELS)/llama_cpp_python-$(LLAMA_VERSION)-*.whl
	$(PY) -m pip install --quiet $(PIN) $(LLAMA_WHEELS)/llama_cpp_python-$(LLAMA_VERSION)-*.whl
	$(PY) -c 'import llama_cpp, sys; sys.exit(0 if llama_cpp.llama_supports_rpc() else "llama.cpp was built without its RPC backend")'
	rm -f $(VENV)/.llama-* && touch $@

$(VENV)/.installed-%: $(DEPS) $(VENV)/.llama-$(LLAMA_KEY) | $(PY)
	@echo "Installing adaptive-llama[$*] into $(VENV). A first install compiles llama.cpp (about 2 minutes on 2 cores)..."
	$(PY) -m pip install -v $(PIN) -e ".[$*]" 2>&1 | $(PROGRESS)
	@# The evaluation's Wikipedia/TinyStories text; the package's torch is not needed.
	if [[ "$*" == test || "$*" == eval ]]; then $(PY) -m pip install --quiet --no-deps "exllamav2==0.3.2"; fi
	touch $@

chat: $(VENV)/.installed-default-model
	$(VENV)/bin/adaptive-llama run

# The whole suite with the backend a normal install picks (C), then the tests whose outcome
# depends on the backend (marked `backend`; tests/test_marks.py keeps the mark on every test
# that uses the kernel or the chain) with the numba kernel and in-chain samplers forced, as
# on a machine without a C compiler; cases that pick C or numba themselves ran in the first
# pass and are left out there (tests/conftest.py). One pytest-xdist worker per core, each on cores of its
# own (tests/conftest.py): TEST_WORKERS=1 runs them one at a time.
TEST_WORKERS ?= auto
test: $(VENV)/.installed-test chromium
	$(PY) -m pytest -q -n $(TEST_WORKERS)
	ADAPTIVE_LLAMA_IMPL=numba $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) -m backend

# The chat page's tests (tests/test_web.py) drive Debian's Chromium; as root with apt-get it is
# installed here, otherwise they are skipped (and fail under CI=true, as .ci/run sets).
chromium:
	@if ! command -v chromium >/dev/null && [ -z "$$ADAPTIVE_LLAMA_CHROMIUM" ]; then \
	    if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	        echo "Installing Chromium for the chat page's tests (apt-get install chromium)..."; \
	        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	    else \
	        echo "No Chromium: the chat page's browser tests will be skipped (install the chromium package)."; \
	    fi; \
	fi

bench: $(VENV)/.installed-bench
	$(PY) benchmarks/bench_kernel.py
	$(PY) benchmarks/bench_e2e.py

eval: $(VENV)/.installed-eval
	$(VENV)/bin/adaptive-llama eval

# The C kernel and samplers under AddressSanitizer and UBSan, driven by the fuzz, kernel, chain,
# CLI and server tests: built twice, portable and with AVX2 (the two collect loops).
ASAN_DIR := build/asan
asan: $(VENV)/.installed-test
	set -e; for isa in portable avx2; do \
	    mkdir -p $(ASAN_DIR)/$$isa; \
	    gcc -O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer -std=c11 -shared -fPIC -fopenmp \
	        -fvisibility=hidden $$([ $$isa = avx2 ] && echo -mavx2 -mfma) \
	        -I"$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
	        native/adaptive.c native/module.c -o $(ASAN_DIR)/$$isa/_adaptive_native.so -lmvec -lm; \
	    echo "== $$isa"; \
	    ADAPTIVE_LLAMA_NATIVE_LIB=$(CURDIR)/$(ASAN_DIR)/$$isa/_adaptive_native.so \
	    LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	    ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:allocator_may_return_null=1 \
	    UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	    $(PY) -m pytest -q -p no:cacheprovider tests/test_fuzz.py tests/test_kernel.py \
	        tests/test_chain.py tests/test_cli.py tests/test_server.py; \
	done

sanitize: asan

constraints: $(VENV)/.installed-test
	( sed -n '1,2p' constraints.txt; $(PY) -m pip freeze --exclude-editable; \
	  echo "pip==$$($(PY) -m pip --version | cut -d' ' -f2)" ) > constraints.new
	mv constraints.new constraints.txt

clean:
	rm -rf $(VENV) build *.egg-info adaptive_llama/*.so
