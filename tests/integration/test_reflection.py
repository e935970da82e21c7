"""Server reflection resolves method symbols too: `grpcurl describe tokenloop.v1.TextGeneration.Generate` said
"Symbol not found" (issue 44); services, messages and unknown names as before."""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.conftest import run
from tests.integration.service_harness import serving


def test_a_method_symbol_resolves_to_its_services_file(tokenizer_dir):
    async def body():
        async with serving(tokenizer_dir) as (server, _, _):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = reflection_pb2_grpc.ServerReflectionStub(channel)
                names = ["tokenloop.v1.TextGeneration.Generate", "tokenloop.v1.TextGeneration",
                         "tokenloop.v1.GenerateRequest", "tokenloop.v1.TextGeneration.NoSuchMethod"]
                requests = [reflection_pb2.ServerReflectionRequest(file_containing_symbol=n) for n in names]
                return [r async for r in stub.ServerReflectionInfo(iter(requests))]

    *found, missing = run(body())
    for response in found:
        (first, *_) = response.file_descriptor_response.file_descriptor_proto
        assert descriptor_pb2.FileDescriptorProto.FromString(first).name == "tokenloop/v1/tokenloop.proto"
    assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
