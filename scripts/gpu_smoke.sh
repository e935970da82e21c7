#!/usr/bin/env bash
# GPU smoke test of `--backend trtllm` (`make gpu-smoke`): for a person on a GPU host with
# TensorRT-LLM installed (e.g. inside the Dockerfile.trtllm image). CI never runs this.
#
# Starts `tokenloop serve --backend trtllm` on a small model, runs protocol checks against it,
# then the end-to-end suite with TOKENLOOP_E2E_ADDRESS pointing at it, and prints a pass/fail
# table. Exit status 0 only when nothing failed.
#
#   MODEL=models/SmolLM2-135M-Instruct   checkpoint (LLM API) or engine directory (C++ executor)
#   PORT=50151                            gRPC port of the server under test
#   PYTHON=python3                        interpreter with tokenloop and tensorrt_llm installed
#   READY_TIMEOUT=900                     seconds to wait for the model to load
#   SERVE_ARGS="--tensor-parallel-size 2" more `tokenloop serve` flags
#   LAUNCH="mpirun -n 1 --allow-run-as-root"   prefix for the server command (multi-GPU engines)
#   E2E=1                                 0 skips the end-to-end suite
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
MODEL="${MODEL:-models/SmolLM2-135M-Instruct}"
PORT="${PORT:-50151}"
PYTHON="${PYTHON:-python3}"
READY_TIMEOUT="${READY_TIMEOUT:-900}"
SERVE_ARGS="${SERVE_ARGS:-}"
LAUNCH="${LAUNCH:-}"
E2E="${E2E:-1}"
ADDRESS="127.0.0.1:${PORT}"
WORK="$(mktemp -d)"
LOG="${WORK}/server.log"
RESULTS="${WORK}/results.tsv"
SERVER_PID=""
: > "${RESULTS}"

record() { printf '%s\t%s\t%s\n' "$1" "$2" "${3:-}" >> "${RESULTS}"; }

stop_server() {
  if [ -n "${SERVER_PID}" ] && kill -0 "${SERVER_PID}" 2>/dev/null; then
    kill -TERM "${SERVER_PID}" 2>/dev/null
    for _ in $(seq 1 60); do kill -0 "${SERVER_PID}" 2>/dev/null || break; sleep 1; done
    kill -KILL "${SERVER_PID}" 2>/dev/null || true
  fi
}
trap stop_server EXIT

print_table() {
  echo
  printf '%-58s %-6s %s\n' "CHECK" "RESULT" "DETAIL"
  printf '%-58s %-6s %s\n' "-----" "------" "------"
  while IFS=$'\t' read -r name result detail; do
    printf '%-58s %-6s %s\n' "${name}" "${result}" "${detail}"
  done < "${RESULTS}"
  local failed passed
  failed=$(grep -c $'\tFAIL\t' "${RESULTS}" || true)
  passed=$(grep -c $'\tPASS\t' "${RESULTS}" || true)
  echo
  echo "passed ${passed}, failed ${failed} (server log: ${LOG})"
  [ "${failed}" -eq 0 ]
}

# 1) the environment
if ! "${PYTHON}" -c "import tensorrt_llm" >/dev/null 2>&1; then
  echo "gpu-smoke: ${PYTHON} cannot import tensorrt_llm: run inside the Dockerfile.trtllm image (docs/trtllm.md)" >&2
  exit 2
fi
if [ ! -d "${MODEL}" ]; then
  echo "gpu-smoke: no model at ${MODEL}: run \`make model\` or set MODEL=DIR" >&2
  exit 2
fi
TRTLLM_VERSION="$("${PYTHON}" -c 'import tensorrt_llm; print(tensorrt_llm.__version__)' 2>/dev/null | tail -1)"
GPUS="$(nvidia-smi -L 2>/dev/null | wc -l)"
record "environment: tensorrt_llm ${TRTLLM_VERSION}, ${GPUS} GPU(s)" PASS "${MODEL}"

# 2) the server
# shellcheck disable=SC2086  # LAUNCH and SERVE_ARGS are word lists on purpose
${LAUNCH} "${PYTHON}" -m tokenloop.service.cli serve --backend trtllm --model "${MODEL}" --host 127.0.0.1 \
  --port "${PORT}" --shutdown-grace 5 ${SERVE_ARGS} > "${LOG}" 2>&1 &
SERVER_PID=$!
ready=0
for _ in $(seq 1 "${READY_TIMEOUT}"); do
  if grep -q "tokenloop ready" "${LOG}" 2>/dev/null; then ready=1; break; fi
  kill -0 "${SERVER_PID}" 2>/dev/null || break
  sleep 1
done
if [ "${ready}" -ne 1 ]; then
  record "server start-up" FAIL "see the log tail below"
  print_table
  tail -40 "${LOG}"
  exit 1
fi
record "server start-up (--backend trtllm)" PASS "${ADDRESS}"

# 3) protocol checks through the generated stubs, one line per check: name<TAB>PASS|FAIL<TAB>detail
"${PYTHON}" - "${ADDRESS}" >> "${RESULTS}" 2>> "${LOG}" <<'PY'
import math, sys, threading, time
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tokenloop.v1 import tokenloop_pb2 as pb, tokenloop_pb2_grpc as rpc

channel = grpc.insecure_channel(sys.argv[1])
stub = rpc.TextGenerationStub(channel)
FRANCE = pb.Chat(messages=[pb.ChatMessage(role="user", content="What is the capital of France?")])


def printable(text) -> str:
    return "".join(ch if ch.isprintable() else "?" for ch in str(text))[:120]


