"""`flock serve` defaults, and a live server with a one-request batch and a one-request waiting queue: 429s,
graceful shutdown."""

import argparse
import asyncio
import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from flock.api.server import SERVE_MAX_NUM_SEQS, add_serve_arguments
from bench.harness.server_process import ServerProcess
from flock.engine.args import engine_kwargs

# the test process and the server share the CPUs; one torch thread keeps steps fast when they are busy
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
LONG = dict(model="flock/tiny", temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--model", "flock/tiny", "--max-num-seqs", "1", "--max-waiting", "1", "--num-kv-blocks", "256",
                       "--shutdown-timeout", "120", env=ONE_THREAD) as s:
        yield s


def health(server) -> dict:
    return httpx.get(f"{server.url}/health", timeout=10).json()


def test_serve_caps_the_running_batch_by_default():
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert engine_kwargs(parser.parse_args([]))["max_num_seqs"] == SERVE_MAX_NUM_SEQS == 128
    assert engine_kwargs(parser.parse_args(["--max-num-seqs", "7"]))["max_num_seqs"] == 7


def test_full_waiting_queue_gets_429(server):
    async def burst():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        try:
            return await asyncio.gather(*(client.completions.create(prompt=f"burst {i}", max_tokens=48, **LONG)
                                          for i in range(12)), return_exceptions=True)
        finally:
            await client.close()

    results = asyncio.run(burst())
    done = [r for r in results if isinstance(r, openai.types.Completion)]
    limited = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(done) + len(limited) == 12, [r for r in results if isinstance(r, Exception)][:1]
    assert done and limited
    assert all(r.usage.completion_tokens == 48 for r in done)
    assert limited[0].status_code == 429 and limited[0].code == "rate_limit_exceeded"
    assert limited[0].response.headers["retry-after"] == "1"
    deadline = time.monotonic() + 30
    while (h := health(server))["num_running"] or h["num_waiting"] or h["kv_blocks_used"]:
        assert time.monotonic() < deadline, h
        time.sleep(0.1)


def test_batch_lines_wait_for_a_full_waiting_queue(server):
    """A batch is a queued job: its 256 lines in flight meet a one-request waiting queue and wait for room, none
    filed as a 429; a request needing more engine requests than the queue holds is refused by name, not told to
    retry; list pages are 1 to 100 (OpenAI's) or 1,000 (Anthropic's)."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    lines = [json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": f"line {i}", "max_tokens": 3, **LONG}}) for i in range(6)]
    upload = client.files.create(file=("in.jsonl", "\n".join(lines).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while batch.status not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    assert (batch.status, batch.request_counts.completed, batch.request_counts.failed) == ("completed", 6, 0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(prompt="two", max_tokens=2, n=2, **LONG)
    assert "max_waiting=1" in e.value.message and e.value.body["param"] == "n"
    for path, limit in [("/v1/batches", 0), ("/v1/batches", -1), ("/v1/batches", 101),
                        ("/v1/messages/batches", 1001), ("/v1/messages/batches", 0)]:
        r = httpx.get(f"{server.url}{path}", params={"limit": limit}, timeout=10)
        assert r.status_code == 400 and "limit" in r.text, (path, limit, r.text)
    assert httpx.get(f"{server.url}/v1/messages/batches", params={"limit": 1000}, timeout=10).status_code == 200


def test_graceful_shutdown_finishes_in_flight_requests(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(client.completions.create, prompt="a long answer", max_tokens=80, **LONG)
        deadline = time.monotonic() + 30
        while health(server)["num_running"] == 0:
            assert time.monotonic() < deadline and not pending.done()
            time.sleep(0.02)
        # SIGTERM: stop accepting, let the request finish, shut the engine down, exit with the signal
        assert server.stop(timeout=150) in (0, -signal.SIGTERM)
        r = pending.result(timeout=30)
    assert "Application shutdown complete" in server.logs()
    assert r.usage.completion_tokens == 80 and r.choices[0].finish_reason == "length"
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/health", timeout=2)


def test_requests_past_the_shutdown_timeout_end_with_what_they_generated():
    """After --shutdown-timeout a stream ends with finish_reason abort and [DONE], a whole response is a 200 with
    its partial text: nothing generated is lost, no handler is cancelled."""
    with ServerProcess("--model", "flock/tiny", "--shutdown-timeout", "1", env=ONE_THREAD) as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=60)
        endless = dict(prompt="go on", max_tokens=4000, **LONG)
        with ThreadPoolExecutor(3) as pool:
            whole = pool.submit(client.completions.create, **endless)
            streamed = pool.submit(lambda: list(client.completions.create(stream=True, **endless)))
            beams = pool.submit(client.completions.create, model="flock/tiny", prompt="go on", max_tokens=4000, n=2,
                                extra_body={"use_beam_search": True, "ignore_eos": True})
            deadline = time.monotonic() + 30
            while health(s)["num_running"] < 2:
                assert time.monotonic() < deadline and not whole.done()
                time.sleep(0.02)
            time.sleep(0.5)  # the beams' steps under way too
            assert s.stop(timeout=60) in (0, -signal.SIGTERM)
            r, chunks, b = whole.result(timeout=30), streamed.result(timeout=30), beams.result(timeout=30)
        assert "Traceback" not in s.logs()
    assert r.choices[0].finish_reason == "abort" and r.usage.completion_tokens > 0 and r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "abort" and "".join(c.choices[0].text for c in chunks)
    assert [c.finish_reason for c in b.choices] == ["abort", "abort"]  # the beams as they were


def test_vllm_metrics_count_prompts_at_their_first_output_and_client_aborts_as_no_success():
    """As vLLM: a prompt's tokens count once it is computed (a stream its client leaves counts them too), a client
    that leaves records no request_success, a one-token request's TPOT is 0, errors have their label."""
    from types import SimpleNamespace

    from flock.api.metrics import Metrics
    from flock.engine.async_engine import StreamOutput

    state = SimpleNamespace(num_running=0, kv_blocks_used=0, kv_blocks_total=1, saving_rate=0.0)
    metrics = Metrics(SimpleNamespace(num_waiting=0, state=state), "m")
    first = StreamOutput("a", 7, 1, num_cached_tokens=3)
    metrics.output(first, 1, 0.5, None, 0.5)  # the first output of a stream
    metrics.aborted()  # its client left
    value = metrics.registry.get_sample_value
    labels = {"model_name": "m", "engine": "0"}
    assert value("vllm:prompt_tokens_total", labels) == 7 and value("vllm:prefix_cache_hits_total", labels) == 3
    metrics.output(StreamOutput("c", 9, 1, cache_lookup=False), 1, 0.5, None, 0.5)  # prompt logprobs: no lookup
    assert value("vllm:prompt_tokens_total", labels) == 16 and value("vllm:prefix_cache_queries_total", labels) == 7
    assert value("vllm:request_success_total", labels | {"finished_reason": "abort"}) == 0
    done = StreamOutput("b", 5, 1, finish_reason="error")
    metrics.output(done, 1, 0.2, None, 0.2)
    assert value("vllm:request_success_total", labels | {"finished_reason": "error"}) == 1
    assert value("vllm:request_time_per_output_token_seconds_sum", labels) == 0
    assert value("vllm:request_time_per_output_token_seconds_count", labels) == 1
