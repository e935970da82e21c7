"""An in-process tokenloop server on an ephemeral loopback port, for integration tests.

`serving` yields a tokenloop.v1 stub, `trtllm` a trtllm.TrtllmService stub; `gen`, `read_all` and `wait_for` build
and read the router API's calls.
"""

from __future__ import annotations

import asyncio
import contextlib
from contextlib import asynccontextmanager

import grpc
from smg_grpc_proto.generated import trtllm_service_pb2 as tpb
from smg_grpc_proto.generated import trtllm_service_pb2_grpc as tpb_grpc

from tests.scripted_executor import ScriptedExecutor
from tokenloop.service.config import ServerConfig
from tokenloop.service.server import Server
from tokenloop.v1 import tokenloop_pb2_grpc


@contextlib.asynccontextmanager
async def serving(model_dir, executor=None, **config):
    """Yields (server, stub, executor) inside a running event loop; stops everything afterwards."""
    executor = executor or ScriptedExecutor()
    server = Server(ServerConfig(model=str(model_dir), port=0, **config), executor_factory=lambda cfg: executor)
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield server, tokenloop_pb2_grpc.TextGenerationStub(channel), executor
    finally:
        await channel.close()
        await server.stop(grace=1.0)


@asynccontextmanager
async def trtllm(model_dir, executor=None, **config):
    """(server, TrtllmService stub, executor) on a running server."""
    async with serving(model_dir, executor, **config) as (server, _stub, ex):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield server, tpb_grpc.TrtllmServiceStub(channel), ex


def gen(ids, max_tokens=8, streaming=True, **kw) -> tpb.GenerateRequest:
    return tpb.GenerateRequest(tokenized=tpb.TokenizedInput(input_token_ids=ids), max_tokens=max_tokens,
                               streaming=streaming, **kw)


async def read_all(call) -> list:
    out = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        out.append(msg)
    return out


async def wait_for(predicate, timeout=10.0) -> bool:
    """Poll `predicate` every 10 ms until it holds or `timeout` s passed; what it last returned."""
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return predicate()


async def stalled_reader_is_cut(server, executor, open_call) -> None:
    """A client with a tiny flow-control window reads one message of the call `open_call(channel)` starts and no
    more, so the server's writes stop completing: the stall watchdog cancels the request in the executor, and it
    leaves the looper and admission."""
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=[
        ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)])
    call = open_call(channel)
    try:
        await call.read()  # grpc.aio starts a call when it is first read; then stop reading
        assert await wait_for(lambda: executor.cancels, timeout=20)
        assert await wait_for(lambda: executor.num_active == 0 and server.app.looper.num_open == 0)
        assert await wait_for(lambda: server.app.admission.num_active == 0)
    finally:
        call.cancel()
        await channel.close()
