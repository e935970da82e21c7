"""trtllm.TrtllmService (the API the Shepherd Model Gateway routes to) through a real in-process server."""

from __future__ import annotations

import hashlib
import io
import zipfile

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import trtllm_service_pb2 as tpb
from smg_grpc_proto.generated import trtllm_service_pb2_grpc as tpb_grpc

from tests.conftest import run
from tests.integration.service_harness import gen, read_all, serving, stalled_reader_is_cut, trtllm, wait_for
from tests.scripted_executor import ScriptedExecutor

HELLO = "Hello world, hello gRPC streams."


@pytest.fixture
def ids(tokenizer):
    return tokenizer.encode(HELLO)


def test_streaming_generate_sends_delta_chunks_then_one_complete(tokenizer_dir, ids):
    async def body():
        async with trtllm(tokenizer_dir) as (server, stub, ex):
            msgs = await read_all(stub.Generate(gen(ids, max_tokens=10, request_id="r1")))
            assert {m.request_id for m in msgs} == {"r1"}
            chunks = [m.chunk for m in msgs if m.HasField("chunk")]
            assert len(chunks) >= 2 and msgs[-1].HasField("complete") and len(msgs) == len(chunks) + 1
            done = msgs[-1].complete
            streamed = [t for c in chunks for t in c.token_ids]
            assert streamed == list(done.output_token_ids) == (ids * 2)[:10]  # the scripted echo
            assert [c.completion_tokens for c in chunks] == sorted({c.completion_tokens for c in chunks})
            assert chunks[-1].completion_tokens == done.completion_tokens == 10
            assert done.prompt_tokens == chunks[0].prompt_tokens == len(ids)
            assert done.finish_reason == "length" and done.WhichOneof("matched_stop") is None
    run(body())


def test_non_streaming_gives_only_the_complete_and_n_gives_one_per_sequence(tokenizer_dir, ids):
    async def body():
        async with trtllm(tokenizer_dir) as (server, stub, ex):
            (msg,) = await read_all(stub.Generate(gen(ids, max_tokens=4, streaming=False)))
            assert msg.HasField("complete") and len(msg.complete.output_token_ids) == 4
            msgs = await read_all(stub.Generate(gen(ids, max_tokens=3, streaming=False, sampling_config=tpb.SamplingConfig(
                num_return_sequences=2, temperature=0.0), output_config=tpb.OutputConfig(logprobs=2))))
            assert sorted(m.complete.sequence_index for m in msgs) == [0, 1]
            assert all(len(m.complete.logprobs) == 3 and len(m.complete.logprobs[0].top_logprobs) == 2 for m in msgs)
            assert ex.enqueued[-1].n == 2 and ex.enqueued[-1].sampling.greedy
            assert ex.enqueued[-1].output.top_logprobs == 2
    run(body())


def test_sampling_and_stopping_reach_the_executor(tokenizer_dir, ids):
    async def body():
        async with trtllm(tokenizer_dir) as (server, stub, ex):
            await read_all(stub.Generate(gen(ids, max_tokens=5, ignore_eos=True, stop=["zzz"], stop_token_ids=[7],
                                             sampling_config=tpb.SamplingConfig(
                                                 temperature=0.5, top_k=4, top_p=0.9, min_p=0.1, seed=42,
                                                 repetition_penalty=1.2, presence_penalty=0.5,
                                                 frequency_penalty=0.25, min_tokens=2))))
            v = ex.enqueued[-1]
            assert (v.sampling.temperature, v.sampling.top_k, v.sampling.seed) == (0.5, 4, 42)
            assert v.sampling.top_p == pytest.approx(0.9) and v.sampling.min_p == pytest.approx(0.1)
            assert v.sampling.repetition_penalty == pytest.approx(1.2)
            assert (v.sampling.presence_penalty, v.sampling.frequency_penalty) == (0.5, 0.25)
            assert v.stopping.max_new_tokens == 5 and v.stopping.min_new_tokens == 2 and v.stopping.ignore_eos
            assert v.stopping.stop == ("zzz",) and v.stopping.stop_token_ids == (7,)
    run(body())


def test_stop_string_reports_matched_stop_str(tokenizer_dir, tokenizer, ids):
    async def body():
        async with trtllm(tokenizer_dir) as (server, stub, ex):
            msgs = await read_all(stub.Generate(gen(ids, max_tokens=40, stop=["gRPC"])))
            done = msgs[-1].complete
            assert done.finish_reason == "stop" and done.matched_stop_str == "gRPC"
            assert len(done.output_token_ids) < 40 and "gRPC" in tokenizer.decode(list(done.output_token_ids))
    run(body())


