"""gRPC core's log lines, read off stderr: failed TLS handshakes logged rate-limited, core lines below ERROR dropped
unless asked, every other line passed on.

gRPC's C++ core writes one line per failed TLS handshake straight to file descriptor 2 (`ssl_transport_security.cc
... Handshake failed with error SSL_ERROR_SSL: ... WRONG_VERSION_NUMBER`), and Python has no hook for it: a
plaintext client retrying against a TLS port filled the log with a line per attempt. grpcio 1.85 also prints its
INFO lines by default (`I1206 ... fork_posix.cc:71] Other threads are currently calling into gRPC, skipping fork()
handlers` when the compile processes start). `CoreLogRelay` puts a pipe in place of fd 2 and reads it on a thread:
a failed handshake (an INFO line) becomes one warning with its reason, then at most one line per interval with the
count (`HandshakeLog`); gRPC's other INFO, WARNING and DEBUG lines are dropped unless GRPC_VERBOSITY asks for them
(DEBUG or INFO) or GRPC_TRACE is set; every other line (gRPC's errors, anything else) is written to the real stderr
unchanged (`CoreLines`). Python's own logging is pointed at the real stderr directly, so it never passes through the
relay, and so is `faulthandler` (on while the relay runs): a crash kills the relay's thread with the process, and the
fatal signal's traceback would otherwise be lost in the pipe. What the pipe still holds when the process dies (gRPC
core's `F` line, an `abort()`'s message, written just before the end) is passed on by a small child process, the
pipe's last reader (`LAST_READER`): it waits on a pipe only the server holds, and when that ends it copies what is
left to the real stderr. A line that never ends (no newline) is passed on in pieces of `MAX_LINE_BYTES`.
(GRPC_VERBOSITY=ERROR itself would silence the handshake lines too, which the relay needs.)
"""

from __future__ import annotations

import faulthandler
import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger("tokenloop.security")

INTERVAL_ENV = "TOKENLOOP_HANDSHAKE_LOG_INTERVAL_S"
DEFAULT_INTERVAL_S = 60.0
MAX_LINE_BYTES = 65536  # the relay holds at most this much of a line that has not ended: then it passes it on
_MARK = b"Handshake failed"
_CORE_BELOW_ERROR = re.compile(rb"^[IWD]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [^ \]]+:\d+\] ")  # absl's prefix: I1206 23:10:33.708895 6684 file.cc:71]
_REASON = re.compile(r"SSL routines:(?:[^:]*:)?([A-Z][A-Z0-9_]+)(?::|$)")
HINTS = {
    "WRONG_VERSION_NUMBER": "a client speaking plaintext to this TLS port?",
    "HTTP_REQUEST": "a client speaking plaintext HTTP to this TLS port?",
    "PEER_DID_NOT_RETURN_A_CERTIFICATE": "a client without a certificate (--tls-client-ca requires one)",
    "CERTIFICATE_VERIFY_FAILED": "a client certificate not signed by --tls-client-ca?",
    "TLSV1_ALERT_UNKNOWN_CA": "the client does not trust this server's certificate (its CA)",
    "SSLV3_ALERT_BAD_CERTIFICATE": "the client rejected this server's certificate",
}


def core_info_asked(env=os.environ) -> bool:
    """Whether the user asked for gRPC's lines below ERROR (GRPC_VERBOSITY DEBUG or INFO, or any GRPC_TRACE)."""
    return env.get("GRPC_VERBOSITY", "").upper() in ("DEBUG", "INFO") or bool(env.get("GRPC_TRACE"))


def reason_of(line: str) -> str:
    """The OpenSSL reason of a handshake-failure line, with a hint where one is known."""
    m = _REASON.search(line)
    reason = m.group(1) if m else line.split("Handshake failed", 1)[-1].strip(" :")[:200]
    hint = HINTS.get(reason)
    return f"{reason} ({hint})" if hint else reason


class HandshakeLog:
    """Rate-limited warnings for failed handshakes: the first of a quiet period at once, then one line per
    `interval` with how many more failed and the last reason."""

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic):
        self.interval = interval
        self.clock = clock
        self.window_start: float | None = None  # set while failures are being counted
        self.count = 0
        self.last = ""

    def failed(self, line: str) -> None:
        reason, now = reason_of(line), self.clock()
        if self.window_start is None:
            log.warning("TLS handshake failed: %s; further failures are counted and logged every %.0f s",
                        reason, self.interval)
            self.window_start = now
            return
        self.count += 1
        self.last = reason
        self.tick()

    def tick(self) -> None:
        """Log the count when the interval is over (called on each failure and while idle)."""
        if self.window_start is None or self.clock() - self.window_start < self.interval:
            return
        if self.count:
            log.warning("TLS handshake failed %d times in the last %.0f s; last: %s", self.count, self.interval,
                        self.last)
            self.window_start, self.count = self.clock(), 0
        else:
            self.window_start = None  # quiet: the next failure is logged at once


