"""Bounds on connections through a real in-process server (service/connections.py): silent connections are closed
at the handshake timeout while a normal client is served; the cap closes connections past it at once and says so
in the log; one peer address cannot hold more than its own cap. Without a server: tests/unit/test_connections.py."""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import time

import pytest

from tests.conftest import run
from tests.integration.service_harness import serving
from tokenloop.service.connections import FD_HEADROOM, ConnectionWatch
from tokenloop.v1 import tokenloop_pb2 as pb

GEN = pb.GenerateRequest(text="Hello", stopping=pb.StoppingCriteria(max_new_tokens=2))
NUM_SILENT = 2000
HANDSHAKE_TIMEOUT = 5.0
# generous bounds: a loaded 2-core CI machine accepts 2,000 connections slowly, and the server closes them on its
# own core's timers; what must hold is "within the timeout plus slack", not minutes (grpc's default: 120 s)
CLOSE_BOUND = HANDSHAKE_TIMEOUT + 20.0


@pytest.fixture(autouse=True)
def enough_fds():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * NUM_SILENT + FD_HEADROOM + 512  # both ends live in this process
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"the hard open-file limit {hard} is below the {need} this test needs")
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def silent(port: int, n: int, source: str = "127.0.0.1") -> list[socket.socket]:
    """`n` connections that say nothing (not even the HTTP/2 preface), from `source`."""
    out = []
    for _ in range(n):
        s = socket.socket()
        s.bind((source, 0))
        s.connect(("127.0.0.1", port))
        s.setblocking(False)
        out.append(s)
    return out


def closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(4096) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


async def wait_closed(socks, bound: float) -> float | None:
    """Seconds until every socket was closed by the server (None: not within `bound`)."""
    start, open_ = time.monotonic(), set(socks)
    while open_ and time.monotonic() - start < bound:
        open_ = {s for s in open_ if not closed(s)}
        await asyncio.sleep(0.1)
    return None if open_ else time.monotonic() - start


def test_2000_silent_connections_are_closed_at_the_handshake_timeout_while_a_client_is_served(tokenizer_dir):
    async def body():
        async with serving(tokenizer_dir, handshake_timeout=HANDSHAKE_TIMEOUT, max_connections=4 * NUM_SILENT,
                           max_connections_per_peer=0) as (server, stub, _):
            started = time.monotonic()
            socks = silent(server.port, NUM_SILENT)
            opened = time.monotonic() - started
            msgs = [m async for m in stub.Generate(GEN, timeout=60)]  # served meanwhile
            still_open = sum(not closed(s) for s in socks)
            gone = await wait_closed(socks, CLOSE_BOUND)
            for s in socks:
                s.close()
            again = [m async for m in stub.Generate(GEN, timeout=60)]
            return opened, msgs, still_open, gone, again

    opened, msgs, still_open, gone, again = run(body())
    assert msgs[-1].HasField("complete") and again[-1].HasField("complete")
    assert still_open == NUM_SILENT  # served while every silent connection was held
    assert gone is not None, f"silent connections still open after {CLOSE_BOUND} s"
    assert gone >= HANDSHAKE_TIMEOUT - opened - 0.5  # closed by the timeout, not at once


def test_the_cap_closes_connections_past_it_at_once_and_says_so(tokenizer_dir, caplog):
    async def body():
        async with serving(tokenizer_dir, handshake_timeout=30.0, max_connections=50,
                           max_connections_per_peer=0) as (server, stub, _):
            await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)  # the client's connection, first
            socks = silent(server.port, 80, "127.0.0.2")
            deadline = time.monotonic() + 10  # well before the 30 s handshake timeout
            while sum(closed(s) for s in socks) < 31 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            num_closed = sum(closed(s) for s in socks)
            await asyncio.sleep(1.5)  # the watch looks twice a second
            info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)  # its connection is kept
            for s in socks:
                s.close()
            return num_closed, info

    with caplog.at_level(logging.WARNING, logger="tokenloop.connections"):
        num_closed, info = run(body())
    assert num_closed == 80 - 49 and info.model_id  # past the cap (the client's and 49 silent ones), at accept
    if ConnectionWatch.available():
        assert any("--max-connections 50 reached (50 open)" in r.getMessage() for r in caplog.records)


def test_one_peer_address_is_held_to_its_own_cap(tokenizer_dir, caplog):
    if not ConnectionWatch.available():
        pytest.skip("no /proc/self/net/tcp: the per-peer cap is Linux-only")

    async def body():
        async with serving(tokenizer_dir, handshake_timeout=60.0, max_connections_per_peer=10) as (server, stub, _):
            early = silent(server.port, 4, "127.0.0.2")
            await asyncio.sleep(1.5)  # the watch (twice a second) has seen these before the burst
            socks = early + silent(server.port, 36, "127.0.0.2")
            deadline = time.monotonic() + 15
            while sum(closed(s) for s in socks) < 30 and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            num_closed = sum(closed(s) for s in socks)
            msgs = [m async for m in stub.Generate(GEN, timeout=60)]  # another address: served
            early_kept = [s for s in early if not closed(s)]
            for s in socks:
                s.close()
            return num_closed, msgs, len(early_kept), server.connections.num_shut

    with caplog.at_level(logging.WARNING, logger="tokenloop.connections"):
        num_closed, msgs, early_kept, num_shut = run(body())
    assert num_closed == 30 and num_shut == 30 and early_kept == 4  # 10 stay, the connections seen first among them
    assert msgs[-1].HasField("complete")
    assert any("over --max-connections-per-peer 10 (peers: 127.0.0.2)" in r.getMessage() for r in caplog.records)