def test_stop_token_and_eos_are_left_out_of_output_ids_unless_asked(tokenizer_dir, ids):
    stop = ids[3]

    async def body():
        async with trtllm(tokenizer_dir, ScriptedExecutor(eos_token_id=ids[5])) as (server, stub, ex):
            msgs = await read_all(stub.Generate(gen(ids, max_tokens=40, stop_token_ids=[stop])))
            done = msgs[-1].complete
            assert done.finish_reason == "stop" and done.matched_token_id == stop
            assert list(done.output_token_ids) == ids[:3]
            assert [t for m in msgs[:-1] for t in m.chunk.token_ids] == ids[:3]
            (kept,) = await read_all(stub.Generate(gen(ids, max_tokens=40, stop_token_ids=[stop], streaming=False,
                                                       include_stop_token_in_output=True)))
            assert list(kept.complete.output_token_ids) == ids[:4]
            (eos,) = await read_all(stub.Generate(gen(ids, max_tokens=40, streaming=False)))
            assert eos.complete.finish_reason == "stop" and list(eos.complete.output_token_ids) == ids[:5]
    run(body())


@pytest.mark.parametrize("field, kwargs", [
    ("bad", {"bad": ["world"]}),
    ("bad_token_ids", {"bad_token_ids": [5]}),
    ("guided_decoding.guide_type", {"guided_decoding": tpb.GuidedDecodingParams(guide_type=0, guide="{}")}),
    ("lora_config", {"lora_config": tpb.LoraConfig(task_id=1)}),
    ("multimodal_input", {"multimodal_input": tpb.MultimodalInput(image_data=[b"x"])}),
    ("disaggregated_params", {"disaggregated_params": tpb.DisaggregatedParams(request_type=1)}),
    ("embedding_bias", {"embedding_bias": [0.5]}),
    ("sampling_config.beam_width", {"sampling_config": tpb.SamplingConfig(beam_width=2)}),
    ("sampling_config.no_repeat_ngram_size", {"sampling_config": tpb.SamplingConfig(no_repeat_ngram_size=3)}),
    ("output_config.prompt_logprobs", {"output_config": tpb.OutputConfig(prompt_logprobs=1)}),
    ("max_tokens", {"max_tokens": 5000}),
    ("sampling_config.min_tokens", {"sampling_config": tpb.SamplingConfig(min_tokens=9)}),  # > max_tokens 8
    ("sampling_config.temperature", {"sampling_config": tpb.SamplingConfig(temperature=-1.0)}),
    ("tokenized.input_token_ids", {"tokenized": tpb.TokenizedInput(input_token_ids=[10**6])}),
])
def test_fields_the_executor_cannot_honour_are_refused_by_name(tokenizer_dir, ids, field, kwargs):
    async def body():
        async with trtllm(tokenizer_dir) as (server, stub, ex):
            request = gen(ids)
            for name, value in kwargs.items():
                if isinstance(value, list):
                    getattr(request, name).extend(value)
                elif hasattr(value, "DESCRIPTOR"):
                    getattr(request, name).CopyFrom(value)
                else:
                    setattr(request, name, value)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await read_all(stub.Generate(request))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"`{field}`" in err.value.details()
            assert ex.enqueued == []
    run(body())


def test_embed_and_kv_events_are_unimplemented_with_a_message(tokenizer_dir, ids):
    async def body():
        async with trtllm(tokenizer_dir) as (server, stub, ex):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Embed(tpb.EmbedRequest(tokenized=tpb.TokenizedInput(input_token_ids=ids)))
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED and "generative" in err.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await read_all(stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest()))
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED and "KV-cache events" in err.value.details()
    run(body())


def test_abort_ends_the_stream_and_is_idempotent(tokenizer_dir, ids):
    async def body():
        async with trtllm(tokenizer_dir, ScriptedExecutor(tick=0.05)) as (server, stub, ex):
            call = stub.Generate(gen(ids, max_tokens=200, request_id="slow"))
            first = await call.read()
            assert first.HasField("chunk")
            assert (await stub.Abort(tpb.AbortRequest(request_id="slow"))).success
            rest = await read_all(call)
            assert rest[-1].complete.finish_reason == "abort" and len(rest[-1].complete.output_token_ids) < 200
            again = await stub.Abort(tpb.AbortRequest(request_id="slow"))
            assert not again.success and "not in flight" in again.message
            assert not (await stub.Abort(tpb.AbortRequest(request_id="never-seen"))).success
            assert await wait_for(lambda: server.app.load().num_running == 0)
    run(body())


