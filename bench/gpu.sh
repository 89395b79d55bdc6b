#!/usr/bin/env bash
# The one prepared check for a CUDA machine (written for one H200; budget: under 8 minutes).
#
#   bash bench/gpu.sh              # from the repository root, or from anywhere
#
# 1. installs the wheels found in .whl/ (or $WHEELS) into /tmp/site, offline, no deps resolved:
#    the machine has no network. Fetch them beforehand on a networked machine, e.g.
#      python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
#        -d .whl flashinfer-python==0.7.4 apache-tvm-ffi nvidia-cudnn-frontend ...
#    (torch, triton, pytest, hypothesis and numpy are expected on the machine already);
# 2. runs the GPU benchmarks that are present: bench/gpu_triton.py (decode bandwidth, then
#    sliding window vs full and FP8 vs bf16 decode rows), bench/gpu_flashinfer.py, and
#    bench/gpu_sdpa.py (the sdpa backend's paged prefill, extend and decode against raw SDPA
#    on contiguous K/V, with the largest difference between them);
# 3. runs the CUDA-graph replay check (bench/gpu_graphs.py: capture per runner, compare, time)
#    and one graph replayed for 256 steps of growing sequences (--grow 256), equal to eager;
# 4. runs the CUDA tests (pytest -m cuda) and the suites whose kernels run only on CUDA;
# 5. prints one summary table: a row per step, then the rows the steps printed as "SUMMARY ...".
#
# Each step has its own time limit, cut to what is left of an overall 465 s budget; a failing or
# timed-out step is a row, the script goes on.
# Full logs go to $OUT (or /tmp/attn_gpu) as <step>.log. Exit status: 0 when every step that
# ran passed (skipped steps do not count against it).
set -u -o pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
LOGS=${OUT:-/tmp/attn_gpu}
mkdir -p "$LOGS"
rm -f "$LOGS"/*.log "$LOGS"/summary.txt  # stale logs would add stale SUMMARY rows
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
START=$(date +%s)

STEPS=()      # "name|status|seconds|detail"
FAILED=0

record() { STEPS+=("$1|$2|$3|$4"); [ "$2" = FAIL ] && FAILED=1; return 0; }

# The whole script must end within 8 minutes: each step's limit is cut to what is left of
# BUDGET (seconds since the start), and a step with under 15 s left is skipped.
BUDGET=${BUDGET:-465}

# run_step NAME LIMIT_SECONDS COMMAND... : runs, logs, and records one step.
run_step() {
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS rc left
    left=$((BUDGET - SECONDS))
    if [ "$left" -lt 15 ]; then
        record "$name" skip 0 "out of the ${BUDGET}s budget"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (limit ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
    rc=$?
    tail -n 40 "$LOGS/$name.log"
    local dt=$((SECONDS - t0)) detail
    detail=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error)|[0-9]+ (passed|failed|skipped)' \
        "$LOGS/$name.log" | tail -n 1 | tr -d '=' | sed 's/^ *//;s/ *$//')
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        record "$name" FAIL "$dt" "timed out after ${limit}s ${detail}"
    elif [ $rc -eq 0 ]; then
        record "$name" ok "$dt" "${detail:-exit 0}"
    elif [ $rc -eq 5 ] && [ "${name#pytest}" != "$name" ]; then
        record "$name" skip "$dt" "no tests collected"
    else
        record "$name" FAIL "$dt" "exit $rc ${detail}"
    fi
}

# -- 0. the machine ------------------------------------------------------------------------------
echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -n 2
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)

# -- 1. wheels -----------------------------------------------------------------------------------
WHEELS=${WHEELS:-$ROOT/.whl}
t0=$SECONDS
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$WHEELS"/*.whl >"$LOGS/wheels.log" 2>&1; then
        record wheels ok $((SECONDS - t0)) "$(ls "$WHEELS"/*.whl | wc -l) wheels into /tmp/site"
    else
        tail -n 20 "$LOGS/wheels.log"
        record wheels FAIL $((SECONDS - t0)) "pip install failed (see wheels.log)"
    fi
    export PYTHONPATH=/tmp/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}
else
    record wheels skip 0 "no .whl files in $WHEELS"
    export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" - <<'EOF' 2>&1 | tee "$LOGS/versions.log"
