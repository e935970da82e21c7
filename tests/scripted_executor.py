"""A scripted `Executor` for looper and service tests: no model, deterministic tokens, injectable faults."""

from __future__ import annotations

import threading
from collections.abc import Callable

from tokenloop.core.executor import EngineDeadError, ExecutorStats, Step
from tokenloop.core.request import FinishReason, ValidRequest

Script = Callable[[ValidRequest, int], list[int]]


def echo_prompt(request: ValidRequest, seq: int) -> list[int]:
    """Default script: repeat the prompt's ids, rotated by the sequence index."""
    ids = list(request.prompt_token_ids)
    return ids[seq % len(ids):] + ids[:seq % len(ids)]


class _Req:
    __slots__ = ("request", "tokens", "pos", "open", "cancelled", "fail")

    def __init__(self, request: ValidRequest, script: Script):
        self.request = request
        self.tokens = [script(request, i) for i in range(request.n)]
        self.pos = [0] * request.n
        self.open = [True] * request.n
        self.cancelled = False
        self.fail: str | None = None


class ScriptedExecutor:
    """Emits one token per sequence per tick on its own thread; follows the Executor protocol."""

    def __init__(self, script: Script = echo_prompt, tick: float = 0.002, eos_token_id: int | None = None,
                 tokens_per_step: int = 1):
        self.script = script
        self.tick = tick
        self.eos_token_id = eos_token_id
        self.tokens_per_step = tokens_per_step
        self._cv = threading.Condition()
        self._reqs: dict[int, _Req] = {}
        self._ready: list[Step] = []
        self._next_id = 1
        self._dead: str | None = None
        self._stop = False
        self.enqueued: list[ValidRequest] = []
        self.cancels: list[int] = []
        self.await_threads: set[str] = set()
        self.num_steps = 0
        self._thread = threading.Thread(target=self._run, name="scripted-executor", daemon=True)
        self._thread.start()

    # -- Executor protocol -----------------------------------------------------------------
    def enqueue(self, request: ValidRequest) -> int:
        with self._cv:
            if self._dead:
                raise EngineDeadError(self._dead)
            if request.prompt_token_ids and request.prompt_token_ids[0] == 0 and request.stopping.max_new_tokens == 13:
                raise ValueError("scripted refusal")  # lets tests exercise enqueue errors
            rid, self._next_id = self._next_id, self._next_id + 1
            self._reqs[rid] = _Req(request, self.script)
            self.enqueued.append(request)
            return rid

    def await_responses(self, timeout: float) -> list[Step]:
        self.await_threads.add(threading.current_thread().name)
        with self._cv:
            if not self._ready and not self._dead:
                self._cv.wait(timeout)
            if self._dead:
                raise EngineDeadError(self._dead)
            steps, self._ready = self._ready, []
            return steps

    def cancel(self, request_id: int) -> None:
        with self._cv:
            self.cancels.append(request_id)
            req = self._reqs.get(request_id)
            if req is not None:
                req.cancelled = True

    def stats(self) -> ExecutorStats:
        with self._cv:
            return ExecutorStats(num_running=len(self._reqs), kv_blocks_used=len(self._reqs),
                                 kv_blocks_total=64, tokens_per_block=16, num_steps=self.num_steps)

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(2)

    # -- faults for tests ------------------------------------------------------------------
    def fail_request(self, request_id: int, message: str) -> None:
        with self._cv:
            self._reqs[request_id].fail = message

    def die(self, message: str = "injected fault") -> None:
        with self._cv:
            self._dead = message
            self._cv.notify_all()

    @property
    def num_active(self) -> int:
        with self._cv:
            return len(self._reqs)

    # -- the "model" -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                if self._stop:
                    return
                if self._reqs and not self._dead:
                    self._step()
            threading.Event().wait(self.tick)

    def _step(self) -> None:
        self.num_steps += 1
        for rid, req in list(self._reqs.items()):
            if req.fail is not None:
                self._ready.append(Step(rid, 0, [], is_final=True, error=req.fail))
                del self._reqs[rid]
                continue
            for i in range(req.request.n):
                if req.open[i]:
                    self._ready.append(self._advance(rid, req, i))
            if not any(req.open):
                del self._reqs[rid]
        if self._ready:
            self._cv.notify_all()

    def _advance(self, rid: int, req: _Req, i: int) -> Step:
        if req.cancelled:
            req.open[i] = False
            return Step(rid, i, [], is_final=True, finish_reason=FinishReason.CANCELLED)
        stop = req.request.stopping
        new, finish, matched = [], None, None
        for _ in range(self.tokens_per_step):
            tokens = req.tokens[i]
            tid = tokens[req.pos[i] % len(tokens)]
            req.pos[i] += 1
            new.append(tid)
            if tid in stop.stop_token_ids:
                finish, matched = FinishReason.STOP_TOKEN, tid
            elif tid == self.eos_token_id and not stop.ignore_eos:
                finish = FinishReason.EOS
            elif req.pos[i] >= stop.max_new_tokens:
                finish = FinishReason.LENGTH
            if finish is not None:
                break
        lps = [-0.5] * len(new) if req.request.output.logprobs else None
        tops = [[(t, -0.5)] * req.request.output.top_logprobs for t in new] if lps is not None else None
        if finish is not None:
            req.open[i] = False
        return Step(rid, i, new, lps, tops, is_final=finish is not None, finish_reason=finish,
                    matched_stop_token=matched)
