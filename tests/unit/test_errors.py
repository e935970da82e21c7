"""service/errors.py: what a client is told (status_of) loses paths, stack frames and excess length; the service's own
messages pass unchanged."""

from __future__ import annotations


def test_client_messages_lose_paths_stack_frames_and_excess_length():
    from tokenloop.core.executor import ErrorKind
    from tokenloop.looper.stream import RequestFailed
    from tokenloop.service.errors import Unavailable, ValidationError, status_of
    trt = ("generation failed: [TensorRT-LLM][ERROR] Assertion failed: bad shape "
           "(/home/jenkins/agent/cpp/tensorrt_llm/runtime/gptDecoder.cpp:231)\n1  0x7f3 tensorrt_llm::common::throw")
    code, message, _ = status_of(RequestFailed(ErrorKind.INTERNAL, trt))
    assert code.name == "INTERNAL" and "/home" not in message and "0x7f3" not in message
    assert message == "generation failed: [TensorRT-LLM][ERROR] Assertion failed: bad shape (<path>:231)"
    died = Unavailable("the executor died: RuntimeError: C:\\models\\x.bin unreadable" + "!" * 900)
    assert "models" not in status_of(died)[1] and len(status_of(died)[1]) <= 503
    rule = "`top_p` must be > 0 and <= 1"  # the service's own messages pass unchanged
    assert status_of(ValidationError("top_p", rule))[1] == rule
