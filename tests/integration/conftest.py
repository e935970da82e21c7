"""Fixtures shared by the integration tests (the in-process server itself is service_harness.py's `serving`)."""

from __future__ import annotations

import pytest

from tests.integration.client_fakes import fake_server


@pytest.fixture
def fake():
    servers = []

    def start(servicer, credentials=None):
        server, addr = fake_server(servicer, credentials)
        servers.append(server)
        return addr

    yield start
    for server in servers:
        server.stop(None)
