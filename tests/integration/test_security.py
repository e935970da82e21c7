"""TLS, mutual TLS, certificate reload and API keys through a real grpc.aio server (certificates made here)."""

from __future__ import annotations

import json
import logging
import os

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.conftest import run
from tests.integration.service_harness import serving
from tests.tls_helpers import issue, make_ca, pem
from tokenloop.service.logs import JsonFormatter
from tokenloop.service.security import load_api_keys
from tokenloop.v1 import tokenloop_pb2 as pb
from tokenloop.v1 import tokenloop_pb2_grpc

GEN = pb.GenerateRequest(text="Hello there", stopping=pb.StoppingCriteria(max_new_tokens=3))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca, other_ca = make_ca("tokenloop test CA"), make_ca("some other CA")
    skey, scert = issue(ca, "localhost")
    ckey, ccert = issue(ca, "client", server=False)
    okey, ocert = issue(other_ca, "intruder", server=False)
    files = {"ca.pem": pem(ca[1]), "other-ca.pem": pem(other_ca[1]), "server.pem": pem(scert),
             "server.key": pem(skey), "client.pem": pem(ccert), "client.key": pem(ckey),
             "intruder.pem": pem(ocert), "intruder.key": pem(okey)}
    for name, data in files.items():
        (d / name).write_bytes(data)
    return d


def tls_channel(port, pki, root="ca.pem", client=None):
    chain = key = None
    if client:
        key, chain = (pki / f"{client}.key").read_bytes(), (pki / f"{client}.pem").read_bytes()
    creds = grpc.ssl_channel_credentials((pki / root).read_bytes(), key, chain)
    return grpc.aio.secure_channel(f"127.0.0.1:{port}", creds,
                                   options=[("grpc.ssl_target_name_override", "localhost")])


async def model_info(channel, metadata=None, timeout=10):
    return await tokenloop_pb2_grpc.TextGenerationStub(channel).GetModelInfo(
        pb.GetModelInfoRequest(), metadata=metadata, timeout=timeout)


async def refused(coro) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await coro
    return err.value


def test_tls_serves_and_a_client_trusting_another_ca_is_refused(tokenizer_dir, pki):
    async def body():
        async with serving(tokenizer_dir, tls_cert=str(pki / "server.pem"),
                           tls_key=str(pki / "server.key")) as (server, _, _):
            async with tls_channel(server.port, pki) as ch:
                assert (await model_info(ch)).max_context_length > 0
            async with tls_channel(server.port, pki, root="other-ca.pem") as ch:  # does not trust the server
                assert (await refused(model_info(ch, timeout=3))).code() == grpc.StatusCode.UNAVAILABLE
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:  # plaintext to a TLS port
                assert (await refused(model_info(ch, timeout=3))).code() == grpc.StatusCode.UNAVAILABLE
    run(body())


def test_mutual_tls_requires_a_client_certificate_from_the_ca(tokenizer_dir, pki):
    async def body():
        async with serving(tokenizer_dir, tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"),
                           tls_client_ca=str(pki / "ca.pem")) as (server, _, _):
            async with tls_channel(server.port, pki, client="client") as ch:
                assert (await model_info(ch)).max_context_length > 0
            for client in (None, "intruder"):  # no client certificate; one from another CA
                async with tls_channel(server.port, pki, client=client) as ch:
                    assert (await refused(model_info(ch, timeout=3))).code() == grpc.StatusCode.UNAVAILABLE
    run(body())


def test_certificates_reload_when_the_files_change(tokenizer_dir, pki, tmp_path):
    (tmp_path / "s.pem").write_bytes((pki / "server.pem").read_bytes())
    (tmp_path / "s.key").write_bytes((pki / "server.key").read_bytes())
    new_ca = make_ca("rotated CA")
    nkey, ncert = issue(new_ca, "localhost")
    (tmp_path / "new-ca.pem").write_bytes(pem(new_ca[1]))

    async def body():
        async with serving(tokenizer_dir, tls_cert=str(tmp_path / "s.pem"),
                           tls_key=str(tmp_path / "s.key")) as (server, _, _):
            async with tls_channel(server.port, pki) as ch:
                assert (await model_info(ch)).max_context_length > 0
            (tmp_path / "s.pem").write_bytes(pem(ncert))
            (tmp_path / "s.key").write_bytes(pem(nkey))
            server.reload_certificates()  # what SIGHUP does (the mtime check would also notice)
            async with tls_channel(server.port, tmp_path, root="new-ca.pem") as ch:
                assert (await model_info(ch)).max_context_length > 0
            assert server.certificates.num_reloads >= 1
            async with tls_channel(server.port, pki) as ch:  # the old CA no longer verifies the server
                assert (await refused(model_info(ch, timeout=3))).code() == grpc.StatusCode.UNAVAILABLE
    run(body())


