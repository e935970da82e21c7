"""Optional OpenTelemetry tracing: one server span per RPC, exported over OTLP.

Enabled by `--otel-endpoint` or $OTEL_EXPORTER_OTLP_ENDPOINT, with `pip install tokenloop[otel]`
(opentelemetry-sdk and opentelemetry-exporter-otlp-proto-grpc). Without the packages it is a no-op.
"""

from __future__ import annotations

import logging
import os

import grpc

log = logging.getLogger("tokenloop.tracing")


def tracing_interceptor(endpoint: str = "", service_name: str = "tokenloop"):
    """A server interceptor that opens a span per RPC, or None when tracing is off or not installed."""
    endpoint = endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    if not endpoint:
        return None
    try:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("tracing requested (%s) but OpenTelemetry is not installed: pip install 'tokenloop[otel]'",
                    endpoint)
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    log.info("tracing RPCs to %s", endpoint)
    return TracingInterceptor(provider.get_tracer("tokenloop.service"), trace)


class TracingInterceptor(grpc.aio.ServerInterceptor):
    """Wraps unary and server-streaming handlers in a SERVER span named after the method."""

    def __init__(self, tracer, trace_api):
        self.tracer = tracer
        self.trace = trace_api

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(("/grpc.health", "/grpc.reflection")):
            return handler
        meta = {k: v for k, v in (details.invocation_metadata or ()) if isinstance(v, str)}
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(self._stream(handler.unary_stream, details.method, meta),
                                                        handler.request_deserializer, handler.response_serializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(self._unary(handler.unary_unary, details.method, meta),
                                                       handler.request_deserializer, handler.response_serializer)
        return handler

    def _span(self, method: str, meta: dict):
        from opentelemetry.propagate import extract
        attrs = {"rpc.system": "grpc", "rpc.method": method.rsplit("/", 1)[-1],
                 "rpc.service": method.strip("/").split("/")[0]}
        if "x-request-id" in meta:
            attrs["tokenloop.request_id"] = meta["x-request-id"]
        return self.tracer.start_as_current_span(method.strip("/"), context=extract(meta),
                                                 kind=self.trace.SpanKind.SERVER, attributes=attrs)

    def _stream(self, fn, method: str, meta: dict):
        async def handler(request, context):
            with self._span(method, meta):
                async for msg in fn(request, context):
                    yield msg
        return handler

    def _unary(self, fn, method: str, meta: dict):
        async def handler(request, context):
            with self._span(method, meta):
                return await fn(request, context)
        return handler
