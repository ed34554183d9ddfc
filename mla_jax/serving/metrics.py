"""The server's Prometheus metrics (``/metrics``), in a registry of its own per server."""

from __future__ import annotations

import prometheus_client as prom

# Seconds: from a few milliseconds (tiny models on a CPU) to minutes (long prompts, big models).
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
  """Requests by endpoint and status, tokens in and out, the engine's load (running, waiting,
  pages in use, step programs compiled), and time to first token and inter-token latency
  histograms."""

  def __init__(self, num_pages: int):
    self.registry = prom.CollectorRegistry()
    r = self.registry
    self.requests = prom.Counter("mla_jax_requests", "HTTP requests answered",
                                 ["endpoint", "status"], registry=r)
    self.prompt_tokens = prom.Counter("mla_jax_prompt_tokens", "prompt tokens queued",
                                      registry=r)
    self.generation_tokens = prom.Counter("mla_jax_generation_tokens", "tokens generated",
                                          registry=r)
    self.running = prom.Gauge("mla_jax_requests_running", "sequences in the running batch",
                              registry=r)
    self.waiting = prom.Gauge("mla_jax_requests_waiting", "sequences waiting for admission",
                              registry=r)
    self.pages_in_use = prom.Gauge("mla_jax_pages_in_use", "cache pages held by sequences",
                                   registry=r)
    self.pages_cached = prom.Gauge("mla_jax_pages_cached",
                                   "free cache pages that still hold a cached prefix", registry=r)
    prom.Gauge("mla_jax_pages_total", "cache pages in the pool", registry=r).set(num_pages)
    self.programs = prom.Gauge("mla_jax_step_programs", "step programs compiled so far",
                               registry=r)
    self.ttft = prom.Histogram("mla_jax_time_to_first_token_seconds",
                               "arrival to first generated token", buckets=_LATENCY_BUCKETS,
                               registry=r)
    self.itl = prom.Histogram("mla_jax_inter_token_latency_seconds",
                              "time between a request's successive tokens",
                              buckets=_LATENCY_BUCKETS, registry=r)

  def exposition(self) -> bytes:
    return prom.generate_latest(self.registry)

  CONTENT_TYPE = prom.CONTENT_TYPE_LATEST
