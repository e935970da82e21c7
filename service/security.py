"""Who may talk to the server: TLS / mutual TLS with certificate reload, API keys, and admin keys.

API keys travel as `authorization: Bearer KEY` metadata and are checked on every RPC except
health and reflection, in constant time against every configured key; the management RPCs
(loading and unloading LoRA adapters, flushing the cache, profiling) need an admin key
(`--admin-key-file`). Certificates are read again on SIGHUP or when a file's modification
time changes (checked at each new handshake).
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
from pathlib import Path

import grpc

from .decoding import handler_like
from .logs import RateLimitedLog

log = logging.getLogger("tokenloop.security")

API_KEYS_ENV = "TOKENLOOP_API_KEYS"
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
UNAUTHENTICATED_MESSAGE = "missing or invalid API key"
# The operators' RPCs of every API: they change what the server serves or drop its state (an admin key each)
MANAGEMENT_METHODS = frozenset({
    "/tokenloop.v1.TextGeneration/LoadLoraAdapter", "/tokenloop.v1.TextGeneration/UnloadLoraAdapter",
    "/vllm.grpc.engine.VllmEngine/FlushCache", "/vllm.grpc.engine.VllmEngine/StartProfile",
    "/vllm.grpc.engine.VllmEngine/StopProfile",
})
MAX_METHOD_CHARS = 200  # a method path a client sent, as logged


def load_api_keys(path: str = "", env: str | None = None) -> list[bytes]:
    """Keys from a file (one per line, `#` comments, blank lines ignored) and $TOKENLOOP_API_KEYS."""
    keys: list[str] = []
    if path:
        for line in Path(path).read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                keys.append(line)
    env = os.environ.get(API_KEYS_ENV, "") if env is None else env
    keys += [k.strip() for k in env.split(",") if k.strip()]
    return [k.encode() for k in keys]


def bearer_token(metadata) -> bytes:
    """The token of the call's `authorization: Bearer <token>` metadata; b"" without one (or another scheme)."""
    for key, value in metadata or ():
        if key == "authorization":
            value = value.decode(errors="replace") if isinstance(value, bytes) else value
            scheme, _, token = value.strip().partition(" ")
            return token.strip().encode() if scheme.lower() == "bearer" else b""
    return b""


def key_matches(token: bytes, keys: list[bytes]) -> bool:
    """Constant-time comparison against every key (no early exit)."""
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(token, key)
    return ok and bool(token)


def _unread(data: bytes) -> None:
    """The refusal's request deserializer: a caller refused here gets its status, garbage or not, and the server
    spends no parsing on what it sent."""
    return None


def _refusal(handler, code: grpc.StatusCode, message: str):
    async def refuse(request_or_iterator, context):
        await context.abort(code, message)

    async def refuse_stream(request_or_iterator, context):
        await context.abort(code, message)
        yield  # pragma: no cover (an async generator, like the handler it replaces)

    # a refused payload is never parsed
    return handler_like(handler, refuse_stream if handler.response_streaming else refuse, _unread)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses RPCs without a valid `authorization: Bearer KEY` (health and reflection exempt), and management RPCs
    (MANAGEMENT_METHODS) without an admin key.

    `keys`: the API keys (none: every RPC but the management ones is open); `admin_keys`: the admin keys (none:
    management RPCs are refused whenever API keys are set, open on a server with no key at all). An admin key is an
    API key too. Every comparison is constant-time against every key (`key_matches`)."""

    def __init__(self, keys: list[bytes], admin_keys: list[bytes] = ()):
        if not keys and not admin_keys:
            raise ValueError("ApiKeyInterceptor needs at least one key")
        self.keys, self.admin_keys = list(keys), list(admin_keys)
        self.num_refused = 0
        self.refusals = RateLimitedLog(log)  # a caller without a key repeats at will: one line per 10 s at most

    def decide(self, method: str, token: bytes) -> tuple[grpc.StatusCode, str] | None:
        """None when the call may go on, else the status and message of its refusal."""
        is_admin = key_matches(token, self.admin_keys)  # both comparisons always run: no early exit
        is_user = key_matches(token, self.keys) or is_admin
        if method in MANAGEMENT_METHODS:
            if is_admin:
                return None
            if not is_user and (self.keys or token):
                return grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE
            return grpc.StatusCode.PERMISSION_DENIED, (
                f"{method.rsplit('/', 1)[-1]} is a management RPC: it needs an admin key (--admin-key-file)"
                + ("" if self.admin_keys else "; this server has none, so management RPCs are off"))
        if is_user or not self.keys:
            return None
        return grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(EXEMPT_PREFIXES):
            return handler
        refusal = self.decide(details.method, bearer_token(details.invocation_metadata))
        if refusal is None:
            return handler
        self.num_refused += 1
        self.refusals.warning("refused an RPC to %s: %s", details.method[:MAX_METHOD_CHARS], refusal[1])
        return _refusal(handler, *refusal)


class CertificateReloader:
    """A certificate configuration fetcher for `grpc.dynamic_ssl_server_credentials`."""

    def __init__(self, cert: str, key: str, client_ca: str = ""):
        self.paths = [p for p in (cert, key, client_ca) if p]
        self.cert, self.key, self.client_ca = cert, key, client_ca
        self._lock = threading.Lock()
        self._force = False
        self._stamp = self._mtimes()
        self.num_reloads = 0

    def _mtimes(self) -> tuple:
        return tuple(os.stat(p).st_mtime_ns for p in self.paths)

    def configuration(self):
        """The current files as a grpc certificate configuration (raises OSError if unreadable)."""
        ca = Path(self.client_ca).read_bytes() if self.client_ca else None
        pair = (Path(self.key).read_bytes(), Path(self.cert).read_bytes())
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=ca)

    def request_reload(self) -> None:
        """Read the files again at the next handshake (the SIGHUP handler)."""
        with self._lock:
            self._force = True

    def __call__(self):
        """Called by grpc at each handshake: a new configuration when the files changed, else None."""
        with self._lock:
            try:
                stamp = self._mtimes()
                if not self._force and stamp == self._stamp:
                    return None
                config = self.configuration()
            except OSError as exc:  # keep serving with the certificates already loaded
                log.error("certificate reload failed, keeping the current ones: %s", exc)
                self._force = False
                return None
            self._force, self._stamp = False, stamp
            self.num_reloads += 1
            log.info("reloaded TLS certificates from %s", ", ".join(self.paths))
            return config


def server_credentials(cert: str, key: str, client_ca: str = "") -> tuple[grpc.ServerCredentials, CertificateReloader]:
    """TLS credentials (mutual TLS when `client_ca` is set) that reload, and their reloader."""
    reloader = CertificateReloader(cert, key, client_ca)
    creds = grpc.dynamic_ssl_server_credentials(reloader.configuration(), reloader,
                                                require_client_authentication=bool(client_ca))
    return creds, reloader