def test_client_cancel_frees_the_request(tokenizer_dir, ids):
    async def body():
        async with trtllm(tokenizer_dir, ScriptedExecutor(tick=0.05)) as (server, stub, ex):
            call = stub.Generate(gen(ids, max_tokens=200))
            assert (await call.read()).HasField("chunk")
            call.cancel()
            assert await wait_for(lambda: ex.cancels and server.app.looper.num_open == 0)
            assert await wait_for(lambda: server.app.load().num_running == 0)
    run(body())


def test_health_check_is_ok_only_while_serving(tokenizer_dir):
    async def body():
        async with trtllm(tokenizer_dir) as (server, stub, ex):
            assert (await stub.HealthCheck(tpb.HealthCheckRequest())).status == "OK"
            server.app.not_ready_reason = "the server is shutting down"
            try:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.HealthCheck(tpb.HealthCheckRequest())
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.value.details()
            finally:
                server.app.not_ready_reason = ""
    run(body())


def test_model_and_server_info(tokenizer_dir):
    async def body():
        async with trtllm(tokenizer_dir, max_concurrent_requests=7) as (server, stub, ex):
            info = await stub.GetModelInfo(tpb.GetModelInfoRequest())
            assert info.model_id == tokenizer_dir.name == server.app.card.model_id
            assert info.vocab_size == server.app.validator.vocab_size > 0
            assert info.max_seq_len == server.app.card.max_context_length and info.max_batch_size == 7
            assert 0 < info.max_input_len < info.max_seq_len and "stop" in info.supported_features
            sinfo = await stub.GetServerInfo(tpb.GetServerInfoRequest())
            assert sinfo.version.startswith("tokenloop") and sinfo.backend == "pytorch" and sinfo.world_size == 1
    run(body())


def test_get_tokenizer_streams_a_zip_with_a_final_sha256(tokenizer_dir):
    async def body():
        async with trtllm(tokenizer_dir, max_message_bytes=2048) as (server, stub, ex):
            chunks = await read_all(stub.GetTokenizer(common_pb2.GetTokenizerRequest()))
            assert len(chunks) > 1 and all(not c.sha256 for c in chunks[:-1])
            data = b"".join(c.data for c in chunks)
            assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
            with zipfile.ZipFile(io.BytesIO(data)) as zf:
                assert "tokenizer.json" in zf.namelist()
                assert zf.read("tokenizer.json") == (tokenizer_dir / "tokenizer.json").read_bytes()
                assert all("/" not in name for name in zf.namelist())
    run(body())


def test_reflection_lists_the_trtllm_service(tokenizer_dir):
    async def body():
        async with trtllm(tokenizer_dir) as (server, stub, ex):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                refl = reflection_pb2_grpc.ServerReflectionStub(channel)
                call = refl.ServerReflectionInfo()
                await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
                resp = await call.read()
                await call.done_writing()
                names = {s.name for s in resp.list_services_response.service}
                assert "trtllm.TrtllmService" in names and "tokenloop.v1.TextGeneration" in names
    run(body())


def sent(writer, batch) -> list[tpb.GenerateResponse]:
    """What the client reads for one batch: the writer's bytes, parsed."""
    return [tpb.GenerateResponse.FromString(m) for m in writer.encode(batch)]


def test_writer_coalesces_a_backlog_and_strips_the_eos_token_once():
    from tokenloop.core.request import FinishReason, ValidRequest
    from tokenloop.looper.stream import Chunk, Complete, Timing
    from tokenloop.service.trtllm_convert import TrtllmWriter as _Writer

    valid = ValidRequest(request_id="w", prompt_token_ids=(5, 6), stream=True)
    writer = _Writer(valid, keep_stop_token=False, perf=True, arrival_wall=1000.0)
    done = Complete(0, "abc", [1, 2, 3], FinishReason.EOS, 2, 0, Timing(0.1, 0.2, 0.5))
    msgs = sent(writer, [Chunk(0, "a", [1]), Chunk(0, "b", [2]), Chunk(0, "c", [3]), done])
    assert [m.WhichOneof("response") for m in msgs] == ["chunk", "complete"]
    assert list(msgs[0].chunk.token_ids) == [1, 2] and msgs[0].chunk.completion_tokens == 2
    assert list(msgs[1].complete.output_token_ids) == [1, 2] and msgs[1].complete.completion_tokens == 2
    perf = msgs[1].complete.perf_metrics
    assert (perf.arrival_time, perf.first_token_time, perf.last_token_time) == (1000.0, 1000.2, 1000.5)


