"""A plaintext client against a real TLS `tokenloop serve`: UNAVAILABLE "Socket closed" on the client, and on the
server one warning with the reason, then one count per interval instead of gRPC core's line per attempt."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.live_server import free_port, tokenloop_command
from tests.tiny_model import make_tiny_model
from tests.tls_helpers import issue, make_ca, pem

pytestmark = pytest.mark.e2e


CLI = str(Path(sys.executable).parent / "tokenloop-cli")


def test_plaintext_clients_get_socket_closed_and_the_server_logs_them_rate_limited(tmp_path):
    model = make_tiny_model(tmp_path / "tiny")
    ca = make_ca("test-ca")
    key, cert = issue(ca, "localhost")
    (tmp_path / "server.pem").write_bytes(pem(cert))
    (tmp_path / "server.key").write_bytes(pem(key))
    (tmp_path / "ca.pem").write_bytes(pem(ca[1]))
    port = free_port()
    env = dict(os.environ, TOKENLOOP_HANDSHAKE_LOG_INTERVAL_S="2")
    server = subprocess.Popen([*tokenloop_command(), "serve", "--model", str(model), "--port", str(port),
                               "--tls-cert", str(tmp_path / "server.pem"), "--tls-key", str(tmp_path / "server.key")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        address = f"localhost:{port}"
        ready = subprocess.run([CLI, "--address", address, "--tls-ca", str(tmp_path / "ca.pem"), "health",
                                "--wait", "120"], capture_output=True, text=True, timeout=180)
        assert ready.stdout.strip() == "SERVING", ready.stderr
        plain = [subprocess.run([CLI, "--address", address, "info"], capture_output=True, text=True,
                                timeout=60) for _ in range(3)]  # each call tries 4 times (3 retries)
        time.sleep(3)  # past the 2 s interval: the count is logged
        tls = subprocess.run([CLI, "--address", address, "--tls-ca", str(tmp_path / "ca.pem"), "info"],
                             capture_output=True, text=True, timeout=60)
    finally:
        server.terminate()
        log, _ = server.communicate(timeout=60)
    for run in plain:
        assert run.returncode == 1
        assert run.stderr.startswith(f"error: UNAVAILABLE: no tokenloop server answered at {address} (plaintext)") \
            and "Socket closed" in run.stderr and "add --tls-ca" in run.stderr, run.stderr
    assert tls.returncode == 0, tls.stderr  # TLS clients are served as before
    assert "Handshake failed with error" not in log  # gRPC core's own line per attempt no longer reaches the log
    first = [line for line in log.splitlines() if "TLS handshake failed: WRONG_VERSION_NUMBER (a client speaking "
             "plaintext to this TLS port?); further failures are counted and logged every 2 s" in line]
    counts = [line for line in log.splitlines() if "TLS handshake failed " in line and " times in the last 2 s; last: "
              "WRONG_VERSION_NUMBER" in line]
    assert len(first) == 1, log
    assert 1 <= len(counts) <= 3, log
    assert "tokenloop ready" in log and "stopped" in log  # the server's own log lines still come through
