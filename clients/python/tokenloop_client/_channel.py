"""Channel set-up (TLS, API key), the retry policy, and a dependency-free health check codec."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from ._gen import tokenloop_pb2_grpc as pb_grpc
from .errors import ParameterError

DEFAULT_PORT = 50051
DEFAULT_ADDRESS = f"127.0.0.1:{DEFAULT_PORT}"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
HEALTH_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}
_OPTIONS = (("grpc.max_receive_message_length", 64 * 1024 * 1024),)


@dataclass(frozen=True)
class RetryPolicy:
    """Retry UNAVAILABLE calls that have not yet returned anything, with exponential backoff."""

    max_retries: int = 3
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.initial_backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("backoff times must be >= 0")

    def should_retry(self, err: grpc.RpcError, num_attempts: int, num_messages: int) -> bool:
        """True when err is UNAVAILABLE, nothing was received yet, and retries are left."""
        code = err.code() if callable(getattr(err, "code", None)) else None
        return code == grpc.StatusCode.UNAVAILABLE and num_messages == 0 and num_attempts <= self.max_retries

    def backoff_s(self, num_attempts: int) -> float:
        """Seconds to wait before attempt number num_attempts + 1."""
        return min(self.max_backoff_s, self.initial_backoff_s * 2 ** (num_attempts - 1))


@dataclass(frozen=True)
class ChannelConfig:
    """Where and how to connect: address, TLS files, API key."""

    address: str = DEFAULT_ADDRESS
    api_key: str | None = None
    tls: bool = False
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together (client certificate for mTLS)")

    @property
    def target(self) -> str:
        """The address without an http:// or https:// prefix, with port 50051 when it names none."""
        return with_port(self.address.split("://", 1)[-1])

    @property
    def secure(self) -> bool:
        """Whether to use TLS."""
        return bool(self.tls or self.tls_ca or self.tls_cert or self.address.startswith("https://"))

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Per-call metadata: the API key as `authorization: Bearer KEY`."""
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()

    def credentials(self) -> grpc.ChannelCredentials:
        """TLS credentials from the CA file and optional client certificate."""
        return grpc.ssl_channel_credentials(
            root_certificates=read_pem("tls_ca", self.tls_ca),
            private_key=read_pem("tls_key", self.tls_key),
            certificate_chain=read_pem("tls_cert", self.tls_cert),
        )

    def options(self) -> list[tuple[str, object]]:
        """Channel options."""
        opts = list(_OPTIONS)
        if self.tls_server_name:
            opts.append(("grpc.ssl_target_name_override", self.tls_server_name))
        return opts


def with_port(target: str) -> str:
    """`target` with `:50051` added when it names no port (gRPC itself would dial 443); `unix:` paths as given."""
    if target.startswith(("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:")):
        return target
    if target.startswith("["):  # [IPv6] or [IPv6]:port
        return target if "]:" in target else f"{target}:{DEFAULT_PORT}"
    if target.count(":") > 1:  # a bare IPv6 address
        return f"[{target}]:{DEFAULT_PORT}"
    return target if ":" in target else f"{target}:{DEFAULT_PORT}"


def check_address(address: str) -> None:
    """A ParameterError naming `address` when it is not HOST:PORT (a port from 1 to 65535, a host without blanks):
    gRPC would take it, fail to resolve it, and say UNAVAILABLE as if no server were there."""
    target = with_port(address.split("://", 1)[-1])
    if target.startswith(("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:")):
        return
    host, _, port = target.rpartition(":")
    ok_port = port.isdigit() and 1 <= int(port) <= 65535
    ok_host = bool(host) and not any(c.isspace() for c in host) and (
        host.startswith("[") == host.endswith("]"))
    if not (ok_port and ok_host):
        why = f"the port must be a number from 1 to 65535, not {port!r}" if not ok_port else \
            f"{host!r} is not a host name or address"
        raise ParameterError("address", f"address {address!r}: {why} (HOST:PORT, e.g. {DEFAULT_ADDRESS})")


def read_pem(name: str, path: str | None) -> bytes | None:
    """The bytes of a PEM file; a ParameterError naming `name` when it cannot be read."""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        why = "is a directory, not a PEM file" if isinstance(exc, IsADirectoryError) else \
            f"cannot be read ({exc.strerror or exc})"
        raise ParameterError(name, f"{name} {path}: {why}") from None


def sync_channel(cfg: ChannelConfig) -> grpc.Channel:
    """A blocking grpc.Channel for cfg."""
    if cfg.secure:
        return grpc.secure_channel(cfg.target, cfg.credentials(), options=cfg.options())
    return grpc.insecure_channel(cfg.target, options=cfg.options())


def aio_channel(cfg: ChannelConfig) -> grpc.aio.Channel:
    """An asyncio grpc.aio.Channel for cfg."""
    if cfg.secure:
        return grpc.aio.secure_channel(cfg.target, cfg.credentials(), options=cfg.options())
    return grpc.aio.insecure_channel(cfg.target, options=cfg.options())


class Connection:
    """What both clients hold: the channel settings, the default timeout, the retry policy, the metadata every call
    sends, the channel (the subclass's `connect`: `sync_channel` or `aio_channel`) and the TextGeneration stub."""

    connect = staticmethod(sync_channel)

    def __init__(self, address: str = ChannelConfig.address, *, api_key: str | None = None, tls: bool = False,
                 tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                 tls_server_name: str | None = None, timeout: float | None = None,
                 retry: RetryPolicy | None = None) -> None:
        self.config = ChannelConfig(address, api_key, tls, tls_ca, tls_cert, tls_key, tls_server_name)
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self._metadata = self.config.metadata()
        self._channel = self.connect(self.config)
        self._stub = pb_grpc.TextGenerationStub(self._channel)


def encode_health_request(service: str) -> bytes:
    """Serialize grpc.health.v1.HealthCheckRequest{service} without the health package."""
    data = service.encode()
    if not data:
        return b""
    return b"\x0a" + _varint(len(data)) + data


def decode_health_response(data: bytes) -> str:
    """Parse grpc.health.v1.HealthCheckResponse into its status name."""
    status, pos = 0, 0
    while pos < len(data):
        key = data[pos]
        value, pos = _read_varint(data, pos + 1)
        if key == 0x08:
            status = value
    return HEALTH_STATUS.get(status, str(status))


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        shift += 7
        if not byte & 0x80:
            return value, pos