def test_api_keys_file_and_env(tmp_path, monkeypatch):
    f = tmp_path / "keys"
    f.write_text("# team keys\nalpha-key\n\n  beta-key  # rotated 2026-11\n")
    monkeypatch.setenv("TOKENLOOP_API_KEYS", "gamma, ,delta")
    assert load_api_keys(str(f)) == [b"alpha-key", b"beta-key", b"gamma", b"delta"]
    monkeypatch.delenv("TOKENLOOP_API_KEYS")
    assert load_api_keys("") == []


def test_api_keys_refuse_alike_and_exempt_health_and_reflection(tokenizer_dir, tmp_path):
    (tmp_path / "keys").write_text("alpha-key\nbeta-key\n")

    async def body():
        async with serving(tokenizer_dir, api_key_file=str(tmp_path / "keys")) as (server, stub, _):
            errors = [await refused(stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md)) for md in (
                None, (("authorization", "Bearer wrong"),), (("authorization", "alpha-key"),),
                (("authorization", "Bearer "),), (("authorization", "Bearer alpha-key2"),))]
            errors.append(await refused(stub.Generate(GEN).read()))  # streaming RPCs too
            assert {e.code() for e in errors} == {grpc.StatusCode.UNAUTHENTICATED}
            assert {e.details() for e in errors} == {"missing or invalid API key"}  # never says which part
            for key in ("alpha-key", "beta-key"):
                md = (("authorization", f"Bearer {key}"),)
                assert (await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md)).max_context_length > 0
                msgs = [m async for m in stub.Generate(GEN, metadata=md)]
                assert msgs[-1].complete.finish_reason == pb.LENGTH
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
                health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
                assert health.status == health_pb2.HealthCheckResponse.SERVING
                refl = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
                names = {s.name async for r in refl for s in r.list_services_response.service}
                assert "tokenloop.v1.TextGeneration" in names
    run(body())


def test_request_end_log_line_and_request_id_echo(tokenizer_dir, caplog):
    async def body():
        async with serving(tokenizer_dir) as (server, stub, _):
            call = stub.Generate(GEN, metadata=(("x-request-id", "trace-123"),))
            msgs = [m async for m in call]
            assert ("x-request-id", "trace-123") in tuple(await call.initial_metadata())
            assert {m.request_id for m in msgs} == {"trace-123"}
            await refused(stub.Generate(pb.GenerateRequest(text="")).read())

    with caplog.at_level(logging.INFO, logger="tokenloop.requests"):
        run(body())
    lines = [json.loads(JsonFormatter().format(r)) for r in caplog.records if r.message == "request end"]
    ok = next(line for line in lines if line["request_id"] == "trace-123")
    assert ok["status"] == "OK" and ok["prompt_tokens"] > 0 and ok["output_tokens"] == 3
    assert ok["finish_reason"] == "length" and ok["peer"].startswith("ipv") and ok["total_s"] >= ok["ttft_s"]
    assert {"queue_s", "ttft_s"} <= set(ok)
    assert any(line["status"] == "INVALID_ARGUMENT" for line in lines)
    assert os.sep not in json.dumps([line.get("message") for line in lines])


def test_unexpected_errors_reach_the_client_without_paths_or_text(tokenizer_dir):
    async def body():
        async with serving(tokenizer_dir) as (server, stub, _):
            def broken(*args, **kwargs):
                raise OSError("cannot open /srv/secret/other-client-prompt.txt")
            server.app.validator.generate = broken
            err = await refused(stub.Generate(GEN).read())
            assert err.code() == grpc.StatusCode.INTERNAL and err.details() == "internal error (OSError)"
            server.app.tokenizer.decode = broken
            err = await refused(stub.Detokenize(pb.DetokenizeRequest(token_ids=[5])))
            assert err.code() == grpc.StatusCode.INTERNAL and err.details() == "internal error (OSError)"
    run(body())


def test_tracing_interceptor_opens_a_server_span_per_rpc(tokenizer_dir, monkeypatch):
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tokenloop.service import server as server_module
    from tokenloop.service.tracing import TracingInterceptor
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    monkeypatch.setattr(server_module, "tracing_interceptor",
                        lambda endpoint: TracingInterceptor(provider.get_tracer("test"), trace))
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

    async def body():
        async with serving(tokenizer_dir) as (_, stub, _):
            [m async for m in stub.Generate(GEN, metadata=(("traceparent", parent), ("x-request-id", "t-1")))]
            await stub.GetModelInfo(pb.GetModelInfoRequest())
    run(body())
    by_name = {s.name: s for s in spans.get_finished_spans()}
    gen = by_name["tokenloop.v1.TextGeneration/Generate"]
    assert gen.kind == trace.SpanKind.SERVER and gen.attributes["tokenloop.request_id"] == "t-1"
    assert format(gen.context.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"  # the caller's trace
    assert "tokenloop.v1.TextGeneration/GetModelInfo" in by_name