class CoreLines:
    """The relay's filter over the bytes read off the pipe (`feed`, then `end`): whole lines to `line`, a line that
    does not end within MAX_LINE_BYTES passed on in pieces of that size (so the relay holds at most that much)."""

    def __init__(self, handshakes: HandshakeLog, keep_info: bool, write: Callable[[bytes], object]):
        self.handshakes, self.keep_info, self.write = handshakes, keep_info, write
        self.pending = b""

    def feed(self, chunk: bytes) -> None:
        *lines, self.pending = (self.pending + chunk).split(b"\n")
        for line in lines:
            self.line(line + b"\n")
        while len(self.pending) > MAX_LINE_BYTES:
            piece, self.pending = self.pending[:MAX_LINE_BYTES], self.pending[MAX_LINE_BYTES:]
            self.line(piece)

    def end(self) -> None:
        """The pipe is closed: what is left of an unended line goes out."""
        if self.pending:
            self.line(self.pending)
            self.pending = b""

    def line(self, line: bytes) -> None:
        """A failed handshake to HandshakeLog; gRPC core's lines below ERROR dropped unless asked; the rest written."""
        if _MARK in line:
            self.handshakes.failed(line.decode(errors="replace"))
        elif self.keep_info or not _CORE_BELOW_ERROR.match(line):
            self.write(line)


# The pipe's last reader: `python -c LAST_READER PIPE LIFELINE`. Blocks until LIFELINE ends (the server closed it at
# stop, or died), then copies what the pipe still holds to its stderr (the real one) until the pipe is empty for
# 0.5 s or closed (a compile process the server started may still hold its write end).
LAST_READER = """
import os, select, sys
pipe, lifeline = int(sys.argv[1]), int(sys.argv[2])
while os.read(lifeline, 4096):
    pass
while select.select([pipe], [], [], 0.5)[0]:
    chunk = os.read(pipe, 65536)
    if not chunk:
        break
    os.write(2, chunk)
"""


class CoreLogRelay:
    """Replaces fd 2 with a pipe read by a thread (`start` / `stop`); its last reader is a child (module docstring)."""

    def __init__(self, interval: float | None = None):
        interval = float(os.environ.get(INTERVAL_ENV, DEFAULT_INTERVAL_S)) if interval is None else interval
        self.handshakes = HandshakeLog(interval)
        self.keep_info = core_info_asked()
        self.last_reader: subprocess.Popen | None = None
        self._saved_fd: int | None = None
        self._read_fd: int | None = None
        self._lifeline: int | None = None  # the write end of the last reader's lifeline: only this process holds it
        self._thread: threading.Thread | None = None
        self._restore: list = []  # (handler, stream) and sys.stderr as they were
        self._faulthandler_was = False

    def start(self) -> None:
        sys.stderr.flush()
        self._saved_fd = os.dup(2)
        self._read_fd, write_fd = os.pipe()
        lifeline_read, self._lifeline = os.pipe()
        self.last_reader = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", LAST_READER, str(self._read_fd), str(lifeline_read)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._saved_fd,
            pass_fds=(self._read_fd, lifeline_read))
        os.close(lifeline_read)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        real = os.fdopen(os.dup(self._saved_fd), "w", buffering=1, errors="backslashreplace")
        for handler in logging.getLogger().handlers:  # Python's logging goes to the real stderr, not the pipe
            if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stderr, sys.__stderr__):
                self._restore.append((handler, handler.setStream(real)))
        self._restore.append((None, sys.stderr))
        sys.stderr = real
        # a crash (a kernel's SIGSEGV, an abort) ends the relay's thread with the process, and what was still in the
        # pipe is lost: the fatal signal's Python traceback goes to the real stderr directly
        self._faulthandler_was = faulthandler.is_enabled()
        faulthandler.enable(file=real, all_threads=True)
        self._thread = threading.Thread(target=self._run, name="tokenloop-corelog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Put the real stderr back on fd 2; the thread drains what is left and ends, then the last reader."""
        if self._saved_fd is None:
            return
        os.dup2(self._saved_fd, 2)  # closes the pipe's last write end: the reader sees EOF
        if self._thread is not None:
            self._thread.join(timeout=2)
        for handler, stream in self._restore:
            if handler is None:
                sys.stderr = stream
            else:
                handler.setStream(stream)
        faulthandler.disable()
        if self._faulthandler_was:  # on again, where it can write (sys.stderr may be a test's capture: no fd)
            try:
                faulthandler.enable(file=sys.stderr, all_threads=True)
            except (AttributeError, OSError, ValueError):
                faulthandler.enable(file=sys.__stderr__, all_threads=True)
        os.close(self._lifeline)  # the last reader finds the pipe empty (or closed) and ends
        if self.last_reader is not None:
            try:
                self.last_reader.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.last_reader.kill()
                self.last_reader.wait()
        os.close(self._saved_fd)
        self._saved_fd = None

    def _run(self) -> None:
        lines = CoreLines(self.handshakes, self.keep_info, self._write)
        tick = max(self.handshakes.interval / 4, 0.05)
        while True:
            ready, _, _ = select.select([self._read_fd], [], [], tick)
            if not ready:
                self.handshakes.tick()
                continue
            chunk = os.read(self._read_fd, 65536)
            if not chunk:
                break
            lines.feed(chunk)
        lines.end()
        os.close(self._read_fd)

    def _write(self, line: bytes) -> None:
        if self._saved_fd is not None:  # None: stop() gave up waiting for this thread
            os.write(self._saved_fd, line)
