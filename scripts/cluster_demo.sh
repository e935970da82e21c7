#!/usr/bin/env bash
# Cluster demo (`make cluster-demo`): three tokenloop workers behind one Shepherd Model Gateway (SMG) router
# with `--policy cache_aware`, on loopback.
#
# Each worker runs one engine thread (`--num-threads 1`) so three fit on a 2-core machine. SMG detects the workers'
# protocol (vLLM: tokenloop serves both of SMG's, docs/router.md), subscribes to every worker's KV-cache events
# (vllm.grpc.engine.VllmEngine/SubscribeKvEvents) and routes each chat to the worker
# that already holds its prompt's prefix. The demo sends two rounds of chats that share one of three system
# prompts, prints which worker's prefix cache served them (each worker's /metrics), kills one worker with
# SIGKILL on purpose (a crash, as the demo announces), shows that the router's next requests still succeed, then
# stops everything. The workers are disowned, so bash does not print its own "Killed" line for the one it kills.
#
#   MODEL=models/SmolLM2-135M-Instruct   checkpoint directory
#   BASE_PORT=50161                       workers on BASE_PORT, +1, +2; their /metrics on BASE_PORT+10, +11, +12
#   ROUTER_PORT=30001                     SMG's OpenAI HTTP port
#   VENV=.venv                            virtual environment with tokenloop and smg
set -euo pipefail

cd "$(dirname "$0")/.."
MODEL="${MODEL:-models/SmolLM2-135M-Instruct}"
BASE_PORT="${BASE_PORT:-50161}"
ROUTER_PORT="${ROUTER_PORT:-30001}"
VENV="${VENV:-.venv}"
SMG_VERSION="${SMG_VERSION:-1.13.0}"
WORK="$(mktemp -d)"
PIDS=()

DEMO=cluster-demo
# shellcheck source=scripts/demo_common.sh
source scripts/demo_common.sh  # fail, need_model_and_venv, stop_processes

cleanup() {
    stop_processes "${PIDS[@]}"
    rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

need_model_and_venv
[ -x "$VENV/bin/smg" ] || "$VENV/bin/pip" install --quiet "smg==$SMG_VERSION"

URLS=()
for i in 0 1 2; do
    port=$((BASE_PORT + i)); metrics=$((BASE_PORT + 10 + i))
    echo "== worker $i: tokenloop serve on 127.0.0.1:$port (metrics :$metrics, 1 engine thread)"
    "$VENV/bin/tokenloop" serve --model "$MODEL" --host 127.0.0.1 --port "$port" --metrics-port "$metrics" \
        --num-threads 1 >"$WORK/worker$i.log" 2>&1 &
    PIDS+=($!)
    disown "$!"  # the demo kills one of them on purpose: no "line N: ... Killed" from bash
    URLS+=("grpc://127.0.0.1:$port")
done
for i in 0 1 2; do
    for _ in $(seq 1 1500); do grep -qi "ready" "$WORK/worker$i.log" && break; kill -0 "${PIDS[$i]}" || fail "worker $i exited"; sleep 0.2; done
    grep -qi "ready" "$WORK/worker$i.log" || fail "worker $i was not ready after 300 s"
done

echo "== smg launch --policy cache_aware on 127.0.0.1:$ROUTER_PORT -> ${URLS[*]}"
"$VENV/bin/smg" launch --host 127.0.0.1 --port "$ROUTER_PORT" --policy cache_aware --worker-urls "${URLS[@]}" \
    --model-path "$MODEL" --health-check-interval-secs 1 --health-failure-threshold 1 >"$WORK/smg.log" 2>&1 &
PIDS+=($!)
disown "$!"
for _ in $(seq 1 600); do curl -sf "http://127.0.0.1:$ROUTER_PORT/readiness" >/dev/null && break; sleep 0.2; done
curl -sf "http://127.0.0.1:$ROUTER_PORT/readiness" >/dev/null || fail "smg was not ready"
echo "== the workers' protocol, as SMG detected it: $(curl -sf "http://127.0.0.1:$ROUTER_PORT/workers" | \
    "$VENV/bin/python" -c 'import json, sys; print(sorted({w["runtime_type"] for w in json.load(sys.stdin)["workers"]}))')"

"$VENV/bin/python" -u - "$ROUTER_PORT" "$BASE_PORT" "$MODEL" "${PIDS[1]}" <<'PY'
import json, os, signal, sys, time, urllib.request
router, base, model, victim = int(sys.argv[1]), int(sys.argv[2]), os.path.basename(sys.argv[3]), int(sys.argv[4])
SYSTEMS = [f"You are assistant number {k}. " + " ".join(f"Rule {k}.{i}: answer briefly and politely." for i in range(25))
           for k in range(3)]

def chat(system, user):
    body = json.dumps({"model": model, "max_tokens": 8, "temperature": 0,
                       "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{router}/v1/chat/completions", body, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return resp.status

def metric(i, name):
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{base + 10 + i}/metrics", timeout=5).read().decode()
    except OSError:
        return None
    return next(float(l.split()[-1]) for l in text.splitlines() if l.startswith(f"tokenloop:{name} "))

print("== 12 chats, one at a time: 3 system prompts x 2 rounds x 2 questions. cache_aware sends a chat to the\n"
      "   worker whose KV events show it holds the chat's prefix; a prefix no worker holds yet goes by load.")
served = {k: [] for k in range(3)}
for rnd in range(2):
    for k, system in enumerate(SYSTEMS):
        for q in range(2):
            before = [metric(i, "prefix_cache_queries_total") for i in range(3)]
            chat(system, f"Round {rnd}, question {q}: say hello.")
            after = [metric(i, "prefix_cache_queries_total") for i in range(3)]
            worker = next(i for i in range(3) if after[i] != before[i])
            served[k].append(worker)
            print(f"system prompt {k}, round {rnd}, question {q} -> worker {worker}")
print("== where each system prompt went")
for k, workers in served.items():
    stayed = "every time" if len(set(workers)) == 1 else "not always"
    print(f"system prompt {k}: workers {workers} (the same worker {stayed})")
for i in range(3):
    print(f"worker {i}: prefix_cache_hit_rate {metric(i, 'prefix_cache_hit_rate'):.2f}, "
          f"kv_blocks_cached {metric(i, 'kv_blocks_cached'):.0f}")
idle = [i for i in range(3) if all(i not in w for w in served.values())]
if idle:
    print(f"worker {', '.join(map(str, idle))} got no chat, as expected here: the demo sends one chat at a time, so every\n"
          "   worker is idle when a new system prompt arrives; load cannot tell them apart and two prompts can land\n"
          "   on the same worker. What the demo shows is affinity (a prompt stays where its prefix is cached), not balance.")
print(f"== now killing worker 1 (pid {victim}) with SIGKILL on purpose, as a crash would: smg's health check drops it\n"
      "   and the next 6 chats must all succeed on the other two workers")
os.kill(victim, signal.SIGKILL)
ok = sum(chat(SYSTEMS[k % 3], f"After the kill, request {k}") == 200 for k in range(6))
print(f"{ok} of 6 requests after the kill succeeded")
sys.exit(0 if ok == 6 else 1)
PY
echo "== done: the kill above was part of the demo; stopping the other workers and the router"
