"""Failed TLS handshakes are logged with their reason, then counted: one line per interval, not one per attempt;
gRPC core's lines below ERROR are dropped unless asked (end to end: tests/e2e/test_core_log.py)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from tokenloop.service.corelog import MAX_LINE_BYTES, CoreLines, CoreLogRelay, HandshakeLog, reason_of

LINE = ("I1204 15:43:18.104506   15420 ssl_transport_security.cc:2563] Handshake failed with error SSL_ERROR_SSL: "
        "error:100000f7:SSL routines:OPENSSL_internal:WRONG_VERSION_NUMBER: Invalid certificate verification context")


def test_reason_and_hint():
    assert reason_of(LINE) == "WRONG_VERSION_NUMBER (a client speaking plaintext to this TLS port?)"
    assert reason_of("Handshake failed with error SSL_ERROR_SSL: error:1000045c:SSL routines:OPENSSL_internal:"
                     "SOMETHING_ELSE: x") == "SOMETHING_ELSE"


def test_first_failure_at_once_then_one_count_per_interval(caplog):
    now = [0.0]
    hl = HandshakeLog(60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="tokenloop.security"):
        for t in (0.0, 1.0, 2.0, 30.0):  # four failures in the first minute
            now[0] = t
            hl.failed(LINE)
        now[0] = 59.0
        hl.tick()
        now[0] = 61.0
        hl.tick()  # the minute is over: one line with the three counted since the first
        now[0] = 130.0
        hl.tick()  # a quiet minute: nothing, and the next failure is logged at once again
        hl.failed(LINE)
    assert [r.getMessage() for r in caplog.records] == [
        "TLS handshake failed: WRONG_VERSION_NUMBER (a client speaking plaintext to this TLS port?); further "
        "failures are counted and logged every 60 s",
        "TLS handshake failed 3 times in the last 60 s; last: WRONG_VERSION_NUMBER (a client speaking plaintext to "
        "this TLS port?)",
        "TLS handshake failed: WRONG_VERSION_NUMBER (a client speaking plaintext to this TLS port?); further "
        "failures are counted and logged every 60 s",
    ]


INFO = b"I1206 22:48:00.929646   12057 fork_posix.cc:71] Other threads are currently calling into gRPC, skipping fork()\n"
ERROR = b"E1206 22:48:00.929646   12057 chttp2_server.cc:1053] UNKNOWN:No address added out of total 1 resolved\n"
OTHER = b"something else on stderr\n"


@pytest.mark.parametrize("env, kept", [({}, [ERROR, OTHER]), ({"GRPC_VERBOSITY": "info"}, [INFO, ERROR, OTHER]),
                                       ({"GRPC_TRACE": "http"}, [INFO, ERROR, OTHER]),
                                       ({"GRPC_VERBOSITY": "ERROR"}, [ERROR, OTHER])])
def test_core_lines_below_error_are_dropped_unless_asked(monkeypatch, env, kept):
    """grpcio 1.85 prints its INFO lines by default (issue 44); a handshake line still reaches HandshakeLog."""
    for name in ("GRPC_VERBOSITY", "GRPC_TRACE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    relay = CoreLogRelay(interval=60.0)
    failed, written = [], []
    relay.handshakes.failed = failed.append
    lines = CoreLines(relay.handshakes, relay.keep_info, written.append)
    for line in (INFO, ERROR, LINE.encode() + b"\n", OTHER):
        lines.feed(line)
    assert written == kept
    assert failed == [LINE + "\n"]


CRASH = """
import ctypes, os
from tokenloop.service.corelog import CoreLogRelay
CoreLogRelay().start()
os.write(2, b"a line for the relay\\n")
ctypes.string_at(0)  # SIGSEGV, as a native kernel's fault would be
"""


def test_a_crash_while_the_relay_runs_still_reaches_stderr():
    """The relay's thread dies with the process: a fatal signal's traceback (a kernel's SIGSEGV) was lost in the pipe
    (it went to fd 2, the pipe, even with PYTHONFAULTHANDLER set); it now goes to the real stderr."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONFAULTHANDLER", "GRPC_VERBOSITY", "GRPC_TRACE")}
    run = subprocess.run([sys.executable, "-c", CRASH], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode != 0
    assert "Fatal Python error: Segmentation fault" in run.stderr, run.stderr[-2000:]
    assert "ctypes" in run.stderr or "string_at" in run.stderr or "<string>" in run.stderr  # the Python stack


def test_lines_are_passed_on_whole_and_an_unended_line_in_bounded_pieces():
    written = []
    lines = CoreLines(HandshakeLog(60.0), False, written.append)
    lines.feed(b"first li")
    lines.feed(b"ne\nsecond\nthi")
    assert written == [b"first line\n", b"second\n"] and lines.pending == b"thi"
    endless = b"x" * (3 * MAX_LINE_BYTES + 10)  # no newline comes: the relay must not hold it all
    for i in range(0, len(endless), 4096):
        lines.feed(endless[i:i + 4096])
        assert len(lines.pending) <= MAX_LINE_BYTES
    lines.feed(b"\n")
    lines.end()
    assert b"".join(written[2:]) == b"thi" + endless + b"\n"
    assert all(len(piece) <= MAX_LINE_BYTES for piece in written[2:])


ABORT = """
import os
from tokenloop.service.corelog import CoreLogRelay
CoreLogRelay().start()
os.write(2, b"F1207 02:00:00.000000 1 chttp2.cc:1] the last words before the abort\\n")
os.abort()  # at once, holding the GIL: the relay's thread gets no chance to read the line
"""


def test_a_line_written_just_before_an_abort_reaches_stderr():
    """The pipe's last reader (a child process) copies what the pipe holds when the server dies; the relay's thread
    dies with the process and lost that line (gRPC core's F line before its abort)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONFAULTHANDLER", "GRPC_VERBOSITY", "GRPC_TRACE")}
    run = subprocess.run([sys.executable, "-c", ABORT], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode != 0
    assert "the last words before the abort" in run.stderr, run.stderr[-2000:]
    assert "Fatal Python error: Aborted" in run.stderr, run.stderr[-2000:]
