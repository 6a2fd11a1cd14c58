"""Prometheus metrics of `flock serve`, in a registry of their own."""

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from flock.engine.async_engine import AsyncEngine

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self, engine: AsyncEngine):
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

    def render(self) -> bytes:
        return generate_latest(self.registry)


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
