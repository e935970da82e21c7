"""Bounds on connections: the handshake timeout and the cap grpc core enforces, a per-peer cap and the cap's log line
that it cannot, and the file-descriptor limit they need.

grpc core (1.85) closes a connection that has not completed its handshake, the HTTP/2 preface and SETTINGS included,
after `grpc.server_handshake_timeout_ms` (default 120 s: silent connections were held ~2 minutes), and closes every
connection accepted beyond `grpc.max_allowed_incoming_connections` at once, silently. It has no bound per peer
address and says nothing when its cap is reached, so `ConnectionWatch` (Linux) looks at the server's established
TCP connections twice a second (/proc/self/net/tcp{,6}, the server's port as local port): it logs when the cap is
reached, and shuts down (`shutdown(2)` on a duplicate of grpc's descriptor, checked by inode, so that grpc closes it
as if the peer had) the newest connections of a peer address beyond `--max-connections-per-peer` (and, should any
get past grpc's cap, the newest beyond `--max-connections`).
"""

from __future__ import annotations

import logging
import os
import resource
import socket
import sys
import threading
from collections import defaultdict
from dataclasses import dataclass

from .logs import RateLimitedLog

log = logging.getLogger("tokenloop.connections")
FD_HEADROOM = 256  # descriptors beside the connections: model files, compile processes' pipes, metrics, logs
ESTABLISHED = "01"


def grpc_connection_options(handshake_timeout: float, max_connections: int) -> list[tuple[str, int]]:
    """grpc core's own bounds: the handshake (TLS, HTTP/2 preface and SETTINGS) deadline and the connection cap."""
    options = [("grpc.server_handshake_timeout_ms", max(1, int(handshake_timeout * 1000)))]
    if max_connections:
        options.append(("grpc.max_allowed_incoming_connections", max_connections))
    return options


def check_fd_limit(max_connections: int) -> str | None:
    """Raise the soft RLIMIT_NOFILE to cover `max_connections` + FD_HEADROOM where the hard limit allows; a warning
    (also logged) when it cannot, else None."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max_connections + FD_HEADROOM
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(hard, need)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            log.info("raised the open-file limit from %d to %d (--max-connections %d + %d)", soft, new,
                     max_connections, FD_HEADROOM)
            soft = new
        except (ValueError, OSError) as exc:
            log.debug("setrlimit(NOFILE, %d) failed: %s", new, exc)
    if soft != resource.RLIM_INFINITY and soft < need:
        warning = (f"the open-file limit is {soft} (hard limit {hard}), below --max-connections {max_connections} "
                   f"+ {FD_HEADROOM}: connections past ~{max(0, soft - FD_HEADROOM)} may fail to be accepted; raise "
                   "it (ulimit -n, LimitNOFILE=) or lower --max-connections")
        log.warning("%s", warning)
        return warning
    return None


@dataclass(frozen=True, slots=True)
class Conn:
    """One established connection to the server's port: the peer's address and the socket's inode."""

    peer: str
    inode: int


def _address(hex_addr: str) -> str:
    """/proc/net/tcp's `HEX:PORT` address (32-bit words in host order) as text, without the port."""
    raw = bytes.fromhex(hex_addr.split(":")[0])
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)) if sys.byteorder == "little" else raw
    if len(words) == 4:
        return socket.inet_ntop(socket.AF_INET, words)
    if words[:12] == b"\0" * 10 + b"\xff\xff":  # IPv4-mapped: the same peer as over IPv4
        return socket.inet_ntop(socket.AF_INET, words[12:])
    return socket.inet_ntop(socket.AF_INET6, words)


def established(port: int, tables: tuple[str, ...] = ("/proc/self/net/tcp", "/proc/self/net/tcp6")) -> list[Conn]:
    """The established TCP connections whose local port is `port` (the ones the server accepted)."""
    out = []
    suffix = f":{port:04X}"
    for table in tables:
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    if len(fields) > 9 and fields[3] == ESTABLISHED and fields[1].endswith(suffix):
                        out.append(Conn(_address(fields[2]), int(fields[9])))
        except OSError:
            continue
    return out


