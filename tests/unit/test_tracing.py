"""service/tracing.py: no tracing interceptor without an endpoint."""

from __future__ import annotations

from tokenloop.service.tracing import tracing_interceptor


def test_tracing_is_off_without_an_endpoint(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    assert tracing_interceptor("") is None
