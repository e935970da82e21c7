"""LoRA adapters through the gRPC server, both APIs, on the embedded engine with a tiny random model.

Serving adapters from `--lora` and LoadLoraAdapter, selecting them by name (tokenloop.v1) and by
`lora_config.task_id` (trtllm.TrtllmService), the resident set bounded by --max-loras, unload refused while
in use, and every bad-input rule with its exact status and message, with nothing else disturbed.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import grpc
import pytest
from smg_grpc_proto.generated import trtllm_service_pb2 as tpb
from smg_grpc_proto.generated import trtllm_service_pb2_grpc as tpb_grpc

from tests.conftest import run
from tests.integration.service_harness import serving
from tests.lora_helpers import write_adapter
from tests.tiny_model import make_tiny_model
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.engine import Engine
from tokenloop.v1 import tokenloop_pb2 as pb

PROMPT = "The capital of France is"
NOT_FOUND_MESSAGE = ("LoRA adapter `{name}`: `path` names no PEFT adapter under this server's --lora-root directories "
                     "(not found, or not allowed)")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama-lora"), "llama")


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    adapters = {
        "a": write_adapter(checkpoint, root / "a", seed=1),
        "b": write_adapter(checkpoint, root / "b", r=8, targets=("o_proj", "gate_proj", "up_proj"), seed=2),
        "c": write_adapter(checkpoint, root / "c", targets=("k_proj",), seed=3),
        "big": write_adapter(checkpoint, root / "big", r=16, seed=4),
        "embed": write_adapter(checkpoint, root / "embed", seed=5, target_modules=["q_proj", "embed_tokens"]),
        "dora": write_adapter(checkpoint, root / "dora", seed=6, use_dora=True),
    }
    (root / "plain").mkdir()  # a directory that holds no adapter
    return adapters


def roots(adapters) -> tuple[str, ...]:
    """The --lora-root that holds the test's adapters."""
    return (str(adapters["a"].parent),)


@pytest.fixture(scope="module")
def outside(tmp_path_factory):
    """A PEFT adapter outside the --lora-root, and links to it from inside."""
    return tmp_path_factory.mktemp("outside")


@asynccontextmanager
async def engine_server(checkpoint, **config):
    """(server, tokenloop.v1 stub, trtllm stub) with the embedded engine on the tiny checkpoint (give `lora_roots` for
    LoadLoraAdapter)."""
    engine = Engine.from_dir(checkpoint, EngineConfig(kv_cache_tokens=16384, max_batch_size=32, max_lora_rank=8))
    async with serving(checkpoint, engine, **config) as (server, stub, _):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield server, stub, tpb_grpc.TrtllmServiceStub(channel)


def greedy(lora: str = "", max_new_tokens: int = 16, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=PROMPT, lora=lora, sampling=pb.SamplingParams(temperature=0.0),
                              stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens, ignore_eos=True), **kw)


async def ids_of(stub, request) -> list[int]:
    msgs = [m async for m in stub.Generate(request)]
    return list(msgs[-1].complete.token_ids)


async def status_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        result = call()
        if hasattr(result, "__aiter__"):
            [m async for m in result]
        else:
            await result
    return info.value.code(), info.value.details()


def test_adapters_by_name_and_by_task_id(checkpoint, adapters):
    async def body():
        async with engine_server(checkpoint, loras=(f"a={adapters['a']}",), lora_roots=roots(adapters)) as (
                server, stub, trt):
            info = await stub.GetModelInfo(pb.GetModelInfoRequest())
            assert [(a.name, a.id, a.rank, a.alpha, list(a.target_modules)) for a in info.lora_adapters] == \
                [("a", 1, 4, 8.0, ["q_proj", "v_proj", "down_proj"])]
            loaded = await stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(name="b", path=str(adapters["b"]), id=7))
            assert (loaded.name, loaded.id, loaded.rank, loaded.num_running) == ("b", 7, 8, 0)
            listed = await stub.ListLoraAdapters(pb.ListLoraAdaptersRequest())
            assert [(a.name, a.id) for a in listed.adapters] == [("a", 1), ("b", 7)]
            base, with_a, with_b = [await ids_of(stub, greedy(name)) for name in ("", "a", "b")]
            assert base != with_a and base != with_b and with_a != with_b
            ids = server.app.tokenizer.encode(PROMPT)
            for task_id, expected in ((1, with_a), (7, with_b)):
                msgs = [m async for m in trt.Generate(tpb.GenerateRequest(
                    tokenized=tpb.TokenizedInput(input_token_ids=ids), max_tokens=16, ignore_eos=True,
                    sampling_config=tpb.SamplingConfig(temperature=0.0), lora_config=tpb.LoraConfig(task_id=task_id)))]
                assert list(msgs[-1].complete.output_token_ids) == expected
            mixed = await asyncio.gather(*[ids_of(stub, greedy(name)) for name in ("", "a", "b") * 4])
            assert mixed == [base, with_a, with_b] * 4  # one batch mixing them: each gets what it got alone
            code, msg = await status_of(lambda: trt.Generate(tpb.GenerateRequest(
                tokenized=tpb.TokenizedInput(input_token_ids=ids), max_tokens=4,
                lora_config=tpb.LoraConfig(task_id=3))))
            assert (code, msg) == (grpc.StatusCode.NOT_FOUND, "`lora_config.task_id` 3 names no loaded LoRA adapter "
                                   "(loaded: 1 (`a`), 7 (`b`))")
            code, msg = await status_of(lambda: trt.Generate(tpb.GenerateRequest(
                tokenized=tpb.TokenizedInput(input_token_ids=ids), max_tokens=4,
                lora_config=tpb.LoraConfig(task_id=1, weights=b"\0" * 8))))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and msg.startswith("`lora_config.weights` cannot be honoured")
    run(body())


