"""Unit tests start no server: while a test under tests/unit sets up, runs and tears down (its module- and
session-scoped fixtures included), `grpc.server` and `grpc.aio.server` fail it with a message that says where
such a test belongs. A test that serves goes to tests/integration (an in-process server, service_harness.py's
`serving`) or tests/e2e (a real `tokenloop serve` process). CONTRIBUTING.md, "Tests", has the layout. The `fake`
fixture, shared by the TensorRT-LLM adapters' tests, puts the fake tensorrt_llm (tests/fakes) in the real one's place.
"""

from __future__ import annotations

import contextlib

import grpc
import grpc.aio
import pytest

from tests.fakes.fixtures import fake_trtllm

SERVER_IN_A_UNIT_TEST = ("a unit test started a gRPC server ({}): unit tests start no server; move the test to "
                         "tests/integration (in-process server: tests/integration/service_harness.py) or tests/e2e "
                         "(a real process) - CONTRIBUTING.md, Tests")


def _refuse(name: str):
    def server(*args, **kwargs):
        # pytest.fail raises outside Exception, so code under test that catches Exception cannot swallow it
        pytest.fail(SERVER_IN_A_UNIT_TEST.format(name), pytrace=True)
    return server


@contextlib.contextmanager
def no_servers():
    """`grpc.server` and `grpc.aio.server` fail the test for as long as this lasts."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grpc, "server", _refuse("grpc.server"))
        patch.setattr(grpc.aio, "server", _refuse("grpc.aio.server"))
        yield


# Hook wrappers rather than an autouse fixture: a module-scoped fixture is set up before any function-scoped
# one, so only the phases themselves cover every fixture. pytest calls these for items under tests/unit only.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with no_servers():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with no_servers():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    with no_servers():
        return (yield)


@pytest.fixture
def fake():
    """The fake tensorrt_llm package (tests/fakes) importable as `tensorrt_llm` for the test: the TensorRT-LLM
    adapters' unit tests run without a GPU."""
    with fake_trtllm() as module:
        yield module