def socket_fds() -> dict[int, int]:
    """inode -> descriptor of this process's sockets."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out[int(target[8:-1])] = int(name)
    return out


def shut_down(fd: int, inode: int) -> bool:
    """shutdown(2) the socket at `fd` if it still is socket `inode` (grpc then closes it as a peer's close)."""
    try:
        dup = os.dup(fd)
    except OSError:
        return False
    try:
        if os.fstat(dup).st_ino != inode:  # closed and reused meanwhile
            return False
        sock = socket.socket(fileno=dup)
        dup = -1  # the socket object owns it now
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.close()
        return True
    except OSError:
        return False
    finally:
        if dup >= 0:
            os.close(dup)


def over_cap(conns: list[Conn], per_peer: int, total: int = 0, first_seen: dict[int, int] | None = None) -> list[Conn]:
    """The newest connections of each peer beyond `per_peer` (0: no cap), then the newest of the rest beyond `total`
    (0: no cap). Newest: first seen in a later look (`first_seen`: inode -> the look that first saw it); within one
    look, the higher inode. Inodes alone do not order sockets by age: the kernel hands them out in per-CPU batches."""
    seen = first_seen or {}
    age = lambda c: (seen.get(c.inode, 1 << 62), c.inode)  # noqa: E731
    by_peer: dict[str, list[Conn]] = defaultdict(list)
    for c in conns:
        by_peer[c.peer].append(c)
    out = []
    for peer_conns in by_peer.values():
        if per_peer and len(peer_conns) > per_peer:
            out += sorted(peer_conns, key=age)[per_peer:]
    if total:
        left = sorted(set(conns) - set(out), key=age)
        out += left[total:]
    return out


class ConnectionWatch:
    """A thread that looks at the server's connections every `interval` seconds (Linux) and shuts down what is over
    the caps. `num_shut` counts the connections it shut down."""

    def __init__(self, port: int, max_connections: int, per_peer: int, interval: float = 0.5):
        self.port, self.max_connections, self.per_peer, self.interval = port, max_connections, per_peer, interval
        self.num_shut = 0
        self._looks = 0
        self._first_seen: dict[int, int] = {}  # socket inode -> the look that first saw it (which is older)
        self.cap_log = RateLimitedLog(log)
        self.peer_log = RateLimitedLog(log)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="connection-watch", daemon=True)

    @staticmethod
    def available() -> bool:
        return os.path.exists("/proc/self/net/tcp") and os.path.isdir("/proc/self/fd")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.check()
            except Exception as exc:  # noqa: BLE001  (a failing watch must not end the server; say so now and then)
                self.cap_log.warning("connection watch failed: %r", exc)

    def check(self) -> None:
        """One look: note when each socket was first seen, log the cap when reached, shut down what is over the caps.
        With fewer sockets open than the smaller cap, no cap can be reached: the look stops there (one pass over
        /proc/self/fd, not the TCP tables, which take tens of milliseconds of kernel time on a busy host)."""
        self._looks += 1
        fds = socket_fds()
        self._first_seen = {inode: self._first_seen.get(inode, self._looks) for inode in fds}
        if len(fds) < min(c for c in (self.max_connections, self.per_peer) if c):
            return
        conns = established(self.port)
        if self.max_connections and len(conns) >= self.max_connections:
            self.cap_log.warning("--max-connections %d reached (%d open): new connections are closed at once until "
                                 "some close", self.max_connections, len(conns))
        excess = over_cap(conns, self.per_peer, self.max_connections, self._first_seen)
        if not excess:
            return
        shut = sum(shut_down(fds[c.inode], c.inode) for c in excess if c.inode in fds)
        self.num_shut += shut
        peers = sorted({c.peer for c in excess})
        self.peer_log.warning("closed %d connections over --max-connections-per-peer %d (peers: %s)", shut,
                              self.per_peer, ", ".join(peers[:5]) + (", ..." if len(peers) > 5 else ""))
