#!/usr/bin/env bash
# Router demo (`make router-demo`): tokenloop behind the Shepherd Model Gateway (SMG) on loopback.
#
# Starts `tokenloop serve` (gRPC + Prometheus /metrics), starts `smg launch` in front of it (no runtime type given:
# SMG detects the worker's protocol, vLLM, since tokenloop serves both of SMG's; docs/router.md), shows the detected
# protocol, sends a streaming OpenAI chat completion through SMG with curl, shows the load gauges, then stops both.
#
#   MODEL=models/SmolLM2-135M-Instruct   checkpoint directory (tokenloop loads the model, SMG its tokenizer)
#   GRPC_PORT=50151                       tokenloop gRPC port (SMG's worker)
#   METRICS_PORT=9464                     tokenloop Prometheus port
#   ROUTER_PORT=30000                     SMG's OpenAI HTTP port
#   VENV=.venv                            virtual environment with tokenloop (and smg, installed if missing)
#   SMG_VERSION=1.13.0                    the pinned router release
set -euo pipefail

cd "$(dirname "$0")/.."
MODEL="${MODEL:-models/SmolLM2-135M-Instruct}"
GRPC_PORT="${GRPC_PORT:-50151}"
METRICS_PORT="${METRICS_PORT:-9464}"
ROUTER_PORT="${ROUTER_PORT:-30000}"
VENV="${VENV:-.venv}"
SMG_VERSION="${SMG_VERSION:-1.13.0}"
WORK="$(mktemp -d)"
TOKENLOOP_PID=""
SMG_PID=""

DEMO=router-demo
# shellcheck source=scripts/demo_common.sh
source scripts/demo_common.sh  # fail, need_model_and_venv, stop_processes

cleanup() {
    stop_processes "$SMG_PID"  # the router first, so that it never sees its worker go
    stop_processes "$TOKENLOOP_PID"
    rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

wait_for() {  # wait_for DESCRIPTION SECONDS PID COMMAND...
    local what="$1" seconds="$2" pid="$3"
    shift 3
    for _ in $(seq 1 $((seconds * 5))); do
        "$@" >/dev/null 2>&1 && return 0
        kill -0 "$pid" 2>/dev/null || fail "$what exited before it was ready"
        sleep 0.2
    done
    fail "$what was not ready after ${seconds}s"
}

need_model_and_venv
if [ ! -x "$VENV/bin/smg" ]; then
    echo "== installing smg==$SMG_VERSION into $VENV"
    "$VENV/bin/pip" install --quiet "smg==$SMG_VERSION"
fi

echo "== tokenloop serve on 127.0.0.1:$GRPC_PORT (metrics on :$METRICS_PORT)"
"$VENV/bin/tokenloop" serve --model "$MODEL" --host 127.0.0.1 --port "$GRPC_PORT" \
    --metrics-port "$METRICS_PORT" >"$WORK/tokenloop.log" 2>&1 &
TOKENLOOP_PID=$!
wait_for "tokenloop" 300 "$TOKENLOOP_PID" grep -qi "ready" "$WORK/tokenloop.log"

echo "== smg launch on 127.0.0.1:$ROUTER_PORT -> grpc://127.0.0.1:$GRPC_PORT"
"$VENV/bin/smg" launch --host 127.0.0.1 --port "$ROUTER_PORT" \
    --worker-urls "grpc://127.0.0.1:$GRPC_PORT" --model-path "$MODEL" \
    --health-check-interval-secs 5 >"$WORK/smg.log" 2>&1 &
SMG_PID=$!
wait_for "smg" 120 "$SMG_PID" curl -sf "http://127.0.0.1:$ROUTER_PORT/readiness"

MODEL_ID="$(curl -sf "http://127.0.0.1:$ROUTER_PORT/v1/models" | "$VENV/bin/python" -c \
    'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')"
echo "== GET /v1/models -> $MODEL_ID"
RUNTIME="$(curl -sf "http://127.0.0.1:$ROUTER_PORT/workers" | "$VENV/bin/python" -c \
    'import json, sys; print(",".join(w["runtime_type"] for w in json.load(sys.stdin)["workers"]))')"
echo "== GET /workers -> the worker's protocol, as SMG detected it: $RUNTIME"

echo "== POST /v1/chat/completions (stream) through SMG"
curl -sN "http://127.0.0.1:$ROUTER_PORT/v1/chat/completions" \
    -H 'Content-Type: application/json' \
    -d "{\"model\": \"$MODEL_ID\", \"stream\": true, \"temperature\": 0, \"max_tokens\": 32,
         \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}]}" \
    | tee "$WORK/stream.txt"
grep -q "data: \[DONE\]" "$WORK/stream.txt" || fail "the stream did not end with [DONE]"

echo "== the answer, reassembled from the stream"
"$VENV/bin/python" - "$WORK/stream.txt" <<'EOF'
import json, sys
text = []
for line in open(sys.argv[1]):
    if line.startswith("data: {"):
        for choice in json.loads(line[6:])["choices"]:
            text.append(choice["delta"].get("content") or "")
print("".join(text))
EOF

echo "== tokenloop load gauges (http://127.0.0.1:$METRICS_PORT/metrics)"
curl -sf "http://127.0.0.1:$METRICS_PORT/metrics" | grep -E '^tokenloop:(num_requests|kv_)' || true
echo "== done"