import importlib
import torch
print(f"python torch {torch.__version__} cuda {torch.version.cuda} "
      f"available={torch.cuda.is_available()}")
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
for mod in ("triton", "flashinfer", "attn_dispatch"):
    try:
        m = importlib.import_module(mod)
        print(mod, getattr(m, "__version__", "?"), getattr(m, "__file__", ""))
    except Exception as exc:
        print(mod, "NOT IMPORTABLE:", type(exc).__name__, exc)
from attn_dispatch.backend import list_backends
for name, caps in list_backends().items():
    why = caps.availability_reasons("cuda")
    print(f"backend {name}: {'available' if not why else '; '.join(why)}")
EOF
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    record cuda FAIL 0 "torch.cuda.is_available() is False: nothing below can run"
fi

# -- 2. GPU benchmarks first (each owned by its backend): the figures the issues ask for come back
# even if a later step runs out of time (triton's JIT compiles many variants in the tests). ---------------------------------------------------
# gpu_triton also times the layer-variant rows (window 1024 vs full at context 8192, FP8 vs
# bf16 caches): a few more kernel compiles, hence its longer limit.
for bench in gpu_triton gpu_flashinfer gpu_sdpa; do
    limit=75
    [ "$bench" = gpu_sdpa ] && limit=45
    [ "$bench" = gpu_triton ] && limit=110
    if [ -f "bench/$bench.py" ]; then
        run_step "$bench" "$limit" "$PY" "bench/$bench.py"
    else
        record "$bench" skip 0 "bench/$bench.py not in this checkout"
    fi
done

# -- 3. CUDA-graph replay check ----------------------------------------------------------------------
run_step graphs 90 "$PY" bench/gpu_graphs.py --device cuda
# One graph per backend and kind, replayed for 256 steps of growing sequences (page crossings).
run_step graphs-grow 90 "$PY" bench/gpu_graphs.py --device cuda --grow 256 --requests 8 --ctx 256 --layers 2

# -- 4. CUDA tests ---------------------------------------------------------------------------------
# Tests marked cuda (CUDA-graph capture/replay per runner), then the suites whose real kernels
# run only on CUDA: the kernel contract (every backend against the naive reference, on cuda
# when it is available) and the GPU backends' own tests. Single process: FlashInfer's JIT
# build is not safe to run from several workers at once.
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o addopts= -rs)
run_step pytest-cuda 60 "${PYTEST[@]}" -m cuda tests
GPU_TESTS=()
for f in tests/contract tests/backends/triton tests/backends/flashinfer; do
    [ -e "$f" ] && GPU_TESTS+=("$f")
done
if [ ${#GPU_TESTS[@]} -gt 0 ]; then
    run_step pytest-gpu 150 "${PYTEST[@]}" "${GPU_TESTS[@]}"
else
    record pytest-gpu skip 0 "no GPU test files in this checkout"
fi

# -- 4b. SGLang's engine through attn_dispatch (when SGLang imports here) -------------------------
# The target on attn_dispatch's flashinfer, then fa3, with STANDALONE drafts (GQA, DeepSeek MLA,
# Sarvam MLA) on SGLang's own triton backend; greedy tokens against SGLang's flashinfer alone
# (tiny random Llama target, tiny random drafts of the same vocabulary).
if "$PY" -c "import sglang" >/dev/null 2>&1; then
    SGL_WORK=$(mktemp -d)
    run_step sglang-engine 600 "$PY" tests/integrations/sglang_engine/engine_run.py "$SGL_WORK" --gpu
    rm -rf "$SGL_WORK"
else
    record sglang-engine skip 0 "sglang does not import here"
fi

# -- 5. summary ----------------------------------------------------------------------------------
TOTAL=$(( $(date +%s) - START ))
{
    echo
    echo "attn_dispatch GPU check on ${GPU:-unknown GPU}, $(date -u '+%Y-%m-%d %H:%M UTC'), ${TOTAL}s"
    printf '%-16s %-6s %6s  %s\n' step status secs detail
    printf '%-16s %-6s %6s  %s\n' ---------------- ------ ------ ------
    for row in "${STEPS[@]}"; do
        IFS='|' read -r n s t d <<<"$row"
        printf '%-16s %-6s %6s  %s\n' "$n" "$s" "$t" "$d"
    done
    if compgen -G "$LOGS/*.log" >/dev/null && grep -hq '^SUMMARY ' "$LOGS"/*.log; then
        echo
        echo "results (lines the steps printed as SUMMARY)"
        grep -h '^SUMMARY ' "$LOGS"/*.log | sed 's/^SUMMARY /  /'
    fi
} | tee "$LOGS/summary.txt"
exit $FAILED
