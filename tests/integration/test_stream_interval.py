"""--stream-interval through a real in-process server: chunks of at least N tokens, the last one excepted, that add
up to the complete text. (The writer's own rules, without a server: tests/unit/test_null_executor.py.)"""

from __future__ import annotations

import grpc

from tests.conftest import run
from tests.integration.service_harness import serving
from tests.scripted_executor import ScriptedExecutor
from tokenloop.v1 import tokenloop_pb2 as pb


def test_stream_interval_end_to_end(tokenizer_dir):
    async def body():
        ex = ScriptedExecutor(tick=0.001)
        async with serving(tokenizer_dir, executor=ex, stream_interval=4) as (_, stub, _):
            call = stub.Generate(pb.GenerateRequest(text="Hello world, this is a longer prompt", stream=True,
                                                    stopping=pb.StoppingCriteria(max_new_tokens=18)))
            out = []
            while (msg := await call.read()) is not grpc.aio.EOF:
                out.append(msg)
            return out
    msgs = run(body())
    sizes = [len(m.chunk.token_ids) for m in msgs if m.WhichOneof("response") == "chunk"]
    assert sum(sizes) == 18 and all(n >= 4 for n in sizes[:-1]), sizes
    assert msgs[-1].complete.text == "".join(m.chunk.text for m in msgs[:-1])
