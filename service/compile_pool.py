"""Grammar compiles the server can stop: a few compile processes, killed and replaced at a compile's timeout.

`CompilePool.check(kind, spec, timeout)` sends a constraint to an idle compile process (service/compile_worker.py)
and returns its llguidance grammar text once it compiled there; the server then builds its own matcher from that
text on `CompileThreads` (threads tokenization never uses), in about the time the check took. A check still running
at its timeout kills its process (a new one starts at once), so a schema that would compile for minutes costs at
most its timeout of one core. At most `num_workers` checks run and `max_waiting` wait; more are refused
(`CompileQueueFull`), so a flood of slow schemas cannot queue unbounded work. `close()` kills every process at
once: shutdown never waits on a compile.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import logging
import os
import queue
import sys
import threading

from .compile_worker import FRAME, NICENESS

log = logging.getLogger("tokenloop.service")
WORKER_COMMAND = (sys.executable, "-m", "tokenloop.service.compile_worker")


class CompileTimeout(Exception):
    """The check did not finish within its timeout (its process was killed), or `waited` that long for one."""

    def __init__(self, waited: bool = False):
        super().__init__()
        self.waited = waited


class CompileQueueFull(Exception):
    """`num_workers` checks run and `max_waiting` wait already."""


class CompilePoolClosed(Exception):
    """The server is shutting down."""


class CompileCrashed(Exception):
    """The compile process died on this constraint (a library crash): the constraint's fault, not the server's."""


class CompileRefused(Exception):
    """The constraint does not compile: `kind` and the library's `message`."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class Worker:
    """One compile process and its pipes."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc

    @classmethod
    async def start(cls, command: tuple[str, ...], init: bytes) -> Worker:
        proc = await asyncio.create_subprocess_exec(*command, stdin=asyncio.subprocess.PIPE,
                                                    stdout=asyncio.subprocess.PIPE)
        worker = cls(proc)
        try:
            await worker._send(init)
            await worker._receive()  # {"ready": true} once its tokenizer is built
        except BaseException:
            worker.kill()
            raise
        return worker

    async def ask(self, kind: str, spec: str) -> dict:
        await self._send(json.dumps({"kind": kind, "spec": spec}).encode())
        return await self._receive()

    async def _send(self, data: bytes) -> None:
        self.proc.stdin.write(FRAME.pack(len(data)) + data)
        await self.proc.stdin.drain()

    async def _receive(self) -> dict:
        (size,) = FRAME.unpack(await self.proc.stdout.readexactly(FRAME.size))
        return json.loads(await self.proc.stdout.readexactly(size))

    def kill(self) -> None:
        if self.proc.returncode is None:
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass


class CompilePool:
    """`num_workers` compile processes for one tokenizer; `check` is called on the event loop."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...], num_workers: int,
                 max_waiting: int):
        self._init = json.dumps({"tokenizer_json": tokenizer_json, "vocab_size": vocab_size,
                                 "eos_token_ids": list(eos_token_ids)}).encode()
        # the CPUs now, before --front-cpu pins the event loop: a process it starts later would inherit its one CPU
        cpus = ",".join(map(str, sorted(os.sched_getaffinity(0)))) if hasattr(os, "sched_getaffinity") else ""
        self._command = (*WORKER_COMMAND, cpus) if cpus else WORKER_COMMAND
        self.num_workers = num_workers
        self.max_waiting = max_waiting
        self.num_pending = 0  # checks running or waiting for a process
        self.num_killed = 0  # processes killed at a timeout (or a cancelled request)
        self._idle: list[Worker] = []
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._workers: set[Worker] = set()
        self._starting: set[asyncio.Task] = set()
        self._closed = False

    @property
    def workers(self) -> frozenset[Worker]:
        """The compile processes alive now (one killed at a timeout is replaced; none once closed)."""
        return frozenset(self._workers)

    async def start(self) -> None:
        """Start every process (each builds the tokenizer: ~0.5 s, in parallel)."""
        workers = await asyncio.gather(*(Worker.start(self._command, self._init) for _ in range(self.num_workers)))
        for worker in workers:
            self._workers.add(worker)
            self._release(worker)

    async def check(self, kind: str, spec: str, timeout: float) -> str:
        """The constraint's grammar text once a process compiled it within `timeout` seconds (waiting included);
        raises CompileRefused, CompileTimeout, CompileQueueFull, CompileCrashed or CompilePoolClosed."""
        if self._closed:
            raise CompilePoolClosed
        if self.num_pending >= self.num_workers + self.max_waiting:
            raise CompileQueueFull(f"{self.num_workers} compiles run and {self.max_waiting} wait")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        self.num_pending += 1
        try:
            worker = await self._acquire(deadline)
            try:
                async with asyncio.timeout_at(deadline):
                    answer = await worker.ask(kind, spec)
            except BaseException as exc:  # the timeout, a cancelled request, a crash: the process is lost to us
                self._replace(worker)
                if self._closed:
                    raise CompilePoolClosed from None
                if isinstance(exc, (asyncio.IncompleteReadError, ConnectionError)):
                    raise CompileCrashed(f"the compile process exited with {await worker.proc.wait()}") from None
                if isinstance(exc, TimeoutError):
                    raise CompileTimeout from None
                raise
            self._release(worker)
        finally:
            self.num_pending -= 1
        if not answer["ok"]:
            raise CompileRefused(answer["kind"], answer["message"])
        return answer["text"]

    async def _acquire(self, deadline: float) -> Worker:
        if self._idle:
            return self._idle.pop()
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout_at(deadline):
                return await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._release(waiter.result())  # handed a process, but the timeout or a cancel won
            elif waiter in self._waiters:
                waiter.cancel()
                self._waiters.remove(waiter)
            if isinstance(exc, TimeoutError):
                raise CompileTimeout(waited=True) from None
            raise

    def _release(self, worker: Worker) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(worker)
                return
        self._idle.append(worker)

    def _replace(self, worker: Worker) -> None:
        worker.kill()
        self._workers.discard(worker)
        self.num_killed += 1
        if not self._closed:
            task = asyncio.get_running_loop().create_task(self._start_one())
            self._starting.add(task)
            task.add_done_callback(self._starting.discard)

    async def _start_one(self) -> None:
        try:
            worker = await Worker.start(self._command, self._init)
        except Exception as exc:  # noqa: BLE001 - logged; the pool runs one process short
            log.error("a compile process did not start: %s", exc)
            return
        if self._closed:
            worker.kill()
            return
        self._workers.add(worker)
        self._release(worker)

    def close(self) -> None:
        """Kill every process now and refuse what waits (CompilePoolClosed)."""
        self._closed = True
        for task in self._starting:
            task.cancel()
        for worker in self._workers:
            worker.kill()
        self._workers.clear()
        self._idle.clear()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(CompilePoolClosed())


class CompileThreads(concurrent.futures.Executor):
    """Daemon threads with large stacks that build matchers (`GrammarCompiler.compile`): tokenization never waits
    behind them, and the interpreter does not wait for them at exit (ThreadPoolExecutor threads are joined)."""

    def __init__(self, num_threads: int, stack_size: int, initializer=None):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        previous = threading.stack_size(stack_size)
        try:
            for i in range(num_threads):
                threading.Thread(target=self._run, args=(initializer,), name=f"tokenloop-compile-{i}",
                                 daemon=True).start()
        finally:
            threading.stack_size(previous)

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def _run(self, initializer) -> None:
        if initializer is not None:
            initializer()
        try:  # Linux: a thread has its own nice value; builds yield the CPU as the compile processes do
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + NICENESS))
        except (AttributeError, OSError):
            pass
        while (job := self._jobs.get()) is not None:
            future, fn, args, kwargs = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                future.set_exception(exc)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._jobs.put(None)  # one thread ends per None; the others are daemons
