#!/usr/bin/env bash
# One-shot GPU check for a single-GPU machine with no network and no Ray (see
# docs/benchmarks/gpu.md for the last run's table).
#
#   bash scripts/gpu_check.sh --size   # here, before sending: what would travel, and what to drop
#   bash scripts/gpu_check.sh          # there: install the carried wheels, then every section
#   ONLY="env engine" bash scripts/gpu_check.sh   # those sections alone
#
# The machine is expected to have python3 with torch (CUDA), transformers and cupy; what it
# lacks (nixl, nixl-cu13, pydantic and its three dependencies) travels as wheels in .whl/
# (git-ignored; `scripts/gpu_wheels.sh` fetches them). Each section has its own timeout, cut
# to what is left of the whole run's TOTAL_S (so the script ends within 4 minutes); a failing
# or skipped section is a table row, never the end of the script. Logs and JSON go to $OUT
# (default /tmp/gpu_check), at most 12 files.
#
# Sections: env; tests_gpu (pytest tests/gpu: engine vs transformers, CUDA-graph decode vs
# eager, the fused decode kernels, speculative decoding, VRAM and pinned-host-staged KV over
# NIXL); engine (copy and matmul floors, decode tok/s at batch 1 and 64 from CUDA graphs on the
# fused kernels with asynchronous scheduling, the same with synchronous steps and with cuBLASLt,
# from graphs of the model's forward, and eager, the graph's replay alone, the kernels of a step,
# prefill, speculation with verify steps in graphs, for 1B- and 8B-class Llamas and a Qwen3 8B);
# kv (NIXL VRAM -> VRAM pull against raw READ, push tail, and the same pull and push staged
# through pinned host buffers, transport.staging=host); kv_read_ucx_default (a pull with UCX's
# own cuda_ipc setting); kv_push_poll (the push tail with the consumer polling notices every
# 0.1 ms); tensor_parallel (2 GPUs or more).
set -u
cd "$(dirname "$0")/.."
STARTED=$(date +%s)
TOTAL_S=${TOTAL_S:-235}

LIMIT_BYTES=$((64 * 1024 * 1024))
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.md"

travelling_files() {
  # what the device tool sends: tracked files and untracked files git does not ignore, plus .whl/
  { git ls-files --cached --others --exclude-standard 2>/dev/null; ls .whl/* 2>/dev/null; } | sort -u
}

size_report() {
  local total
  total=$(travelling_files | tr '\n' '\0' | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
  echo "tree that travels: $total bytes (limit $LIMIT_BYTES)"
  if [ "$total" -gt "$LIMIT_BYTES" ]; then
    echo "over the limit by $((total - LIMIT_BYTES)) bytes; the largest files (drop or ignore some):"
    travelling_files | tr '\n' '\0' | xargs -0 du -b 2>/dev/null | sort -rn | head -10
    return 1
  fi
}

if [ "${1:-}" = "--size" ]; then
  size_report
  exit $?
fi

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "wheel install failed: sections that need nixl or pydantic will fail"
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1

echo "| section | result | seconds |" > "$SUMMARY"
echo "|---|---|---|" >> "$SUMMARY"

# section NAME TIMEOUT_S COMMAND...: run it, log to $OUT/NAME.log, add a summary row
section() {
  local name=$1 limit=$2 start rc result left
  shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then
    echo "| $name | not run (ONLY=$ONLY) | 0 |" >> "$SUMMARY"
    return
  fi
  start=$(date +%s)
  left=$((STARTED + TOTAL_S - start - 5))
  if [ "$left" -lt 10 ]; then
    echo "| $name | skipped: the run's ${TOTAL_S} s are spent | 0 |" >> "$SUMMARY"
    echo "== $name: skipped (out of time)"
    return
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  timeout --kill-after=5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  case $rc in
    0) result="ok" ;;
    124 | 137) result="timed out after ${limit} s" ;;
    *) result="failed (exit $rc): $(grep -v '^\s*$' "$OUT/$name.log" | tail -1 | cut -c1-120 | tr '|' '/')" ;;
  esac
  echo "| $name | $result | $(($(date +%s) - start)) |" >> "$SUMMARY"
  echo "== $name: $result"
}

section env 20 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
  python3 -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, torch.version.cuda,
  transformers.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"no CUDA\")";
  python3 -c "import nixl._api, pydantic; print(\"nixl\", nixl.__file__, \"pydantic\", pydantic.VERSION)";
  python3 -c "import cupy; print(\"cupy\", cupy.__version__, \"CUDA runtime\", cupy.cuda.runtime.runtimeGetVersion())" \
    || echo "no cupy: staging uses torch pinned memory and streams";
  python3 -c "import triton; print(\"triton\", triton.__version__)" || echo "no triton: decode graphs run the model forward"'
section tests_gpu 120 python3 -m pytest tests/gpu -q -m "gpu or not gpu" -p no:cacheprovider
section engine 130 python3 -m bench.gpu_engine --out "$OUT/gpu_engine.json"
section kv 75 python3 -m bench.gpu_kv --out "$OUT/gpu_kv.json"
# the same READ with UCX's own setting for cuda_ipc's GET (the transport sets it on: kv_transport/nixl_worker.py)
section kv_read_ucx_default 35 env UCX_CUDA_IPC_ENABLE_GET_ZCOPY=auto python3 -m bench.gpu_kv --staging none --sizes 64 \
  --no-push --out "$OUT/gpu_kv_read_ucx_default.json"
# the push's tail with the consumer reading notices every 0.1 ms instead of 1 ms (the figures'
# "notice read" column splits the tail between that poll and the waiter's wake-up)
section kv_push_poll 30 python3 -m bench.gpu_kv --staging none --sizes "" --notice-poll-ms 0.1 \
  --out "$OUT/gpu_kv_push_poll.json"
GPUS=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l)
if [ "$GPUS" -ge 2 ]; then  # NCCL refuses two ranks on one GPU
  section tensor_parallel 60 python3 -m pytest tests/gpu/test_cuda_tensor_parallel.py -q -p no:cacheprovider
else
  echo "| tensor_parallel | needs 2 GPUs (this machine has $GPUS) | 0 |" >> "$SUMMARY"
fi

echo
cat "$SUMMARY"
echo
echo "### env"
tail -20 "$OUT/env.log"
echo
echo "### tests_gpu"
grep -E 'passed|failed|skipped|FAILED|ERROR|Error' "$OUT/tests_gpu.log" | tail -25
for name in engine kv kv_read_ucx_default kv_push_poll; do
  echo
  echo "### $name"
  grep -E '^\||^## |failed|Error' "$OUT/$name.log" | tail -60
done
