"""service/compile_pool.py without a server: compiles in processes, killed at their timeout, a bounded queue."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from pathlib import Path

import pytest

from tests.conftest import run
from tokenloop.core.tokenizer import ModelCard, Tokenizer
from tokenloop.service.compile_pool import (
    CompilePool,
    CompilePoolClosed,
    CompileQueueFull,
    CompileRefused,
    CompileThreads,
    CompileTimeout,
)
from tokenloop.service.compile_worker import NICENESS

# 300 `patternProperties` keys: ~13 s to compile with the test tokenizer (500 took 21-34 s with the default model's).
SLOW_SCHEMA = json.dumps({"type": "object", "patternProperties": {f"^k{i}_[a-z]+$": {"type": "integer"}
                                                                  for i in range(450)}})
QUICK_SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})


@pytest.fixture(scope="module")
def tokenizer_parts(tokenizer_dir):
    tok, card = Tokenizer.from_dir(tokenizer_dir), ModelCard.from_dir(tokenizer_dir)
    return tok.to_json(), tok.vocab_size, card.eos_token_ids


def pool_of(parts, num_workers=1, max_waiting=0) -> CompilePool:
    return CompilePool(*parts, num_workers=num_workers, max_waiting=max_waiting)


def test_a_compile_past_its_timeout_kills_its_process_and_a_new_one_takes_over(tokenizer_parts):
    async def body():
        pool = pool_of(tokenizer_parts)
        await pool.start()
        try:
            (first,) = pool.workers
            with pytest.raises(CompileTimeout) as timeout:
                await pool.check("json_schema", SLOW_SCHEMA, timeout=0.5)
            assert not timeout.value.waited  # it ran out of time compiling, not waiting for a process
            assert pool.num_killed == 1 and await first.proc.wait() != 0  # killed, not left compiling
            text = await pool.check("json_schema", QUICK_SCHEMA, timeout=30)  # a replacement process answers
            assert '"a"' in text and first not in pool.workers and len(pool.workers) == 1
            with pytest.raises(CompileRefused) as err:
                await pool.check("regex", "a(b", timeout=30)
            assert err.value.kind == "regex" and "unclosed group" in str(err.value)
        finally:
            pool.close()
    run(body())


def test_past_the_running_and_waiting_bound_a_compile_is_refused_at_once(tokenizer_parts):
    async def body():
        pool = pool_of(tokenizer_parts, num_workers=1, max_waiting=1)
        await pool.start()
        try:
            running = asyncio.ensure_future(pool.check("json_schema", SLOW_SCHEMA, timeout=60))
            waiting = asyncio.ensure_future(pool.check("json_schema", SLOW_SCHEMA + " ", timeout=60))
            while pool.num_pending < 2:
                await asyncio.sleep(0.01)
            with pytest.raises(CompileQueueFull, match="1 compiles run and 1 wait"):
                await pool.check("json_schema", QUICK_SCHEMA, timeout=60)
            assert not running.done() and not waiting.done()
            pool.close()  # shutdown: both end at once, the running one's process killed
            for job in (running, waiting):
                with pytest.raises(CompilePoolClosed):
                    await job
            assert pool.num_pending == 0 and not pool.workers
            with pytest.raises(CompilePoolClosed):
                await pool.check("json_schema", QUICK_SCHEMA, timeout=60)
        finally:
            pool.close()
    run(body())


def test_a_cancelled_compile_frees_its_process_for_the_next(tokenizer_parts):
    async def body():
        pool = pool_of(tokenizer_parts)
        await pool.start()
        try:
            job = asyncio.ensure_future(pool.check("json_schema", SLOW_SCHEMA, timeout=60))
            while pool.num_pending < 1:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            job.cancel()  # the client went away
            with pytest.raises(asyncio.CancelledError):
                await job
            assert pool.num_killed == 1
            assert '"a"' in await pool.check("json_schema", QUICK_SCHEMA, timeout=30)
        finally:
            pool.close()
    run(body())


def test_compile_threads_are_daemons_that_run_jobs_and_pass_on_errors():
    threads = CompileThreads(2, 64 << 20)
    try:
        assert threads.submit(lambda x: x * 2, 21).result(10) == 42
        names = threads.submit(lambda: (threading.current_thread().name, threading.current_thread().daemon)).result(10)
        assert names[0].startswith("tokenloop-compile-") and names[1]
        niceness = threads.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result(10)
        assert niceness == os.getpriority(os.PRIO_PROCESS, 0) + NICENESS or niceness == 19  # nice is capped at 19
        with pytest.raises(ZeroDivisionError):
            threads.submit(lambda: 1 / 0).result(10)
    finally:
        threads.shutdown(wait=False)


@pytest.mark.parametrize("field, value, message", [
    ("grammar_compile_workers", 0, "--grammar-compile-workers must be >= 1"),
    ("max_grammar_compiles_waiting", -1, "--max-grammar-compiles-waiting must be >= 0"),
])
def test_the_compile_flags_check_themselves(field, value, message):
    from tokenloop.service.config import ServerConfig
    with pytest.raises(ValueError, match=message):
        ServerConfig(**{field: value})


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_process_started_by_a_pinned_event_loop_compiles_on_all_the_servers_cpus(tokenizer_parts):
    """--front-cpu pins the event loop's thread; a replacement process it starts would inherit that one CPU."""
    wide = os.sched_getaffinity(0)

    async def body():
        pool = pool_of(tokenizer_parts)  # records the CPUs, as App.load_model does before the pin
        os.sched_setaffinity(0, {min(wide)})
        try:
            await pool.start()
            assert '"a"' in await pool.check("json_schema", QUICK_SCHEMA, timeout=30)
            (worker,) = pool.workers
            tasks = [int(task.name) for task in Path(f"/proc/{worker.proc.pid}/task").iterdir()]
            assert len(tasks) >= 2 and all(os.sched_getaffinity(task) == wide for task in tasks)
        finally:
            os.sched_setaffinity(0, wide)
            pool.close()
    run(body())
