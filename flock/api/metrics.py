"""Prometheus metrics of `flock serve`, in a registry of their own: Flock's (`flock_*`), and vLLM's names for the
same quantities (`vllm:*`, labelled with the served model name and engine "0"), so that dashboards and
autoscalers built on a vLLM server read a Flock server unchanged."""

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from flock.engine.async_engine import AsyncEngine, RequestStream, StreamOutput

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)


class Metrics:
    def __init__(self, engine: AsyncEngine, model_name: str = "flock"):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("flock_http_requests", "Requests to the /v1 endpoints by HTTP status",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter("flock_requests_finished", "Generation requests by finish reason "
                                "(stop, length, abort: cancelled or client gone, error: engine failure)",
                                ["reason"], registry=r)
        self.prompt_tokens = Counter("flock_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("flock_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("flock_time_to_first_token_seconds", "From submission to the first output token",
                              buckets=TTFT_BUCKETS, registry=r)
        gauges = {
            "flock_num_requests_waiting": ("Requests waiting for admission", lambda: engine.num_waiting),
            "flock_num_requests_running": ("Requests in the running batch", lambda: engine.state.num_running),
            "flock_kv_blocks_used": ("KV blocks in use (cache-only blocks count as free)",
                                     lambda: engine.state.kv_blocks_used),
            "flock_kv_blocks_total": ("KV blocks in the pool", lambda: engine.state.kv_blocks_total),
            "flock_prefix_saving_rate": ("1 - computed / logical prefill tokens since start",
                                         lambda: engine.state.saving_rate),
        }
        for name, (doc, fn) in gauges.items():
            Gauge(name, doc, registry=r).set_function(fn)
        self.engine = engine
        self.engine_counts = [[Counter(name, doc, registry=r), field, 0] for name, doc, field in (
            ("flock_kv_disk_read_blocks", "KV blocks read from the prefix cache's disk tier instead of computed",
             "disk_read_blocks"),
            ("flock_kv_disk_saved_blocks", "Computed KV blocks handed to the disk tier", "disk_saved_blocks"))]
        self.vllm = VllmMetrics(r, engine, model_name)
        engine.on_step = self.vllm.step_tokens.observe

    def render(self) -> bytes:
        sync(self.engine_counts, self.engine.state)
        sync(self.vllm.engine_counts, self.engine.state)
        return generate_latest(self.registry)

    def output(self, out: StreamOutput, new_tokens: int, since_submit: float, since_last: float | None,
               first_token: float | None = None) -> None:
        """One output of a request: `new_tokens` generated since its previous one (`since_last` seconds ago; None:
        this is its first), `since_submit` seconds after it was submitted (its first token `first_token` seconds
        after)."""
        v = self.vllm
        self.generation_tokens.inc(new_tokens)
        v.generation_tokens.inc(new_tokens)
        if new_tokens and out.num_output_tokens == new_tokens:
            self.ttft.observe(since_submit)
            v.ttft.observe(since_submit)
        elif new_tokens and since_last is not None:
            v.itl.observe(since_last / new_tokens)
        if since_last is None:  # the prompt is computed: counted now, however the request ends (as vLLM counts it)
            v.prompt_tokens.inc(out.num_prompt_tokens)
            if out.cache_lookup:  # as vLLM: requests that skip the lookup query nothing
                v.cache_queries.inc(out.num_prompt_tokens)
            v.cache_hits.inc(out.num_cached_tokens)
            v.prompt_tokens_cached.inc(out.num_cached_tokens)
        if out.finished:
            self.finished.labels(out.finish_reason).inc()
            if out.finish_reason in v.success:
                v.success[out.finish_reason].inc()
            v.e2e.observe(since_submit)
            if first_token is not None:  # one token: 0, as vLLM observes it
                n = out.num_output_tokens
                v.tpot.observe((since_submit - first_token) / (n - 1) if n > 1 else 0.0)
            v.request_prompt.observe(out.num_prompt_tokens)
            v.request_generation.observe(out.num_output_tokens)
            v.finished(out)

    def request_finished(self, stream: RequestStream) -> None:
        """A generation's stream ended; once its prompt's last choice has, its n and longest output (vLLM's
        parent request)."""
        if stream.max_tokens is None:
            return
        v = self.vllm
        v.params_max_tokens.observe(stream.max_tokens)
        if all(s.finished for s in stream.siblings):
            v.params_n.observe(len(stream.siblings))
            v.max_generation.observe(max(s.num_output_tokens for s in stream.siblings))

    def aborted(self) -> None:
        """A request its client left (vLLM counts no success for it)."""
        self.finished.labels("abort").inc()


class VllmMetrics:
    """vLLM v1's metric names, for what Flock measures the same way."""

    def __init__(self, r: CollectorRegistry, engine: AsyncEngine, model_name: str):
        labels, values = ["model_name", "engine"], (model_name, "0")
        gauges = {
            "vllm:num_requests_running": ("Number of requests in model execution batches.",
                                          lambda: engine.state.num_running),
            "vllm:num_requests_waiting": ("Number of requests waiting to be processed.", lambda: engine.num_waiting),
            "vllm:kv_cache_usage_perc": ("KV-cache usage. 1 means 100 percent usage.",
                                         lambda: engine.state.kv_blocks_used / max(engine.state.kv_blocks_total, 1)),
        }
        for name, (doc, fn) in gauges.items():
            Gauge(name, doc, labels, registry=r).labels(*values).set_function(fn)

        def counter(name: str, doc: str):
            return Counter(name, doc, labels, registry=r).labels(*values)

        def histogram(name: str, doc: str, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(*values)

        # counters the engine keeps: [counter, EngineState field, counted so far]
        self.engine_counts = [[counter(name, doc), field, 0] for name, doc, field in (
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", "preemptions"),
            ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "num_drafts"),
            ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", "draft_tokens"),
            ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", "accepted_draft_tokens"))]
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.cache_queries = counter("vllm:prefix_cache_queries",
                                     "Prefix cache queries, in terms of number of queried tokens.")
        self.cache_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          labels + ["finished_reason"], registry=r)
        self.success = {reason: success.labels(*values, reason)
                        for reason in ("stop", "length", "abort", "error", "repetition")}
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             LATENCY_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.request_prompt = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                        TOKEN_BUCKETS)
        self.request_generation = histogram("vllm:request_generation_tokens",
                                            "Number of generation tokens processed.", TOKEN_BUCKETS)
        self.prompt_tokens_cached = counter("vllm:prompt_tokens_cached",
                                            "Number of cached prompt tokens (local prefix cache).")
        self.kv_computed = histogram("vllm:request_prefill_kv_computed_tokens",
                                     "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
                                     TOKEN_BUCKETS)
        self.phases = {name: histogram(f"vllm:request_{name}_time_seconds",
                                       f"Histogram of time spent in {phase} phase for request.", LATENCY_BUCKETS)
                       for name, phase in (("queue", "WAITING"), ("inference", "RUNNING"), ("prefill", "PREFILL"),
                                           ("decode", "DECODE"))}
        self.step_tokens = histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                     STEP_TOKEN_BUCKETS)
        self.params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.params_max_tokens = histogram("vllm:request_params_max_tokens",
                                           "Histogram of the max_tokens request parameter.", TOKEN_BUCKETS)
        self.max_generation = histogram("vllm:request_max_num_generation_tokens",
                                        "Histogram of maximum number of requested generation tokens.", TOKEN_BUCKETS)
        self.preemptions = histogram("vllm:request_num_preemptions",
                                     "Histogram of the number of times a request was preempted.", PREEMPTION_BUCKETS)

    def finished(self, out: StreamOutput) -> None:
        """A finished request's own histograms (its phases only if it was scheduled, as vLLM records them)."""
        self.kv_computed.observe(out.num_prompt_tokens - out.num_cached_tokens)
        times = out.times
        if times is None:
            return
        self.phases["queue"].observe(times.queued)
        self.preemptions.observe(times.num_preemptions)
        if times.prefill is not None:
            self.phases["prefill"].observe(times.prefill)
            self.phases["decode"].observe(times.decode)
            self.phases["inference"].observe(times.prefill + times.decode)


def sync(counts: list[list], state) -> None:
    """Counters of the engine's own counts, [counter, EngineState field, counted so far], brought up to date (at
    each scrape)."""
    for entry in counts:
        counter, field, counted = entry
        value = getattr(state, field)
        counter.inc(max(value - counted, 0))
        entry[2] = max(value, counted)


class StatusCounter:
    """Counts responses of the given paths by status. Plain ASGI on purpose: Starlette's BaseHTTPMiddleware
    would sit between streaming responses and client disconnects."""

    def __init__(self, app, metrics: Metrics, paths: set[str]):
        self.app, self.metrics, self.paths = app, metrics, paths

    async def __call__(self, scope, receive, send):
        path = scope.get("path")
        if scope["type"] != "http" or path not in self.paths:
            return await self.app(scope, receive, send)
        counted = False

        async def counting_send(message):
            nonlocal counted
            if message["type"] == "http.response.start" and not counted:
                counted = True
                self.metrics.requests.labels(path, str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not counted:
                self.metrics.requests.labels(path, "500").inc()
            raise
