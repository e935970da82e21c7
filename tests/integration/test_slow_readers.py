"""No client can hold the server (issue 28): the admission wait bound, Abort while waiting, and streams that stop
reading giving back their slot while the engine pauses their generation, through a real in-process server."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest
from smg_grpc_proto.generated import trtllm_service_pb2 as tpb
from smg_grpc_proto.generated import trtllm_service_pb2_grpc as tpb_grpc

from tests.conftest import run
from tests.integration.service_harness import read_all, serving, wait_for
from tests.scripted_executor import ScriptedExecutor
from tests.tiny_model import make_tiny_model
from tokenloop.bench.harness import never_reading
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.engine import Engine
from tokenloop.v1 import tokenloop_pb2 as pb
from tokenloop.v1 import tokenloop_pb2_grpc as pb_grpc

HELLO = "Hello world, hello gRPC streams."
# a client whose HTTP/2 window stays tiny (no BDP growth, 64 bytes): once it stops reading, the server's writes stop
NEVER_READS = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 64)]
BIG = pb.OutputOptions(logprobs=True, top_logprobs=20)  # logprobs and alternatives go on from where they paused


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("slow-readers"), "llama")


def engine(checkpoint) -> Engine:
    return Engine.from_dir(checkpoint, EngineConfig(dtype="float64", kv_cache_tokens=65536, max_num_tokens=512,
                                                    max_batch_size=64))


def gen(max_new=8, text=HELLO, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=text, stream=True, sampling=pb.SamplingParams(temperature=0.0),
                              stopping=pb.StoppingCriteria(max_new_tokens=max_new, ignore_eos=True), **kw)


def output_ids(msgs) -> list[int]:
    return list(msgs[-1].complete.token_ids)


def quiet(app) -> bool:
    """Every slot back, nobody waiting, nothing open, no KV in use."""
    return (app.admission.num_active == 0 and app.admission.num_waiting == 0 and app.looper.num_open == 0
            and app.executor.stats().kv_blocks_used == 0 and app.admission.num_pending == 0)


def test_a_paused_and_resumed_greedy_stream_gives_the_same_tokens(checkpoint):
    """A reader that stops reading past the grace gives back its slot and its KV blocks (the engine pauses it);
    when it reads again it gets exactly the tokens of a reader that never stopped."""
    async def body():
        eng = engine(checkpoint)
        async with serving(checkpoint, eng, slow_reader_grace=0.2, stall_timeout=30) as (server, stub, _):
            app = server.app
            reference = output_ids(await read_all(stub.Generate(gen(max_new=1000, output=BIG))))
            assert len(reference) == 1000
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=NEVER_READS) as channel:
                call = pb_grpc.TextGenerationStub(channel).Generate(gen(max_new=1000, request_id="slow",
                                                                                output=BIG))
                first = [await call.read()]
                # it stops reading: the slot goes back and the engine frees its blocks, the request still open
                assert await wait_for(lambda: app.admission.num_active == 0 and eng.stats().kv_blocks_used == 0)
                assert app.looper.find("slow") is not None and eng.scheduler.paused
                steps = eng.stats().num_steps
                await asyncio.sleep(0.3)
                assert eng.stats().num_steps == steps  # paused: the engine does no work for it
                rest = await read_all(call)  # it reads again: it takes a slot, generation resumes
            got = [t for m in first + rest if m.HasField("chunk") for t in m.chunk.token_ids]
            assert output_ids(rest) == got == reference
            assert rest[-1].complete.finish_reason == pb.LENGTH
            assert await wait_for(lambda: quiet(app))
        eng.shutdown()
    run(body())


def test_hundreds_of_never_reading_streams_do_not_keep_a_new_client_out(checkpoint):
    """200 streams that never read (over 64 slots and a line of 256) stay open; a well-behaved client's Generate
    completes within its deadline beside them, and it is admitted with the first slot given back (the line is
    fair between connections: its connection holds no slot), not behind the 136 that waited before it. With
    --slow-reader-grace 0 (the old behaviour) the same client waits in line behind them until its deadline."""
    num_streams = 200

    async def attack(server, deadline_s: float):
        submitted = []  # request ids in the order they reached the looper
        looper_submit = server.app.looper.submit
        server.app.looper.submit = lambda valid, *a: submitted.append(valid.request_id) or looper_submit(valid, *a)
        hostile = [gen(max_new=1000, request_id=f"h{i}") for i in range(num_streams)]
        async with never_reading(f"127.0.0.1:{server.port}", hostile, 4, NEVER_READS) as calls:
            app = server.app
            assert await wait_for(lambda: app.looper.num_open + app.admission.num_waiting >= num_streams, 30)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as good:
                try:
                    msgs = await read_all(pb_grpc.TextGenerationStub(good).Generate(
                        gen(max_new=8, request_id="good"), timeout=deadline_s))
                    outcome = msgs[-1].complete.usage.completion_tokens
                except grpc.aio.AioRpcError as err:
                    outcome = err.code()
            still_open = sum(not c.done() for c in calls)
            return outcome, still_open, submitted

    async def body():  # (the server stops its executor: one engine each)
        async with serving(checkpoint, engine(checkpoint), slow_reader_grace=0.5, stall_timeout=60) as (server, _, _):
            outcome, still_open, submitted = await attack(server, deadline_s=30)
            assert outcome == 8 and still_open == num_streams  # served beside them; none of them was cut off
            assert submitted.index("good") < 64 + 8, submitted.index("good")  # FIFO would make it 200
            assert await wait_for(lambda: quiet(server.app), 30)  # every slot back once they hang up
        async with serving(checkpoint, engine(checkpoint), slow_reader_grace=0, stall_timeout=60) as (server, _, _):
            outcome, still_open, _ = await attack(server, deadline_s=3)
            assert outcome == grpc.StatusCode.DEADLINE_EXCEEDED and still_open == num_streams
            assert await wait_for(lambda: quiet(server.app), 30)
    run(body())


def test_a_wait_past_max_queue_wait_is_refused_and_a_shorter_deadline_still_wins(tokenizer_dir):
    async def body():
        ex = ScriptedExecutor(tick=0.01)
        async with serving(tokenizer_dir, ex, max_concurrent_requests=1, max_queue_wait=0.3) as (server, stub, _):
            holder = stub.Generate(gen(max_new=4000))
            await holder.read()
            call = stub.Generate(gen())
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await read_all(call)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "waited 0.3 s for a slot (--max-queue-wait)" in err.value.details()
            assert ("grpc-retry-pushback-ms", "500") in tuple(err.value.trailing_metadata())
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await read_all(stub.Generate(gen(), timeout=0.1))  # its deadline comes before the wait bound
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            holder.cancel()
            assert await wait_for(lambda: server.app.admission.num_active == 0 and server.app.admission.num_pending == 0)
            assert len(ex.enqueued) == 1  # neither refused request reached the executor
    run(body())


@pytest.mark.parametrize("api", ["tokenloop", "trtllm"])
def test_abort_of_a_request_waiting_for_admission_finds_it_and_it_never_runs(tokenizer_dir, tokenizer, api):
    async def body():
        ex = ScriptedExecutor(tick=0.01)
        async with serving(tokenizer_dir, ex, max_concurrent_requests=1) as (server, stub, _):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                if api == "trtllm":
                    router = tpb_grpc.TrtllmServiceStub(channel)
                    ids = tokenizer.encode(HELLO)

                    def generate(rid, max_new):
                        return router.Generate(tpb.GenerateRequest(
                            tokenized=tpb.TokenizedInput(input_token_ids=ids), max_tokens=max_new, streaming=True,
                            request_id=rid))

                    async def abort(rid):
                        return (await router.Abort(tpb.AbortRequest(request_id=rid))).success
                else:
                    def generate(rid, max_new):
                        return stub.Generate(gen(max_new=max_new, request_id=rid))

                    async def abort(rid):
                        return (await stub.Abort(pb.AbortRequest(request_id=rid))).found
                holder = generate("holder", 4000)
                await holder.read()  # running: it holds the only slot
                waiting = generate("waiting", 8)
                reading = asyncio.ensure_future(read_all(waiting))
                assert await wait_for(lambda: server.app.admission.num_waiting == 1)
                assert await abort("waiting") is True
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await reading
                assert err.value.code() == grpc.StatusCode.CANCELLED
                assert "aborted (Abort) while waiting for admission" in err.value.details()
                assert await abort("waiting") is False  # gone: idempotent
                assert server.app.admission.num_waiting == 0
                assert await abort("holder") is True  # a running one: through the looper, as before
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await read_all(holder)  # it ends (how it reports a cancel is each API's own, tested elsewhere)
            assert await wait_for(lambda: server.app.admission.num_active == 0 and server.app.looper.num_open == 0)
            assert [r.request_id for r in ex.enqueued] == ["holder"]  # the aborted one never reached the executor
    run(body())


@pytest.mark.parametrize("kind", ["greedy", "seeded n=2"])
def test_engine_pause_frees_kv_and_resume_gives_the_same_tokens(checkpoint, kind):
    """The executor ability alone: pause mid-generation frees every KV block and stops steps; resume goes on with
    the tokens a never-paused run makes (greedy, and seeded sampling with two sequences: each keeps its RNG)."""
    from tests.engine_helpers import collect, greedy_request, run_all, sampled_request, tokens

    prompt = [5, 17, 99, 3, 250, 7, 42]
    request = greedy_request(prompt, 200) if kind == "greedy" else sampled_request(prompt, seed=7,
                                                                                   max_new_tokens=200, n=2)
    eng = engine(checkpoint)
    try:
        _, reference = run_all(eng, [request])
        rid = eng.enqueue(request)
        seen: dict[tuple[int, int], list] = {}
        while sum(len(s.token_ids) for v in seen.values() for s in v) < 20:
            for step in eng.await_responses(0.5):
                seen.setdefault((step.executor_id, step.seq_index), []).append(step)
        eng.pause(rid)
        eng.pause(rid)  # idempotent
        deadline = time.monotonic() + 10
        while eng.stats().kv_blocks_used and time.monotonic() < deadline:
            for step in eng.await_responses(0.05):  # steps made before the pause was taken still arrive
                seen.setdefault((step.executor_id, step.seq_index), []).append(step)
        assert eng.stats().kv_blocks_used == 0 and eng.stats().num_running == 0
        for step in eng.await_responses(0.3):
            seen.setdefault((step.executor_id, step.seq_index), []).append(step)
        assert eng.await_responses(0.3) == []  # paused: no more steps
        eng.resume(rid)
        rest = collect(eng, {rid: request.n})
        for i in range(request.n):
            got = tokens(seen.get((rid, i), [])) + tokens(rest[(rid, i)])
            assert got == tokens(reference[(1, i)]) and len(got) == 200
        assert eng.stats().kv_blocks_used == 0
    finally:
        eng.shutdown()


def test_the_router_api_shares_the_pause_and_resume(checkpoint):
    """TrtllmService.Generate (what SMG calls) goes through the same Delivery: its stalled stream gives back its
    slot and KV, and resumes with the tokens of a reader that never stopped."""

    def request(rid=""):
        return tpb.GenerateRequest(tokenized=tpb.TokenizedInput(input_token_ids=[5, 17, 99, 3, 250, 7, 42]),
                                   max_tokens=1000, streaming=True, request_id=rid, ignore_eos=True,
                                   sampling_config=tpb.SamplingConfig(temperature=0.0),
                                   output_config=tpb.OutputConfig(logprobs=20))

    async def body():
        eng = engine(checkpoint)
        async with serving(checkpoint, eng, slow_reader_grace=0.2, stall_timeout=30) as (server, _, _):
            app = server.app
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as plain:
                reference = (await read_all(tpb_grpc.TrtllmServiceStub(plain).Generate(request())))[-1]
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=NEVER_READS) as channel:
                call = tpb_grpc.TrtllmServiceStub(channel).Generate(request("slow"))
                first = [await call.read()]
                assert await wait_for(lambda: app.admission.num_active == 0 and eng.stats().kv_blocks_used == 0)
                assert app.looper.find("slow") is not None and eng.scheduler.paused
                rest = await read_all(call)
            streamed = [t for m in first + rest if m.HasField("chunk") for t in m.chunk.token_ids]
            assert streamed == list(rest[-1].complete.output_token_ids) == list(reference.complete.output_token_ids)
            assert len(streamed) == 1000
            assert await wait_for(lambda: quiet(app))
        eng.shutdown()
    run(body())


@pytest.mark.parametrize("end", ["stall timeout", "deadline", "abort", "shutdown"])
def test_a_paused_stream_that_ends_leaves_nothing_behind(checkpoint, end):
    """Paused (slot given back, KV freed), then ended by --stall-timeout, its deadline, Abort or server shutdown:
    no slot is given back twice or kept, and the engine forgets it."""
    async def body():
        eng = engine(checkpoint)
        stall = 1.5 if end == "stall timeout" else 60
        async with serving(checkpoint, eng, slow_reader_grace=0.2, stall_timeout=stall) as (server, stub, _):
            app = server.app
            holder = stub.Generate(gen(max_new=1000, request_id="holder"))  # a reader that reads: one slot
            await holder.read()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=NEVER_READS) as channel:
                call = pb_grpc.TextGenerationStub(channel).Generate(
                    gen(max_new=1000, request_id="slow"), timeout=4 if end == "deadline" else None)
                await call.read()
                assert await wait_for(lambda: len(eng.scheduler.paused) == 1 and app.admission.num_active == 1)
                if end == "abort":
                    assert (await stub.Abort(pb.AbortRequest(request_id="slow"))).found
                if end == "shutdown":
                    await app.drain(grace=0.2)
                assert await wait_for(lambda: app.looper.find("slow") is None and not eng.scheduler.paused, 20)
                call.cancel()
            holder.cancel()
            assert await wait_for(lambda: app.admission.num_active == 0 and app.admission.num_waiting == 0
                                  and app.looper.num_open == 0)
            if end != "shutdown":
                assert await wait_for(lambda: eng.stats().kv_blocks_used == 0 and eng.num_requests == 0)
        eng.shutdown()
    run(body())
