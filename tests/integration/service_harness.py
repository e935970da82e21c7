"""An in-process tokenloop server on an ephemeral loopback port, for integration tests."""

from __future__ import annotations

import contextlib

import grpc

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
