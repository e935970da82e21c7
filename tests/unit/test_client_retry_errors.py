"""A retried call that fails reports why the first attempt failed, not only the last retry's "Connection refused".

The fault demo in docs/operations.md (run by the docs check) shows it end to end: the stream gets UNAVAILABLE
"the executor is not available: ..." from the dying server, the client retries, the server is gone.
"""

from __future__ import annotations

import grpc

from tokenloop_client import UnavailableError
from tokenloop_client.errors import from_retried

REFUSED = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:50052: Failed to connect to "
           "remote host: Connection refused")


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def test_the_first_attempts_status_comes_first_with_the_last_one_after_it():
    first = FakeRpcError(grpc.StatusCode.UNAVAILABLE, "the executor is not available: injected fault")
    last = FakeRpcError(grpc.StatusCode.UNAVAILABLE, REFUSED)
    err = from_retried(first, last, num_attempts=4, request_id="r1")
    assert isinstance(err, UnavailableError) and err.request_id == "r1"
    assert str(err) == ("UNAVAILABLE: the executor is not available: injected fault (retried 3 times; last: "
                        f"UNAVAILABLE: {REFUSED})")


def test_the_same_failure_every_time_is_reported_once():
    first, last = FakeRpcError(grpc.StatusCode.UNAVAILABLE, REFUSED), FakeRpcError(grpc.StatusCode.UNAVAILABLE, REFUSED)
    assert from_retried(first, last, num_attempts=4).message == REFUSED
    assert from_retried(first, first, num_attempts=1).message == REFUSED
