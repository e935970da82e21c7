"""Fake tokenloop.v1 servers built on the Python client's own stubs: failures injected where a test wants them.

The `fake` fixture that starts them (and stops them after the test) is in tests/integration/conftest.py.
"""

from __future__ import annotations

import sys
from concurrent import futures
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[2]
try:
    import tokenloop_client  # noqa: F401
except ImportError:  # not pip-installed: use the source tree
    sys.path.insert(0, str(ROOT / "clients" / "python"))

from tokenloop_client._gen import tokenloop_pb2 as pb  # noqa: E402
from tokenloop_client._gen import tokenloop_pb2_grpc as pb_grpc  # noqa: E402


class FlakyServicer(pb_grpc.TextGenerationServicer):
    """Fails the first `num_failures` Generate calls with `code`, optionally after one chunk."""

    def __init__(self, num_failures: int, code=grpc.StatusCode.UNAVAILABLE, after_first_chunk=False):
        self.num_failures = num_failures
        self.code = code
        self.after_first_chunk = after_first_chunk
        self.num_calls = 0
        self.num_load_calls = 0
        self.metadata: list[dict] = []
        self.requests: list[pb.GenerateRequest] = []

    def Generate(self, request, context):
        self.num_calls += 1
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        if self.num_calls <= self.num_failures:
            if self.after_first_chunk:
                yield pb.GenerateResponse(request_id=request.request_id, chunk=pb.Chunk(text="Hel"))
            context.abort(self.code, "injected failure")
        yield pb.GenerateResponse(request_id=request.request_id, chunk=pb.Chunk(text="Hel"))
        yield pb.GenerateResponse(request_id=request.request_id, chunk=pb.Chunk(text="lo"))
        yield pb.GenerateResponse(request_id=request.request_id, complete=pb.Complete(
            text="Hello", finish_reason=pb.EOS, usage=pb.Usage(prompt_tokens=1, completion_tokens=2)))

    def GetLoad(self, request, context):
        self.num_load_calls += 1
        if self.num_load_calls <= self.num_failures:
            context.abort(self.code, "injected failure")
        return pb.Load(num_running=7)


def fake_server(servicer, credentials=None) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_TextGenerationServicer_to_server(servicer, server)
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    return server, f"127.0.0.1:{port}"