def test_writer_holds_chunks_until_the_stream_interval():
    from tokenloop.core.request import FinishReason, ValidRequest
    from tokenloop.looper.stream import Chunk, Complete, Timing
    from tokenloop.service.trtllm_convert import TrtllmWriter as _Writer

    writer = _Writer(ValidRequest(request_id="w", prompt_token_ids=(5,), stream=True), False, False, 0.0, interval=3)
    assert sent(writer, [Chunk(0, "a", [1]), Chunk(0, "b", [2])]) == []
    (first,) = sent(writer, [Chunk(0, "c", [3]), Chunk(0, "d", [4])])
    assert list(first.chunk.token_ids) == [1, 2, 3, 4]
    done = Complete(0, "abcde", [1, 2, 3, 4, 5, 9], FinishReason.STOP_TOKEN, 1, 0, Timing(), matched_stop_token=9)
    chunk, complete = sent(writer, [Chunk(0, "e", [5]), Chunk(0, "", [9]), done])
    assert list(chunk.chunk.token_ids) == [5] and chunk.chunk.completion_tokens == 5
    assert list(complete.complete.output_token_ids) == [1, 2, 3, 4, 5] and complete.complete.matched_token_id == 9


def test_writer_encode_writes_the_bytes_protobuf_writes(monkeypatch):
    """encode() (what Generate sends) equals, byte for byte, the same writer with every chunk through protobuf:
    one-token chunks put together from kept bytes (sequences 0 and 1, ids of one to five varint bytes, completion counts past 127 and 16383),
    multi-token and logprob chunks, a stripped EOS, the stream interval, perf metrics, empty and long request
    ids, prompts of 1 and 300 tokens, and a full table of token ids."""
    from tokenloop.core.request import FinishReason, ValidRequest
    from tokenloop.looper.stream import Chunk, Complete, Timing, TokenLogprob
    from tokenloop.service import trtllm_convert
    from tokenloop.service.trtllm_convert import TrtllmWriter as _Writer

    class ProtobufWriter(_Writer):
        """The reference: every chunk through protobuf."""

        def encode_chunk(self, chunk, done):
            return self._chunk_message(chunk, done is not None and self._strip(done))

    lp = [TokenLogprob(7, -0.25, [(7, -0.25), (8, -2.0)])]
    ids = [1, 127, 128, 16383, 16384, 2 ** 21, 2 ** 31]
    batches = ([[Chunk(0, "x", [t]), Chunk(1, "y", [t])] for t in ids]  # one chunk per sequence: kept bytes
               + [[Chunk(0, "a", [3, 4]), Chunk(1, "b", [5], lp), Chunk(0, "c", [6])]]  # through protobuf
               + [[Chunk(0, "t", [9])] for _ in range(16400)]  # completion_tokens reaches 3 varint bytes
               + [[Chunk(0, "k", [t], None, c), Chunk(1, "k", [t, t], None, c)] for t, c in ((5, 40), (6, 300))]
               + [[Chunk(1, "e", [10]), Complete(1, "", [10, 11], FinishReason.EOS, 3, 0, Timing(0.1, 0.2, 0.3))],
                  [Chunk(0, "f", [12]), Complete(0, "f", [12], FinishReason.LENGTH, 3, 0, Timing(), logprobs=lp)]])
    for rid, prompt in (("w", (5,)), ("", (5,) * 300), ("r" * 300, (1, 2, 3))):
        for kw in ({}, {"interval": 2}):
            for keep, perf in ((False, True), (True, False)):
                a = ProtobufWriter(ValidRequest(request_id=rid, prompt_token_ids=prompt, n=2, stream=True), keep,
                                   perf, 1000.0, **kw)
                b = _Writer(ValidRequest(request_id=rid, prompt_token_ids=prompt, n=2, stream=True), keep, perf,
                            1000.0, **kw)
                for batch in batches:
                    wire = b.encode(batch)
                    assert all(type(m) is bytes for m in wire)
                    assert wire == a.encode(batch), (rid, kw, keep)
    monkeypatch.setattr(trtllm_convert, "MAX_TOKEN_ID_FIELDS", len(trtllm_convert.TOKEN_ID_FIELDS))
    a, b = (cls(ValidRequest(request_id="w", prompt_token_ids=(5,), stream=True), False, False, 0.0)
            for cls in (ProtobufWriter, _Writer))
    assert b.encode([Chunk(0, "z", [777777])]) == a.encode([Chunk(0, "z", [777777])])
    assert 777777 not in trtllm_convert.TOKEN_ID_FIELDS


