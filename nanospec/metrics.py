"""The server's Prometheus metrics (GET /metrics), named as vLLM names its own under a `nanospec:`
prefix, so that a dashboard built for vLLM reads them with the prefix changed: the request queues,
tokens, TTFT / TPOT / inter-token-latency histograms and speculative decoding's counters (drafts,
draft tokens, accepted tokens in all and per draft position). What vLLM has no name for is ours:
the K chosen per decode step and each KV pool's free blocks (a leaked block shows there). The
prefix cache's queries and hits count tokens, as vLLM's do.

Everything is updated on the engine loop's thread, after each step (prometheus_client is thread-safe)."""
from __future__ import annotations

import prometheus_client as prom

from nanospec.engine import Engine
from nanospec.request import Request

prom.disable_created_metrics()   # no *_created series, as vLLM

# vLLM's buckets (vllm/v1/metrics/loggers.py), in seconds.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]


class Metrics:
    def __init__(self, engine: Engine, model_name: str):
        self.registry = prom.CollectorRegistry()   # one per server: two servers in one process do not mix
        self.engine = engine
        self.label = {"model_name": model_name}

        def make(kind, name, doc, labels=(), **kw):
            metric = kind(f"nanospec:{name}", doc, ["model_name", *labels], registry=self.registry, **kw)
            return metric if labels else metric.labels(**self.label)

        self.running = make(prom.Gauge, "num_requests_running", "Requests in the running batch.")
        self.waiting = make(prom.Gauge, "num_requests_waiting", "Requests waiting to be scheduled.")
        self.finished = make(prom.Counter, "request_success", "Finished requests, by finish reason.",
                             ["finished_reason"])
        self.prompt_tokens = make(prom.Counter, "prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = make(prom.Counter, "generation_tokens", "Tokens generated.")
        self.preemptions = make(prom.Counter, "num_preemptions",
                                "Requests preempted (their cache recomputed).")
        self.prefix_queries = make(prom.Counter, "prefix_cache_queries",
                                   "Prompt tokens looked up in the prefix cache, as requests were scheduled.")
        self.prefix_hits = make(prom.Counter, "prefix_cache_hits", "Of those, the tokens found cached.")
        self.ttft = make(prom.Histogram, "time_to_first_token_seconds", "Time to the first token.",
                         buckets=TTFT_BUCKETS)
        self.itl = make(prom.Histogram, "inter_token_latency_seconds",
                        "Time between two steps that gave a request tokens.", buckets=ITL_BUCKETS)
        self.tpot = make(prom.Histogram, "request_time_per_output_token_seconds",
                         "A finished request's (end-to-end - TTFT) / (output tokens - 1).",
                         buckets=ITL_BUCKETS)
        self.e2e = make(prom.Histogram, "e2e_request_latency_seconds", "Arrival to the last token.",
                        buckets=LATENCY_BUCKETS)
        self.kv_usage = make(prom.Gauge, "kv_cache_usage_perc", "The target KV pool's used share (0..1).")
        self.free_blocks = make(prom.Gauge, "kv_cache_free_blocks", "Free blocks per KV pool.", ["pool"])
        self.num_blocks = make(prom.Gauge, "kv_cache_blocks", "Blocks per KV pool.", ["pool"])
        self.drafts = make(prom.Counter, "spec_decode_num_drafts", "Request-steps that verified drafts.")
        self.draft_tokens = make(prom.Counter, "spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.accepted = make(prom.Counter, "spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = make(prom.Counter, "spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by draft position (0 is the first).",
                                     ["position"])
        self.chosen_k = make(prom.Counter, "spec_decode_chosen_k",
                             "Decode steps, by the K the policy chose (a request near its end may "
                             "verify fewer).",
                             ["k"])
        # counter -> the engine's total it has counted so far: none of the engine's work before the server
        self.seen = self.totals()
        self.update_queues()

    def update_queues(self) -> None:
        scheduler = self.engine.scheduler
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting))
        caches = {"target": self.engine.kv_cache, "draft": getattr(self.engine.proposer, "kv_cache", None)}
        for pool, cache in caches.items():
            if cache is not None:
                self.free_blocks.labels(pool=pool, **self.label).set(cache.allocator.num_free)
                self.num_blocks.labels(pool=pool, **self.label).set(cache.allocator.num_blocks)
        target = self.engine.kv_cache.allocator
        self.kv_usage.set(1 - target.num_free / target.num_blocks)

    def totals(self) -> dict:
        """Each counter the engine's statistics feed, with the statistics' total so far."""
        stats = self.engine.stats
        totals = {self.generation_tokens: stats.generated_tokens, self.draft_tokens: stats.drafted_tokens,
                  self.drafts: sum(stats.drafted_per_position[:1]),   # request-steps with a first draft
                  self.accepted: stats.accepted_tokens, self.preemptions: stats.preemptions,
                  self.prefix_queries: stats.prefix_cache_queries, self.prefix_hits: stats.prefix_cache_hits}
        totals.update((self.accepted_per_pos.labels(position=str(i), **self.label), n)
                      for i, n in enumerate(stats.accepted_per_position))
        return totals

    def after_step(self, was_decode: bool) -> None:
        """Count what the engine's statistics gained in the step."""
        if was_decode:
            self.chosen_k.labels(k=str(self.engine.step_k), **self.label).inc()
        totals = self.totals()
        for counter, total in totals.items():
            counter.inc(total - self.seen.get(counter, 0))
        self.seen = totals
        self.update_queues()

    def finished_request(self, req: Request, reason: str, arrival: float, first: float | None,
                         last: float) -> None:
        self.finished.labels(finished_reason=reason, **self.label).inc()
        self.prompt_tokens.inc(len(req.prompt_ids))
        self.e2e.observe(last - arrival)
        n = len(req.output_ids)
        if first is not None and n > 1:
            self.tpot.observe((last - first) / (n - 1))

    def render(self) -> bytes:
        return prom.generate_latest(self.registry)
