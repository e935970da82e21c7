"""gRPC's C-core log lines stay off the server's and the CLI's stderr unless asked, and the CLI says what answered
when it is not a tokenloop server (the relay's filter alone: tests/unit/test_corelog.py)."""

from __future__ import annotations

import http.server
import re
import threading

import grpc
import pytest

from tests.e2e.live_server import Proc, free_port, gen, outcome
from tests.e2e.tools import cli

pytestmark = pytest.mark.e2e

CORE_LINE = re.compile(r"^[IWDE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]", re.MULTILINE)
NOT_ASKED = {"GRPC_VERBOSITY": "", "GRPC_TRACE": ""}


def test_no_grpc_core_info_lines_on_the_servers_or_the_clis_stderr():
    server = Proc(env=NOT_ASKED)  # start-up forks the compile processes: gRPC logged `fork_posix.cc` INFO lines
    try:
        code, _ = outcome(server.stub, gen(max_new=2))
        assert code == grpc.StatusCode.OK
        run = cli("--address", f"127.0.0.1:{server.port}", "--tls", "--timeout", "10", "health")  # TLS to plaintext
    finally:
        server.proc.terminate()
        assert server.wait() == 0
    log = "".join(server.lines)
    assert "tokenloop ready" in log and not CORE_LINE.search(log), log
    assert run.returncode == 1 and not CORE_LINE.search(run.stderr), run.stderr  # was: ssl_transport_security.cc
    assert run.stderr.startswith(f"error: UNAVAILABLE: something answered at 127.0.0.1:{server.port} (TLS), but not "
                                 "a TLS server (it answered in plaintext): drop --tls/--tls-ca/https://"), run.stderr


def test_an_http_server_at_the_address_is_not_taken_for_no_server():
    port = free_port()
    httpd = http.server.HTTPServer(("127.0.0.1", port), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        run = cli("--address", f"127.0.0.1:{port}", "--timeout", "10", "health")
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert run.returncode == 1
    assert run.stderr.startswith(f"error: UNAVAILABLE: something answered at 127.0.0.1:{port} (plaintext), but not a "
                                 "gRPC server (it does not speak HTTP/2: an HTTP/1 web server?): "), run.stderr
    assert "tokenloop serve --port" not in run.stderr and not CORE_LINE.search(run.stderr)
