#!/usr/bin/env bash
# Batch's fairness inside a real vLLM server on a GPU (docs/vllm-plugin.md): a small model under
# `vllm serve` twice, first with vLLM's own scheduler, then with
# `--scheduler-cls batch.integrations.vllm.AsyncFairScheduler` and the user middleware, both with
# async scheduling on (vLLM's default), and each time
# the A/B burst over HTTP with `batch-llm bench-serve --ab-burst` (B's median TTFT with A over B alone).
#
#   scripts/vllm_plugin_gpu.sh                      # defaults below
#   MODEL=Qwen/Qwen2.5-0.5B-Instruct SEEDS=4,5,6 PORT=8011 scripts/vllm_plugin_gpu.sh
#
# Needs: an NVIDIA GPU, network access for pip and the model (or MODEL= a local folder), Python 3.11.
# It makes its own venv ($VENV) with vLLM 0.33.0's CUDA wheel and this checkout (--no-deps).
# Written without a GPU (issues 29, 42): it has not been run yet (docs/vllm-plugin.md, "Status").
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
PORT=${PORT:-8011}
SEEDS=${SEEDS:-4,5,6}
VENV=${VENV:-.venv-vllm-gpu}
OUT=${OUT:-vllm-plugin-gpu-results}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-4096}

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "vllm==0.33.0"
  "$VENV/bin/pip" install -q --no-deps -e .
  "$VENV/bin/pip" install -q "transitions>=0.9.3,<0.10" "httpx>=0.27,<1"
fi
PY="$VENV/bin/python"
mkdir -p "$OUT"

wait_ready() {  # the server answers /v1/models, or the server died
  for _ in $(seq 600); do
    if curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null; then return 0; fi
    if ! kill -0 "$1" 2>/dev/null; then echo "server exited; see $2" >&2; return 1; fi
    sleep 1
  done
  echo "server not ready after 600 s; see $2" >&2
  return 1
}

run_one() {  # $1: label, the rest: extra vllm serve flags
  local label=$1; shift
  local log="$OUT/serve-$label.log"
  "$VENV/bin/vllm" serve "$MODEL" --port "$PORT" --max-model-len "$MAX_MODEL_LEN" \
      --no-enable-prefix-caching "$@" >"$log" 2>&1 &
  local pid=$!
  trap 'kill $pid 2>/dev/null || true' EXIT
  wait_ready "$pid" "$log"
  "$PY" -m batch.commands bench-serve --base-url "http://127.0.0.1:$PORT" --model "$MODEL" \
      --ab-burst --ab-seeds "$SEEDS" | tee "$OUT/ab-$label.txt"
  kill "$pid"; wait "$pid" 2>/dev/null || true
  trap - EXIT
}

run_one vllm
export BATCH_TRUST_USER_FIELD=1  # bench-serve names its users A and B in the body's user field
run_one fair --scheduler-cls batch.integrations.vllm.AsyncFairScheduler \
             --middleware batch.integrations.vllm.UserMiddleware
grep -H "" "$OUT"/ab-*.txt
