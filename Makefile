# Two commands from a fresh clone: `make demo` and `make test`. The first target that needs it creates
# .venv, installs torch 2.13.0 (CPU wheel) and this package with its test extra, and builds the C++
# extension; later runs rebuild the extension only when csrc/ changed.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
INSTALLED := $(VENV)/.installed
BUILT := $(VENV)/.built
CSRC := $(shell find csrc -name '*.cpp' -o -name '*.h' 2>/dev/null)

.PHONY: setup build demo test test-fast lint format bench device-check clean

setup: $(BUILT)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip setuptools wheel ninja

$(INSTALLED): $(PY) pyproject.toml setup.py
	@# The Mooncake client (host KV pool backend, P/D transport) links against Debian's libibverbs1.
	@if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1; \
		else \
			echo "note: libibverbs1 is missing; the Mooncake tests need it: sudo apt-get install libibverbs1"; \
		fi; \
	fi
	$(PIP) install torch==2.13.0
	TORCH_KVOFFLOAD_BUILD_EXT=0 $(PIP) install --no-build-isolation -e '.[test,bench,mooncake,hf,pd,serve]'
	touch $@

$(BUILT): $(INSTALLED) $(CSRC)
	MAX_JOBS=$${MAX_JOBS:-2} $(PY) setup.py -q build_ext --inplace
	touch $@

build: $(BUILT)

lint: $(INSTALLED)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

format: $(INSTALLED)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Two pytest workers (pytest-xdist), each taking whole files: module fixtures that spawn process groups run
# once, and a worker waiting on its subprocesses leaves the core to the other. The files holding slow tests
# are handed out first, each group by xdist's own most-tests-first (tests/conftest.py orders them;
# --no-loadscope-reorder keeps that order: xdist alone left long files of few tests for the end).
# TEST_WORKERS=0 runs serially.
# `make test` prints the 25 slowest tests; `make test-fast` is the inner loop: the unit tier, without the tests
# marked slow (multi-process groups, servers, the compiled-model sequences).
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: lint $(BUILT)
	$(PYTEST) --durations=25 tests

test-fast: $(BUILT)
	$(PYTEST) -m "not slow" tests

# The Hugging Face demos first (a tiny DeepseekV32 with layerwise + sparse decode offload; 2-rank KVPP on a
# tiny DeepseekV3 loaded with tensor parallelism, ranks spawned; the same on a DeepseekV32, whose heads are
# sharded too, under torchrun), then the others.
DEMOS := "examples/generate.py --model deepseek_v32 --mode both" "examples/generate.py --model deepseek_v3 --mode kvpp" \
	"-m torch.distributed.run --standalone --nproc-per-node 2 examples/generate.py --tp 2 --model deepseek_v32 --mode kvpp" \
	examples/ops_demo.py examples/layerwise_prefill_demo.py examples/sparse_decode_demo.py \
	examples/kvpp_demo.py examples/disaggregated.py examples/serve_demo.py
BENCHES := copy_bench store_bench layerwise_bench layerwise_store_python sparse_ops_bench sparse_decode_bench kvpp_bench \
	tp_kvpp_bench hf_generate_bench decode_host_bench pd_bench triton_compile_check device_bench serving_bench \
	prefix_cache_bench multiturn_bench fp8_accuracy_bench

demo: $(BUILT)
	@for demo in $(DEMOS); do \
		echo "== $$demo"; $(PY) $$demo || exit 1; \
	done

bench: $(BUILT)
	@for bench in $(BENCHES); do \
		echo "== benchmarks/$$bench.py"; $(PY) benchmarks/$$bench.py || exit 1; \
	done
	@if [ "$$(uname -m)" = x86_64 ]; then \
		echo "== benchmarks/residency_floor.cpp"; mkdir -p build; \
		$${CXX:-g++} -O3 -march=native benchmarks/residency_floor.cpp -o build/residency_floor && build/residency_floor; \
	fi

# Accelerator check: op / device / end-to-end tests on the device and benchmarks/device_bench.py
# (on CPU it says what it skipped).
device-check: $(BUILT)
	bash benchmarks/device_check.sh

clean:
	rm -rf build torch_kvoffload/*.so $(BUILT)

# The Hugging Face tests on the oldest supported transformers (MIN_TRANSFORMERS in
# torch_kvoffload/integrations/hf/versions.py; .venv has the newest the hf extra allows): .venv-oldest holds
# torch 2.13.0, that transformers and this package, editable, with its test, hf, pd and serve extras; the C++
# extension is built in-tree (`make build`), so both venvs load the same one.
OLDEST_TRANSFORMERS := $(shell sed -n 's/^MIN_TRANSFORMERS = "\(.*\)"/\1/p' torch_kvoffload/integrations/hf/versions.py)
VENV_OLDEST := .venv-oldest
OLDEST_INSTALLED := $(VENV_OLDEST)/.installed-transformers-$(OLDEST_TRANSFORMERS)

.PHONY: test-hf-oldest

$(OLDEST_INSTALLED): pyproject.toml setup.py torch_kvoffload/integrations/hf/versions.py
	test -x $(VENV_OLDEST)/bin/python || $(PYTHON) -m venv $(VENV_OLDEST)
	$(VENV_OLDEST)/bin/python -m pip install --upgrade pip setuptools wheel
	$(VENV_OLDEST)/bin/python -m pip install torch==2.13.0
	TORCH_KVOFFLOAD_BUILD_EXT=0 $(VENV_OLDEST)/bin/python -m pip install --no-build-isolation \
		-e '.[test,hf,pd,serve]' 'transformers==$(OLDEST_TRANSFORMERS)'
	touch $@

test-hf-oldest: $(OLDEST_INSTALLED) $(BUILT)
	$(VENV_OLDEST)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests/hf
