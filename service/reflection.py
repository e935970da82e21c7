"""Server reflection that also resolves method symbols (`grpcurl describe tokenloop.v1.TextGeneration.Generate`).

grpcio-reflection answers `file_containing_symbol` with the descriptor pool's `FindFileContainingSymbol`, which in
protobuf's upb backend finds messages, enums, services and fields but not methods: grpcurl then said "Symbol not
found" for a method. `MethodAwarePool` is the default pool with that one fallback: a `Service.Method` name resolves
to the file of its service.
"""

from __future__ import annotations

from google.protobuf import descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2

from .frontdoor import add_service


class MethodAwarePool:
    """The default descriptor pool, whose `FindFileContainingSymbol` also finds `package.Service.Method`."""

    def __init__(self, pool=None):
        self.pool = pool or descriptor_pool.Default()

    def FindFileContainingSymbol(self, symbol: str):  # noqa: N802 - the pool's own method name
        try:
            return self.pool.FindFileContainingSymbol(symbol)
        except KeyError:
            try:
                return self.pool.FindMethodByName(symbol).containing_service.file
            except KeyError:
                raise KeyError(symbol) from None

    def __getattr__(self, name: str):
        return getattr(self.pool, name)


def enable(service_names: list[str], server) -> None:
    """Server reflection for `service_names` (and the reflection service itself) on `server` (grpc.aio): what
    `reflection.enable_server_reflection` registers, through `frontdoor.add_service` (no method registered with grpc
    core: see there)."""
    servicer = reflection.aio.ReflectionServicer([*service_names, reflection.SERVICE_NAME], pool=MethodAwarePool())
    add_service(server, servicer, reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"])