def test_stalled_reader_is_aborted_and_freed(tokenizer_dir, ids):
    async def body():
        ex = ScriptedExecutor(tick=0.001)
        async with serving(tokenizer_dir, executor=ex, stall_timeout=0.5) as (server, _stub, _):
            await stalled_reader_is_cut(server, ex, lambda channel: tpb_grpc.TrtllmServiceStub(channel).Generate(gen(ids, max_tokens=4000)))
    run(body())


def test_generate_logs_one_request_end_line_and_echoes_the_request_id(tokenizer_dir, caplog):
    """Generate keeps its own request-log record (no interceptor generator around it): exactly one "request end"
    line per call, with the RPC's path, the outcome and the id from `x-request-id`, which is echoed back."""
    import json
    import logging

    from tokenloop.service.logs import JsonFormatter

    async def body():
        async with trtllm(tokenizer_dir) as (_, stub, _):
            call = stub.Generate(gen([5, 6, 7], max_tokens=3), metadata=(("x-request-id", "smg-42"),))
            msgs = await read_all(call)
            assert ("x-request-id", "smg-42") in tuple(await call.initial_metadata())
            assert {m.request_id for m in msgs} == {"smg-42"} and msgs[-1].HasField("complete")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await read_all(stub.Generate(gen([5], max_tokens=5000, request_id="bad-1")))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    with caplog.at_level(logging.INFO, logger="tokenloop.requests"):
        run(body())
    lines = [json.loads(JsonFormatter().format(r)) for r in caplog.records if r.message == "request end"]
    ok = [line for line in lines if line["request_id"] == "smg-42"]
    assert len(ok) == 1, lines
    assert ok[0]["rpc"] == "/trtllm.TrtllmService/Generate" and ok[0]["status"] == "OK"
    assert ok[0]["output_tokens"] == 3 and ok[0]["finish_reason"] == "length"
    bad = [line for line in lines if line["request_id"] == "bad-1"]
    assert len(bad) == 1 and bad[0]["status"] == "INVALID_ARGUMENT", lines


def test_a_bug_in_either_apis_mapping_is_internal_and_the_server_keeps_serving(tokenizer_dir, ids, monkeypatch):
    """One error policy (service.frontdoor) for both APIs: an unexpected exception in a servicer's mapping, before
    submit (validation) or mid-stream (the writer), ends that call INTERNAL naming only its type; its request is
    cancelled, its slot comes back, and both APIs go on serving."""
    from tokenloop.service import trtllm_service
    from tokenloop.service.convert import StreamWriter
    from tokenloop.service.trtllm_convert import TrtllmWriter
    from tokenloop.v1 import tokenloop_pb2 as pb
    from tokenloop.v1 import tokenloop_pb2_grpc as pb_grpc

    def bug(*args, **kwargs):
        raise RuntimeError("a mapping bug with /secret/path")

    async def body():
        async with serving(tokenizer_dir, ScriptedExecutor(tick=0.01)) as (server, stub, ex):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                rt = tpb_grpc.TrtllmServiceStub(channel)
                v1 = pb_grpc.TextGenerationStub(channel)
                v1_req = pb.GenerateRequest(text=HELLO, stream=True, stopping=pb.StoppingCriteria(max_new_tokens=20))
                calls = {"trtllm": lambda: read_all(rt.Generate(gen(ids, max_tokens=20))),
                         "v1": lambda: read_all(v1.Generate(v1_req))}
                for where in ("validate", "writer"):
                    with monkeypatch.context() as m:
                        if where == "validate":
                            m.setattr(trtllm_service, "to_valid_request", bug)
                            m.setattr(server.app.validator, "generate", bug)
                        else:
                            m.setattr(TrtllmWriter, "encode_complete", bug)
                            m.setattr(StreamWriter, "encode_complete", bug)
                        for name, call in calls.items():
                            with pytest.raises(grpc.aio.AioRpcError) as err:
                                await call()
                            assert err.value.code() == grpc.StatusCode.INTERNAL, (where, name)
                            assert err.value.details() == "internal error (RuntimeError)", (where, name)
                    for name, call in calls.items():  # the server serves on, on both APIs
                        msgs = await call()
                        assert msgs[-1].HasField("complete"), (where, name)
                assert await wait_for(lambda: server.app.load().num_running == 0)
                assert server.app.admission.num_active == 0
    run(body())
