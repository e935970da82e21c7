"""Prometheus `/metrics`: the load gauges routers and endpoint pickers read, plus request histograms.

Gauges are collected at scrape time from `App.load()` (the numbers `tokenloop.v1.GetLoad` returns), so they
are always current; histograms and counters are fed by an observer in `app.observers`. Each App gets its
own registry, so several servers in one process (tests) do not clash.
"""

from __future__ import annotations

import logging

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tokenloop.core.request import FinishReason, ValidRequest
from tokenloop.looper.stream import Complete

log = logging.getLogger("tokenloop.service")

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class LoadCollector:
    """`tokenloop:*` gauges from `app.load()`, read at every scrape."""

    def __init__(self, app):
        self.app = app

    def collect(self):
        load = self.app.load()
        for name, doc, value in (
            ("num_requests_running", "Requests the executor is generating for.", load.num_running),
            ("num_requests_waiting", "Requests admitted or queued but not yet running.", load.num_waiting),
            ("kv_cache_usage_perc", "KV-cache blocks in use, 0 to 1.", load.kv_cache_utilization),
            ("kv_block_size", "Tokens per KV-cache block.", load.kv_block_size),
            ("kv_blocks_total", "KV-cache blocks in all.", load.kv_blocks_total),
            ("kv_blocks_used", "KV-cache blocks in use.", load.kv_blocks_used),
            ("num_requests_in_flight", "Requests in the server (admitted, not finished).", load.num_in_flight),
            ("max_concurrent_requests", "Admission limit on requests in flight.", load.max_concurrent_requests),
            ("kv_blocks_cached", "KV-cache blocks holding a reusable prefix (in use or evictable).",
             load.kv_blocks_cached),
            ("prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens looked up, "
             "since start.", load.prefix_cache_hit_rate),
        ):
            yield GaugeMetricFamily(f"tokenloop:{name}", doc, value=value)
        yield from self._counters()
        info = GaugeMetricFamily("tokenloop:cache_config_info", "KV-cache layout in labels (vLLM's cache_config_info "
                                 "format, for endpoint pickers' prefix-cache scorers).",
                                 labels=["block_size", "num_gpu_blocks"])
        info.add_metric([str(load.kv_block_size), str(load.kv_blocks_total)], 1)
        yield info

    def _counters(self):
        """The executor's totals since start: the prefix cache's, and speculative decoding's named as vLLM's
        spec_decode counters (docs/engine.md, "Speculative decoding": acceptance rate = num_accepted_tokens /
        num_draft_tokens; tokens per verification = 1 + num_accepted_tokens / num_drafts)."""
        executor = getattr(self.app, "executor", None)
        if executor is None:
            return
        s = executor.stats()
        for name, doc, value in (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache (vLLM's prefix_cache_queries).",
             s.num_prefix_cache_query_tokens),
            ("prefix_cache_hits", "Prompt tokens served from the prefix cache (vLLM's prefix_cache_hits).",
             s.num_prefix_cache_hit_tokens),
            ("prefix_cache_evictions", "Cached KV blocks evicted to make room.", s.num_prefix_cache_evictions),
            ("spec_decode_num_drafts", "Verifications of a draft (steps in which a sequence had drafted tokens).",
             s.spec_num_drafts),
            ("spec_decode_num_draft_tokens", "Tokens drafted.", s.spec_num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Drafted tokens accepted (the model's own).", s.spec_num_accepted_tokens),
        ):
            yield CounterMetricFamily(f"tokenloop:{name}", doc, value=value)
        per_pos = CounterMetricFamily("tokenloop:spec_decode_num_accepted_tokens_per_pos",
                                      "Drafted tokens accepted, by position in the draft (0: the first).",
                                      labels=["position"])
        for position, value in enumerate(s.spec_accepted_per_pos):
            per_pos.add_metric([str(position)], value)
        yield per_pos


class RequestMetrics:
    """Histograms and counters fed by the App's observer hooks."""

    def __init__(self, registry: CollectorRegistry):
        def hist(name, doc, buckets):
            return Histogram(f"tokenloop:{name}", doc, buckets=buckets, registry=registry)

        self.queue_time = hist("request_queue_time_seconds", "Arrival to executor acceptance.", LATENCY_BUCKETS)
        self.ttft = hist("time_to_first_token_seconds", "Arrival to the first generated token.", LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "(total - ttft) / (tokens - 1) per sequence.",
                        TOKEN_LATENCY_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to the end of a sequence.", LATENCY_BUCKETS)
        self.prompt_tokens = hist("request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.generated_tokens = hist("request_generation_tokens", "Generated tokens per sequence.", TOKEN_BUCKETS)
        self.finished = Counter("tokenloop:request_success", "Sequences finished, by finish reason.",
                                ["finished_reason"], registry=registry)
        self.requests = Counter("tokenloop:requests", "Generate requests ended, by gRPC status code.",
                                ["code"], registry=registry)

    def on_request_end(self, valid: ValidRequest, completes: list[Complete], code: grpc.StatusCode | None,
                       streamed: dict[int, int]) -> None:
        """A Generate or Embed ended (code OK: every sequence completed; None: cut short)."""
        self.requests.labels(code=code.name if code is not None else "CANCELLED").inc()
        self.prompt_tokens.observe(len(valid.prompt_token_ids))
        if valid.embed is not None:  # an Embed: no sequence generated, so no finish reason, TTFT or token counts
            return
        for done in completes:
            t = done.timing
            self.queue_time.observe(t.queue_s)
            self.e2e.observe(t.total_s)
            self.generated_tokens.observe(done.completion_tokens)
            self.finished.labels(finished_reason=FinishReason(done.finish_reason).name.lower()).inc()
            if done.completion_tokens:
                self.ttft.observe(t.ttft_s)
            if done.completion_tokens > 1:
                self.itl.observe(max(0.0, t.total_s - t.ttft_s) / (done.completion_tokens - 1))

    def on_error(self, code: grpc.StatusCode) -> None:
        """A Generate (or another RPC reporting errors) failed with `code`."""
        self.requests.labels(code=code.name).inc()


def start_metrics_server(app, host: str, port: int):
    """Serve `/metrics` for `app` on host:port (port 0: any free port); returns the HTTP server."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(LoadCollector(app))
    observer = RequestMetrics(registry)
    app.observers.append(observer)
    server, _thread = start_http_server(port, addr=host, registry=registry)
    app.metrics_http = server
    log.info("metrics on http://%s:%d/metrics", host, server.server_port)
    return server


def stop_metrics_server(app) -> None:
    """Stop the `/metrics` server started for `app`, if any."""
    server = getattr(app, "metrics_http", None)
    if server is not None:
        server.shutdown()
        server.server_close()
        app.metrics_http = None