@pytest.mark.parametrize("name, path_key, code, message", [
    ("big", "big", grpc.StatusCode.INVALID_ARGUMENT,
     "LoRA adapter `big` has rank 16; this server takes at most 8 (--max-lora-rank)"),
    ("embed", "embed", grpc.StatusCode.INVALID_ARGUMENT,
     "LoRA adapter `embed` targets modules the model lacks or the engine does not adapt: embed_tokens (supported: "
     "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)"),
    ("dora", "dora", grpc.StatusCode.INVALID_ARGUMENT, "LoRA adapter `dora`: unsupported PEFT options use_dora=True"),
    ("plain", "plain", grpc.StatusCode.NOT_FOUND, NOT_FOUND_MESSAGE.format(name="plain")),
    ("missing", "missing", grpc.StatusCode.NOT_FOUND, NOT_FOUND_MESSAGE.format(name="missing")),
    ("out", "outside", grpc.StatusCode.NOT_FOUND, NOT_FOUND_MESSAGE.format(name="out")),
    ("dots", "../outside/x", grpc.StatusCode.NOT_FOUND, NOT_FOUND_MESSAGE.format(name="dots")),
    ("link", "link-out", grpc.StatusCode.NOT_FOUND, NOT_FOUND_MESSAGE.format(name="link")),
    ("etc", "/etc", grpc.StatusCode.NOT_FOUND, NOT_FOUND_MESSAGE.format(name="etc")),
    ("long", "a" * 100_000, grpc.StatusCode.NOT_FOUND, NOT_FOUND_MESSAGE.format(name="long")),
    ("a", "b", grpc.StatusCode.ALREADY_EXISTS, "LoRA adapter `a` is already loaded (unload it first)"),
    ("bad name", "b", grpc.StatusCode.INVALID_ARGUMENT,
     "`name` must be 1-128 letters, digits, '.', '_' or '-' starting with a letter or digit; got 'bad name'"),
])
def test_bad_adapters_are_refused_naming_them_and_nothing_else_breaks(checkpoint, adapters, outside, name, path_key,
                                                                      code, message):
    """Bad adapters by name; and every path that does not name an adapter under --lora-root (missing, a directory
    without one, outside the root, `..`, a link out of the root, too long) gets the one same NOT_FOUND."""
    root = adapters["a"].parent
    if not (outside / "x").exists():
        write_adapter(checkpoint, outside / "x", seed=7)
        (root / "link-out").symlink_to(outside / "x")
    async def body():
        async with engine_server(checkpoint, loras=(f"a={adapters['a']}",), lora_roots=roots(adapters)) as (
                server, stub, _):
            before = await ids_of(stub, greedy("a"))
            path = {"outside": outside / "x"}.get(path_key, adapters.get(path_key, path_key))
            got = await status_of(lambda: stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(name=name, path=str(path))))
            assert got == (code, message)
            listed = await stub.ListLoraAdapters(pb.ListLoraAdaptersRequest())
            assert [a.name for a in listed.adapters] == ["a"]
            assert await ids_of(stub, greedy("a")) == before
    run(body())


def test_loading_at_run_time_is_off_without_a_lora_root(checkpoint, adapters):
    async def body():
        async with engine_server(checkpoint, loras=(f"a={adapters['a']}",)) as (server, stub, _):
            got = await status_of(lambda: stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(name="b", path=str(
                adapters["b"]))))
            assert got == (grpc.StatusCode.FAILED_PRECONDITION, "LoadLoraAdapter is off: this server loads adapters "
                           "at run time only from --lora-root directories, and none is configured (--lora adapters "
                           "are served)")
            assert (await stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(name="a"))).adapter.name == "a"
    run(body())


