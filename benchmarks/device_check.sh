#!/usr/bin/env bash
# One command for an accelerator machine (and runnable on CPU, where it says what it skipped):
#   set up -> build the C++ extension -> op tests, device-layer tests, sparse decode / layerwise / Hugging
#   Face end-to-end tests on the accelerator -> benchmarks/device_bench.py -> summary table + JSON.
#
#   bash benchmarks/device_check.sh            (or: make device-check)
#
# Set-up uses the python3 that holds PyTorch (an accelerator image ships torch and triton). Packages the
# library needs that are missing are installed from wheels in ./.whl when that folder exists (machines
# without a package index), else from the index. Results: benchmarks/results/device_check.json, and
# $OUT/device_check.json + $OUT/device_bench.json + $OUT/*.log when OUT is set. Budget: about 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
OUTDIR=${OUT:-$ROOT/build/device_check}
mkdir -p "$OUTDIR" benchmarks/results
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
declare -a NAMES=() RESULTS=() SECONDS_TAKEN=()

step() {  # step NAME LOGFILE COMMAND...
    local name=$1 log=$2; shift 2
    local start=$SECONDS
    echo "== $name"
    if "$@" >"$OUTDIR/$log" 2>&1; then RESULTS+=("ok"); else RESULTS+=("FAILED (rc $?, see $log)"); fi
    NAMES+=("$name"); SECONDS_TAKEN+=($((SECONDS - start)))
    tail -n 3 "$OUTDIR/$log"
}
skip() { NAMES+=("$1"); RESULTS+=("skipped: $2"); SECONDS_TAKEN+=(0); echo "== $1: skipped ($2)"; }

# ---- set-up: only what is missing, never torch itself
missing=$($PY - <<'EOF'
import importlib.util
need = {"pydantic": "pydantic", "numpy": "numpy", "pytest": "pytest", "tqdm": "tqdm", "transformers": "transformers"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
EOF
)
if [ -n "$missing" ]; then
    if [ -d .whl ]; then
        step "install ($missing) from .whl" setup.log $PY -m pip install -q --no-index --no-deps --no-compile \
            --target /tmp/kvoffload-site .whl/*.whl
        export PYTHONPATH="$PYTHONPATH:/tmp/kvoffload-site"
    else
        step "install ($missing)" setup.log $PY -m pip install -q $missing
    fi
fi
KIND=$($PY -c "from torch_kvoffload.device import accelerator_type; print(accelerator_type())" 2>>"$OUTDIR/setup.log")
echo "accelerator: ${KIND:-unknown}"

# ---- build the C++ CPU kernels (the reference platform's kernels; the device kernels are Triton)
step "build C++ extension" build.log env MAX_JOBS=${MAX_JOBS:-$(nproc)} $PY setup.py -q build_ext --inplace

# ---- tests: the op suites (every op's Triton kernel on the device), device layer, end to end
# the FP8 kernels' tests run their Triton launches on CUDA copies of their inputs where a device is present
OP_TESTS="tests/ops/test_copy_ops.py tests/ops/test_indexer_ops.py tests/ops/test_residency_ops.py tests/ops/test_sparse_attention_ops.py
    tests/ops/test_triton_fp8_attention.py tests/ops/test_triton_fp8_indexer.py tests/ops/test_fp8_copy_attention_ops.py"
# test_sparse_device.py: the device step without a host synchronisation and in a CUDA graph (CUDA only)
E2E_TESTS="tests/sparse/test_sparse_runtime.py tests/sparse/test_sparse_e2e.py tests/layerwise/test_layerwise_runtime.py
    tests/sparse/test_sparse_device.py tests/sparse/test_sparse_fp8_kv.py"
HF_TESTS=$(ls tests/hf/test_hf_*.py 2>/dev/null | tr '\n' ' ')
if [ "$KIND" = "cpu" ] || [ -z "$KIND" ]; then
    skip "op tests on the accelerator" "no accelerator (make test runs them on CPU)"
    skip "device-layer tests on the accelerator" "no accelerator"
    skip "sparse decode / layerwise end to end on the accelerator" "no accelerator"
    skip "Hugging Face generate on the accelerator" "no accelerator"
else
    export KVOFFLOAD_TEST_DEVICE=$KIND
    step "op tests on $KIND" ops.log timeout 300 $PY -m pytest -q -x -p no:cacheprovider $OP_TESTS
    step "device-layer tests on $KIND" device.log timeout 60 $PY -m pytest -q -p no:cacheprovider tests/test_device.py
    step "sparse decode / layerwise end to end on $KIND" e2e.log timeout 180 $PY -m pytest -q -p no:cacheprovider $E2E_TESTS
    if [ -n "$HF_TESTS" ]; then
        step "Hugging Face generate on $KIND" hf.log timeout 180 $PY -m pytest -q -p no:cacheprovider $HF_TESTS
    else
        skip "Hugging Face generate on $KIND" "no tests/hf/test_hf_*.py"
    fi
fi

# ---- benchmarks (device_bench skips itself on CPU)
step "benchmarks/device_bench.py" bench.log timeout 240 $PY benchmarks/device_bench.py
[ -f benchmarks/results/device_bench.json ] && cp benchmarks/results/device_bench.json "$OUTDIR/" 2>/dev/null

# ---- summary
echo
printf '%-60s %8s  %s\n' "step" "seconds" "result"
printf '%-60s %8s  %s\n' "----" "-------" "------"
failed=0
json="["
for i in "${!NAMES[@]}"; do
    printf '%-60s %8s  %s\n' "${NAMES[$i]}" "${SECONDS_TAKEN[$i]}" "${RESULTS[$i]}"
    case "${RESULTS[$i]}" in FAILED*) failed=1 ;; esac
    [ "$i" -gt 0 ] && json+=","
    json+="{\"step\": \"${NAMES[$i]}\", \"seconds\": ${SECONDS_TAKEN[$i]}, \"result\": \"${RESULTS[$i]}\"}"
done
json+="]"
printf '{"accelerator": "%s", "steps": %s}\n' "${KIND:-unknown}" "$json" | tee benchmarks/results/device_check.json \
    > "$OUTDIR/device_check.json"
exit $failed
