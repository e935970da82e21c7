"""grpc.health.v1.Health with `List`: the installed grpcio-health-checking (1.85) leaves it unimplemented."""

from __future__ import annotations

from grpc_health.v1 import health, health_pb2


class HealthServicer(health.aio.HealthServicer):
    """Check and Watch as grpc's; List answers every service's status (the ones `App.set_serving` names)."""

    async def List(self, request, context):
        statuses = dict(self._server_status)  # the base class's table (a snapshot: no await in between)
        return health_pb2.HealthListResponse(
            statuses={name: health_pb2.HealthCheckResponse(status=status) for name, status in statuses.items()})
