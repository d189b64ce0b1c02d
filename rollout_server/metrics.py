"""Prometheus metrics of one rollout server, on their own registry and HTTP port.

A private ``CollectorRegistry`` (not the global default) lets several servers live in one process
(tests, the bench) without duplicate-metric errors. Tokens/s is both a counter (Prometheus derives
rates) and a smoothed gauge (for ``GetStatus`` and humans). The endpoint is off unless
``rollout.metrics_port`` is set; port 0 picks a free one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from tether.logs import get_logger

log = get_logger(__name__)

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ServerMetrics:
    def __init__(self, server_id: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.tokens = Counter("tether_rollout_generated_tokens", "Completion tokens generated", registry=r)
        self.requests = Counter("tether_rollout_requests", "Finished RPCs", ["method", "code"], registry=r)
        self.latency = Histogram(
            "tether_rollout_request_seconds", "RPC latency", ["method"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.ttft = Histogram(
            "tether_rollout_ttft_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.tokens_per_s = Gauge("tether_rollout_tokens_per_s", "Generated tokens/s (smoothed)", registry=r)
        self.running = Gauge("tether_rollout_running_requests", "Requests being generated", registry=r)
        self.queued = Gauge("tether_rollout_queue_depth", "Requests waiting for a batch", registry=r)
        self.policy_version = Gauge("tether_rollout_policy_version", "Version of the loaded weights", registry=r)
        self.groups = Counter("tether_rollout_groups_written", "Groups written to the buffer", ["source"], registry=r)
        self.reward_failures = Counter("tether_rollout_reward_failures", "Failed reward calls", registry=r)
        self.aborted_samples = Counter(
            "tether_rollout_aborted_samples", "Samples that ended aborted (partial; not scored or trained)", registry=r
        )
        self.dead_lettered = Counter(
            "tether_rollout_dead_lettered", "Groups sent to the dead-letter stream", registry=r
        )
        self.episode_branches = Counter(
            "tether_rollout_episode_branches",
            "HTTP episode turns whose messages did not extend the transcript (the record was cut back)",
            registry=r,
        )
        self.tool_calls_malformed = Counter(
            "tether_rollout_tool_calls_malformed", "Replies whose tool call did not parse (sent as text)", registry=r
        )
        self.pauses_expired = Counter(
            "tether_rollout_pauses_expired", "Pauses that ended by rollout.pause_timeout_s, not Resume", registry=r
        )
        self.server_id = server_id
        self.total_tokens = 0
        self._rate = 0.0
        self._last = time.monotonic()
        self._since_last = 0

    def watch_engine(self, step_counts: Callable[[], dict[str, int]]) -> None:
        """Export the engine's forward passes and the rows they ran (``Engine.step_counts``), read at scrape."""
        self.registry.register(_EngineSteps(step_counts))

    def watch_weight_pulls(self, counts: Callable[[], dict[str, float]]) -> None:
        """Export the store transport's pull counters (``weight_sync.puller.Puller.stats``), read at scrape:
        ``tether_rollout_weight_pulls{what}`` = pulls, pull_failures, load_failures (a pulled version that did not
        load whole: the version held before is loaded back, or the engine stays paused), bytes, corrupt_chunks,
        source_failures."""
        self.registry.register(_WeightPulls(counts))

    def add_tokens(self, n: int) -> None:
        self.tokens.inc(n)
        self.total_tokens += n
        self._since_last += n
        self._update_rate()

    def _update_rate(self) -> None:
        now = time.monotonic()
        dt = now - self._last
        if dt >= 1.0:  # a 1 s window, smoothed: readable without Prometheus' rate()
            self._rate = 0.5 * self._rate + 0.5 * self._since_last / dt
            self._since_last, self._last = 0, now
            self.tokens_per_s.set(self._rate)

    @property
    def rate(self) -> float:
        self._update_rate()
        return self._rate

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP endpoint (a daemon thread); returns the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        bound = int(server.server_address[1])
        log.info("metrics_endpoint", url=f"http://{host}:{bound}/metrics")
        return bound


class _EngineSteps(Collector):
    """``tether_rollout_engine_forward_passes{kind}`` and ``tether_rollout_engine_rows{kind}``, kind =
    prefill | decode: rows per decode pass is the batch the engine actually ran."""

    def __init__(self, step_counts: Callable[[], dict[str, int]]) -> None:
        self._counts = step_counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        counts = self._counts()
        if not counts:
            return
        passes = CounterMetricFamily("tether_rollout_engine_forward_passes", "Engine forward passes", labels=["kind"])
        rows = CounterMetricFamily(
            "tether_rollout_engine_rows", "Rows run by the engine's forward passes", labels=["kind"]
        )
        for kind in ("prefill", "decode"):
            passes.add_metric([kind], counts.get(kind, 0))
            rows.add_metric([kind], counts.get(f"{kind}_rows", 0))
        yield passes
        yield rows


class _WeightPulls(Collector):
    def __init__(self, counts: Callable[[], dict[str, float]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "tether_rollout_weight_pulls", "Store transport: pulls, failed pulls, bytes, corrupt chunks refused, "
            "sources that failed", labels=["what"],
        )  # fmt: skip
        for what, n in self._counts().items():
            family.add_metric([what], n)
        yield family