def test_unknown_adapter_and_unload_while_in_use(checkpoint, adapters):
    async def body():
        async with engine_server(checkpoint, loras=(f"a={adapters['a']}", f"b={adapters['b']}"),
                                 lora_roots=roots(adapters)) as (_, stub, _t):
            code, msg = await status_of(lambda: stub.Generate(greedy("zzz")))
            assert (code, msg) == (grpc.StatusCode.NOT_FOUND, "LoRA adapter `zzz` is not loaded (loaded: `a`, `b`)")
            base, with_b = await ids_of(stub, greedy("")), await ids_of(stub, greedy("b"))
            long_a = asyncio.ensure_future(ids_of(stub, greedy("a", max_new_tokens=1000)))
            others = [asyncio.ensure_future(ids_of(stub, greedy(n, max_new_tokens=16))) for n in ("", "b") * 6]
            while not any(x.name == "a" and x.num_running for x in  # until the long request is in the engine
                          (await stub.ListLoraAdapters(pb.ListLoraAdaptersRequest())).adapters):
                await asyncio.sleep(0.01)
            code, msg = await status_of(lambda: stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(name="a")))
            assert code == grpc.StatusCode.FAILED_PRECONDITION
            assert msg == "LoRA adapter `a` has 1 requests in flight; unload it once they finish"
            loaded = await stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(name="c", path=str(adapters["c"])))
            assert loaded.id == 3
            assert len(await long_a) == 1000  # the refused unload did not disturb it
            assert await asyncio.gather(*others) == [base, with_b] * 6
            done = await stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(name="a"))
            assert done.adapter.name == "a"
            code, msg = await status_of(lambda: stub.Generate(greedy("a")))
            assert (code, msg) == (grpc.StatusCode.NOT_FOUND, "LoRA adapter `a` is not loaded (loaded: `b`, `c`)")
            assert await ids_of(stub, greedy("b")) == with_b
    run(body())


def test_max_loras_swaps_out_the_least_recently_used_idle_adapter(checkpoint, adapters):
    async def body():
        loras = (f"a={adapters['a']}", f"b={adapters['b']}")
        async with engine_server(checkpoint, loras=loras, max_loras=2, lora_roots=roots(adapters)) as (server, stub, _):
            with_a = await ids_of(stub, greedy("a"))
            await ids_of(stub, greedy("b"))  # a is now the least recently used
            await stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(name="c", path=str(adapters["c"])))
            engine = server.app.executor
            assert sorted(engine.loras.names()) == ["b", "c"]  # a was swapped out, but is still served:
            listed = await stub.ListLoraAdapters(pb.ListLoraAdaptersRequest())
            assert [a.name for a in listed.adapters] == ["a", "b", "c"]
            assert await ids_of(stub, greedy("a")) == with_a  # read again, b swapped out
            assert sorted(engine.loras.names()) == ["a", "c"]
    run(body())


def test_lora_flag_errors():
    from tokenloop.service.config import ServerConfig

    for loras, message in [(("a",), "--lora 'a': expected NAME=DIR"), (("a=/x", "a=/y"), "--lora names must be unique"),
                           (("a=/x", "b=/y", "c=/z"), "3 --lora adapters exceed --max-loras 2")]:
        with pytest.raises(ValueError) as info:
            ServerConfig(loras=loras, max_loras=2)
        assert str(info.value) == message


def test_python_client_and_cli_parsing(checkpoint, adapters):
    from tokenloop_client import AsyncClient, NotFoundError
    from tokenloop_client.cli import build_parser

    async def body():
        async with engine_server(checkpoint, lora_roots=roots(adapters)) as (server, stub, _):
            async with AsyncClient(f"127.0.0.1:{server.port}") as client:
                loaded = await client.load_lora_adapter("a", "a", id=5)  # a path under the root
                assert (loaded.name, loaded.id, loaded.rank, loaded.target_modules) == \
                    ("a", 5, 4, ("q_proj", "v_proj", "down_proj"))
                info = await client.model_info()
                assert [a.name for a in info.lora_adapters] == ["a"]
                result = await client.generate(PROMPT, lora="a", temperature=0.0, max_new_tokens=16, ignore_eos=True)
                assert list(result.completions[0].token_ids) == await ids_of(stub, greedy("a"))
                assert [a.name for a in await client.list_lora_adapters()] == ["a"]
                assert (await client.unload_lora_adapter("a")).id == 5
                with pytest.raises(NotFoundError, match="LoRA adapter `a` is not loaded"):
                    await client.generate(PROMPT, lora="a")
    run(body())
    args = build_parser().parse_args(["generate", "hi", "--lora", "a"])
    assert args.lora == "a"
    args = build_parser().parse_args(["lora", "load", "a", "/x", "--id", "3"])
    assert (args.lora_command, args.name, args.path, args.id) == ("load", "a", "/x", 3)


def test_adapters_apply_on_int8_weights(checkpoint, adapters):
    """The low-rank products go on top of whatever the base projection is (--weights int8 here)."""
    import dataclasses

    from tests.engine_helpers import greedy_request, run_all, tokens

    engine = Engine.from_dir(checkpoint, EngineConfig(kv_cache_tokens=2048, weights="int8"))
    try:
        engine.add_lora(engine.read_lora("a", adapters["a"]))
        request = greedy_request([5, 17, 99, 3], 16)
        outs = [tokens(next(iter(run_all(engine, [r])[1].values())))
                for r in (request, dataclasses.replace(request, lora="a"))]
        assert outs[0] != outs[1]
    finally:
        engine.shutdown()
