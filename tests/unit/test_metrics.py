"""service/metrics.py RequestMetrics: what a finished request adds to /metrics."""

import grpc
from prometheus_client import CollectorRegistry

from tokenloop.core.request import EmbedParams, FinishReason, ValidRequest
from tokenloop.looper.stream import Complete, Timing
from tokenloop.service.metrics import RequestMetrics


def _sample(registry, name, labels=None):
    return registry.get_sample_value(name, labels or {}) or 0.0


def _complete(**kw):
    return Complete(index=0, text="", token_ids=[], finish_reason=FinishReason.LENGTH, prompt_tokens=3, seed=0,
                    timing=Timing(0.01, 0.02, 0.03), **kw)


def test_a_generation_counts_its_finish_reason_and_tokens():
    registry = CollectorRegistry()
    metrics = RequestMetrics(registry)
    done = _complete()
    done.token_ids = [4, 5]
    metrics.on_request_end(ValidRequest("g", (1, 2, 3)), [done], grpc.StatusCode.OK, {})
    assert _sample(registry, "tokenloop:requests_total", {"code": "OK"}) == 1
    assert _sample(registry, "tokenloop:request_success_total", {"finished_reason": "length"}) == 1
    assert _sample(registry, "tokenloop:time_to_first_token_seconds_count") == 1


def test_an_embedding_counts_as_a_request_but_not_as_a_generated_sequence():
    registry = CollectorRegistry()
    metrics = RequestMetrics(registry)
    valid = ValidRequest("e", (1, 2, 3), embed=EmbedParams("last", True))
    metrics.on_request_end(valid, [_complete(embedding=[0.5, 0.5])], grpc.StatusCode.OK, {})
    assert _sample(registry, "tokenloop:requests_total", {"code": "OK"}) == 1
    assert _sample(registry, "tokenloop:request_success_total", {"finished_reason": "length"}) == 0
    assert _sample(registry, "tokenloop:time_to_first_token_seconds_count") == 0
