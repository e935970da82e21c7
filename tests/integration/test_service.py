"""tokenloop.v1 through a real grpc.aio server on loopback (scripted executor, real tokenizer)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.conftest import run
from tests.integration.service_harness import serving, stalled_reader_is_cut
from tests.scripted_executor import ScriptedExecutor
from tokenloop.v1 import tokenloop_pb2 as pb
from tokenloop.v1 import tokenloop_pb2_grpc

HELLO = "Hello world, hello gRPC streams."


def gen(text=HELLO, max_new=8, stream=True, **kw):
    return pb.GenerateRequest(text=text, stream=stream, stopping=pb.StoppingCriteria(max_new_tokens=max_new), **kw)


async def read_all(call) -> list:
    """Every remaining message of a call (read API: tests also read single messages with call.read())."""
    out = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        out.append(msg)
    return out


async def wait_for(predicate, timeout=3.0):
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return predicate()


def test_streaming_generate_chunks_then_complete(tokenizer_dir, tokenizer):
    async def body():
        async with serving(tokenizer_dir) as (server, stub, ex):
            msgs = [m async for m in stub.Generate(gen(request_id="abc", max_new=10))]
            assert {m.request_id for m in msgs} == {"abc"}
            chunks = [m.chunk for m in msgs if m.HasField("chunk")]
            done = msgs[-1].complete
            assert msgs[-1].HasField("complete") and len(chunks) >= 2
            assert "".join(c.text for c in chunks) == done.text == tokenizer.decode(done.token_ids)
            assert done.finish_reason == pb.LENGTH and done.usage.completion_tokens == 10
            assert done.usage.prompt_tokens == len(tokenizer.encode(HELLO))
            assert done.timing.total_s >= done.timing.ttft_s > 0
    run(body())


def test_unary_style_generate_and_inputs(tokenizer_dir, tokenizer):
    async def body():
        async with serving(tokenizer_dir) as (server, stub, ex):
            (msg,) = [m async for m in stub.Generate(gen(stream=False, max_new=4, n=1,
                                                          output=pb.OutputOptions(echo=True, logprobs=True)))]
            assert msg.complete.prompt_text == HELLO and len(msg.complete.logprobs) == 4
            ids = tokenizer.encode("Hello")
            (msg,) = [m async for m in stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids)))]
            assert msg.complete.usage.prompt_tokens == len(ids)
            chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="Hi")])
            (msg,) = [m async for m in stub.Generate(pb.GenerateRequest(chat=chat, output=pb.OutputOptions(echo=True)))]
            assert msg.complete.prompt_text.endswith("<|im_start|>assistant\n")
            n3 = [m async for m in stub.Generate(gen(stream=False, n=3, max_new=3))]
            assert sorted(m.complete.index for m in n3) == [0, 1, 2]
    run(body())


def test_invalid_argument_names_field_and_server_keeps_serving(tokenizer_dir):
    async def body():
        async with serving(tokenizer_dir) as (server, stub, ex):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [m async for m in stub.Generate(gen(sampling=pb.SamplingParams(top_p=2.0)))]
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == "`sampling.top_p` must be > 0 and <= 1"
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [m async for m in stub.Generate(pb.GenerateRequest())]
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            msgs = [m async for m in stub.Generate(gen())]
            assert msgs[-1].complete.finish_reason == pb.LENGTH
    run(body())


def test_tokenize_detokenize_model_info(tokenizer_dir, tokenizer):
    async def body():
        async with serving(tokenizer_dir) as (server, stub, ex):
            tok = await stub.Tokenize(pb.TokenizeRequest(text="Hello 😀"))
            assert list(tok.token_ids) == tokenizer.encode("Hello 😀") and len(tok.tokens) == len(tok.token_ids)
            text = await stub.Detokenize(pb.DetokenizeRequest(token_ids=tok.token_ids))
            assert text.text == "Hello 😀"
            chat = await stub.Tokenize(pb.TokenizeRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="Hi")])))
            assert chat.text.startswith("<|im_start|>user")
            info = await stub.GetModelInfo(pb.GetModelInfoRequest())
            assert info.architecture == "LlamaForCausalLM" and info.max_context_length == 8192 and info.has_chat_template
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Detokenize(pb.DetokenizeRequest(token_ids=[10**6]))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    run(body())


def test_client_disconnect_frees_request_within_one_step(tokenizer_dir):
    async def body():
        ex = ScriptedExecutor(tick=0.02)
        async with serving(tokenizer_dir, executor=ex) as (server, stub, _):
            call = stub.Generate(gen(max_new=4000))
            await call.read()  # one chunk arrived: the request is running
            load = await stub.GetLoad(pb.GetLoadRequest())
            assert load.num_in_flight == 1 and load.num_running == 1
            call.cancel()  # the client hangs up
            assert await wait_for(lambda: ex.num_active == 0)
            assert ex.cancels == [1]
            load = await stub.GetLoad(pb.GetLoadRequest())
            assert load.num_in_flight == 0 and load.num_running == 0
    run(body())


def test_abort_rpc_is_idempotent_and_ends_with_cancelled(tokenizer_dir):
    async def body():
        async with serving(tokenizer_dir, executor=ScriptedExecutor(tick=0.02)) as (server, stub, ex):
            call = stub.Generate(gen(request_id="job-1", max_new=4000))
            await call.read()  # the first message: the request is running
            assert (await stub.Abort(pb.AbortRequest(request_id="job-1"))).found
            assert not (await stub.Abort(pb.AbortRequest(request_id="job-1"))).found
            assert not (await stub.Abort(pb.AbortRequest(request_id="never-existed"))).found
            rest = await read_all(call)
            assert rest[-1].complete.finish_reason == pb.CANCELLED
    run(body())


def test_duplicate_request_id_is_refused(tokenizer_dir):
    async def body():
        async with serving(tokenizer_dir, executor=ScriptedExecutor(tick=0.02)) as (server, stub, ex):
            call = stub.Generate(gen(request_id="dup", max_new=4000))
            await call.read()  # the first message: the request is running
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [m async for m in stub.Generate(gen(request_id="dup"))]
            assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
            call.cancel()
    run(body())


def test_admission_full_answers_resource_exhausted_with_pushback(tokenizer_dir):
    async def body():
        ex = ScriptedExecutor(tick=0.02)
        async with serving(tokenizer_dir, executor=ex, max_concurrent_requests=1, max_queue=0) as (server, stub, _):
            call = stub.Generate(gen(request_id="c0", max_new=4000))
            await call.read()  # running: the only slot is taken, and no one may wait
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await read_all(stub.Generate(gen()))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "at capacity" in err.value.details()
            assert ("grpc-retry-pushback-ms", "500") in tuple(err.value.trailing_metadata())
            load = await stub.GetLoad(pb.GetLoadRequest())
            assert load.max_concurrent_requests == 1 and load.num_in_flight == 1
            call.cancel()
            assert await wait_for(lambda: server.app.admission.num_active == 0)
            assert (await read_all(stub.Generate(gen(max_new=3))))[-1].complete.finish_reason == pb.LENGTH
    run(body())


def test_deadline_exceeded(tokenizer_dir):
    async def body():
        ex = ScriptedExecutor(tick=0.02)
        async with serving(tokenizer_dir, executor=ex) as (server, stub, _):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [m async for m in stub.Generate(gen(max_new=4000), timeout=0.3)]
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert await wait_for(lambda: ex.num_active == 0)
    run(body())


def test_health_and_reflection(tokenizer_dir):
    async def body():
        ex = ScriptedExecutor(tick=0.02)
        async with serving(tokenizer_dir, executor=ex) as (server, stub, _):
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("", "tokenloop.v1.TextGeneration"):
                resp = await health.Check(health_pb2.HealthCheckRequest(service=name))
                assert resp.status == health_pb2.HealthCheckResponse.SERVING
            refl = reflection_pb2_grpc.ServerReflectionStub(channel)
            responses = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            names = {s.name async for r in responses for s in r.list_services_response.service}
            assert {"tokenloop.v1.TextGeneration", "grpc.health.v1.Health"} <= names
            # the executor dies: open streams get UNAVAILABLE, health turns NOT_SERVING
            call = stub.Generate(gen(max_new=4000))
            await call.read()  # the first message: the request is running
            ex.die("injected fault")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await read_all(call)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "injected fault" in err.value.details()
            await asyncio.sleep(0.1)
            resp = await health.Check(health_pb2.HealthCheckRequest(service=""))
            assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [m async for m in stub.Generate(gen())]
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            await channel.close()
    run(body())


def test_health_list_answers_every_service(tokenizer_dir):
    async def body():
        async with serving(tokenizer_dir) as (server, _, _):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
                listed = await health_pb2_grpc.HealthStub(ch).List(health_pb2.HealthListRequest())
                serving_ = health_pb2.HealthCheckResponse.SERVING
                assert {name: s.status for name, s in listed.statuses.items()} == {
                    "": serving_, "tokenloop.v1.TextGeneration": serving_, "trtllm.TrtllmService": serving_,
                    "vllm.grpc.engine.VllmEngine": serving_}
    run(body())


def test_drain_finishes_in_flight_then_refuses(tokenizer_dir):
    async def body():
        ex = ScriptedExecutor(tick=0.01)
        async with serving(tokenizer_dir, executor=ex) as (server, stub, _):
            call = stub.Generate(gen(max_new=30))
            await call.read()  # the first message: the request is running
            drain = asyncio.ensure_future(server.app.drain(grace=5.0))
            await asyncio.sleep(0.05)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [m async for m in stub.Generate(gen())]
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            rest = await read_all(call)
            assert rest[-1].complete.finish_reason == pb.LENGTH  # finished within the grace period
            await drain
    run(body())


def test_drain_grace_expiry_fails_the_rest_with_unavailable(tokenizer_dir):
    async def body():
        async with serving(tokenizer_dir, executor=ScriptedExecutor(tick=0.05)) as (server, stub, ex):
            call = stub.Generate(gen(max_new=4000))
            await call.read()  # the first message: the request is running
            await server.app.drain(grace=0.2)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await read_all(call)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    run(body())


def test_stalled_reader_is_aborted_and_freed(tokenizer_dir):
    async def body():
        ex = ScriptedExecutor(tick=0.001)
        async with serving(tokenizer_dir, executor=ex, stall_timeout=0.5) as (server, stub, _):
            await stalled_reader_is_cut(
                server, ex, lambda channel: tokenloop_pb2_grpc.TextGenerationStub(channel).Generate(gen(max_new=4000)))
    run(body())


def test_long_prompt_is_tokenized_off_the_event_loop_which_keeps_serving(tokenizer_dir, tokenizer):
    """A text longer than --tokenize-inline-chars is tokenized on a tokenizer thread: while its tokenization is held
    up, another Generate and GetLoad complete. Inline, the held-up call would stop the event loop until it timed out
    (and the test would fail on `timed_out`)."""
    import threading

    long_text = (HELLO + " ") * 100  # 3,300 characters, over the default 2,048
    entered, release, seen = threading.Event(), threading.Event(), {}

    async def body():
        async with serving(tokenizer_dir) as (server, stub, ex):
            tok = server.app.tokenizer
            encode = tok.encode

            def held_encode(text, add_special_tokens=False):
                seen.setdefault(len(text), threading.current_thread().name)
                if len(text) == len(long_text):
                    entered.set()
                    seen["timed_out"] = not release.wait(10)
                return encode(text, add_special_tokens)
            tok.encode = held_encode
            slow = asyncio.ensure_future(read_all(stub.Generate(gen(text=long_text, max_new=3, request_id="long"))))
            assert await wait_for(entered.is_set, timeout=10)
            quick = await asyncio.wait_for(read_all(stub.Generate(gen(max_new=3, request_id="quick"))), 10)
            load = await asyncio.wait_for(stub.GetLoad(pb.GetLoadRequest()), 10)
            assert not release.is_set() and not slow.done()  # all of that while the long prompt was being tokenized
            release.set()
            msgs = await asyncio.wait_for(slow, 10)
            assert quick[-1].complete.usage.completion_tokens == 3 and load.max_concurrent_requests > 0
            assert msgs[-1].complete.usage.prompt_tokens == len(tokenizer.encode(long_text))
    run(body())
    assert seen["timed_out"] is False
    assert seen[len(long_text)].startswith("tokenloop-tokenize") and seen[len(HELLO)] == "MainThread"


def test_long_tokenize_and_detokenize_match_inline_results(tokenizer_dir, tokenizer):
    """Tokenize / Detokenize of long inputs run on a tokenizer thread and answer what the inline calls answer."""
    text = "Emoji time: 😀 🚀 and 東京は日本の首都です。 " * 120

    async def body():
        async with serving(tokenizer_dir) as (server, stub, ex):
            inline = await stub.Tokenize(pb.TokenizeRequest(text=text[:1000]))
            assert list(inline.token_ids) == tokenizer.encode(text[:1000])
            resp = await stub.Tokenize(pb.TokenizeRequest(text=text))
            ids = tokenizer.encode(text)
            assert list(resp.token_ids) == ids and list(resp.tokens) == [tokenizer.id_to_token(i) for i in ids]
            back = await stub.Detokenize(pb.DetokenizeRequest(token_ids=ids * 2))
            assert back.text == text * 2
            assert server.app.num_tokenize_threads > 0  # the long ones went to the tokenizer threads
    run(body())


def test_text_that_cannot_fit_the_prompt_limit_is_refused_untokenized(tokenizer_dir, tokenizer):
    per = tokenizer.max_chars_per_token
    text = "a" * (8191 * per + 1)  # the tiny model's context is 8192

    async def body():
        async with serving(tokenizer_dir) as (server, stub, ex):
            calls = []
            encode = server.app.tokenizer.encode
            server.app.tokenizer.encode = lambda t, add_special_tokens=False: calls.append(len(t)) or encode(t, add_special_tokens)
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await read_all(stub.Generate(gen(text=text)))
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"`text` has {len(text)} characters, more than a prompt of at most 8191 tokens" in exc.value.details()
            assert calls == []
            msgs = await read_all(stub.Generate(gen(max_new=2)))  # and the server keeps serving
            assert msgs[-1].complete.usage.completion_tokens == 2
    run(body())