def check(name):
    def wrap(fn):
        try:
            detail = fn()
            print(f"{name}\tPASS\t{printable(detail or '')}", flush=True)
        except Exception as exc:  # every failure is a table row, never a crash of the script
            print(f"{name}\tFAIL\t{type(exc).__name__}: {printable(exc)}", flush=True)
        return fn
    return wrap


def generate(**kw):
    return list(stub.Generate(pb.GenerateRequest(**kw), timeout=120))


def completes(responses):
    return sorted((r.complete for r in responses if r.HasField("complete")), key=lambda c: c.index)


@check("health: SERVING")
def _():
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING, status


@check("GetModelInfo: backend trtllm")
def _():
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.backend == "trtllm", info.backend
    return info.model_id


@check("greedy chat answer mentions Paris")
def _():
    (done,) = completes(generate(chat=FRANCE, sampling=pb.SamplingParams(temperature=0.0),
                                 stopping=pb.StoppingCriteria(max_new_tokens=32)))
    assert "Paris" in done.text, done.text
    assert done.finish_reason in (pb.EOS, pb.LENGTH)
    return repr(done.text[:60])


@check("streaming: chunks add up to the complete text")
def _():
    responses = generate(chat=FRANCE, stream=True, sampling=pb.SamplingParams(temperature=0.0),
                         stopping=pb.StoppingCriteria(max_new_tokens=32))
    chunks = [r.chunk for r in responses if r.HasField("chunk")]
    (done,) = completes(responses)
    assert len(chunks) > 1 and "".join(c.text for c in chunks) == done.text
    assert [t for c in chunks for t in c.token_ids] == list(done.token_ids)
    return f"{len(chunks)} chunks"


@check("max_new_tokens + ignore_eos: LENGTH with exactly 8 tokens")
def _():
    (done,) = completes(generate(text="Once upon a time", stopping=pb.StoppingCriteria(max_new_tokens=8, ignore_eos=True)))
    assert done.finish_reason == pb.LENGTH and len(done.token_ids) == 8, (done.finish_reason, len(done.token_ids))


@check("n=3 sampling: three sequences")
def _():
    done = completes(generate(text="My favourite colour is", n=3, sampling=pb.SamplingParams(temperature=0.9, seed=1),
                              stopping=pb.StoppingCriteria(max_new_tokens=12)))
    assert [c.index for c in done] == [0, 1, 2]
    return " | ".join(repr(c.text[:20]) for c in done)


@check("stop string: STOP_SEQUENCE, not in the text")
def _():
    (done,) = completes(generate(chat=FRANCE, sampling=pb.SamplingParams(temperature=0.0),
                                 stopping=pb.StoppingCriteria(max_new_tokens=32, stop=["Paris"])))
    assert done.finish_reason == pb.STOP_SEQUENCE and "Paris" not in done.text, (done.finish_reason, done.text)


@check("logprobs: one finite value <= 0 per token")
def _():
    (done,) = completes(generate(text="The sky is", output=pb.OutputOptions(logprobs=True),
                                 stopping=pb.StoppingCriteria(max_new_tokens=6, ignore_eos=True)))
    values = [lp.logprob for lp in done.logprobs]
    assert len(values) == 6 and all(math.isfinite(v) and v <= 1e-4 for v in values), values


@check("Abort: a long stream ends CANCELLED")
def _():
    request = pb.GenerateRequest(request_id="gpu-smoke-abort", text="Count forever:", stream=True,
                                 stopping=pb.StoppingCriteria(max_new_tokens=2000, ignore_eos=True))
    seen = []
    for response in stub.Generate(request, timeout=120):
        seen.append(response)
        if len(seen) == 3:
            assert stub.Abort(pb.AbortRequest(request_id="gpu-smoke-abort"), timeout=10).found
    (done,) = completes(seen)
    assert done.finish_reason == pb.CANCELLED and len(done.token_ids) < 2000


@check("16 concurrent requests all complete")
def _():
    results, errors = [], []
    def one(i):
        try:
            results.append(completes(generate(text=f"Fact number {i}:", stopping=pb.StoppingCriteria(max_new_tokens=16))))
        except Exception as exc:
            errors.append(exc)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 16, errors[:1]


@check("GetLoad: back to idle, KV blocks reported")
def _():
    deadline = time.monotonic() + 15
    while True:
        load = stub.GetLoad(pb.GetLoadRequest(), timeout=10)
        if load.num_running == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert load.num_running == 0 and load.kv_blocks_total > 0, load
    return f"kv_blocks_total={load.kv_blocks_total} block={load.kv_block_size}"
PY

# 4) the end-to-end suite against this server (tests that start their own engine are left out)
if [ "${E2E}" = "1" ]; then
  junit="${WORK}/e2e.xml"
  TOKENLOOP_E2E_ADDRESS="${ADDRESS}" "${PYTHON}" -m pytest -q tests/e2e -p no:cacheprovider \
    --deselect tests/e2e/test_default_model_vs_hf.py --junitxml "${junit}" > "${WORK}/e2e.log" 2>&1
  "${PYTHON}" - "${junit}" >> "${RESULTS}" <<'PY'
import sys
import xml.etree.ElementTree as ET
try:
    cases = ET.parse(sys.argv[1]).getroot().iter("testcase")
except (OSError, ET.ParseError) as exc:
    print(f"e2e suite\tFAIL\tno report: {exc}")
    sys.exit(0)
for case in cases:
    name = f"e2e {case.get('classname', '').split('.')[-1]}::{case.get('name')}"
    failed = case.find("failure") is not None or case.find("error") is not None
    skipped = case.find("skipped")
    result = "FAIL" if failed else "SKIP" if skipped is not None else "PASS"
    detail = (skipped.get("message", "") if skipped is not None else "")[:60]
    print(f"{name}\t{result}\t{detail}")
PY
fi

stop_server
print_table
