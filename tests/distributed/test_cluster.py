"""`flock run --workers N` on a local Ray: the same results and saving rate as one engine, and exactly one
record per input line after a worker, every worker or the driver is killed."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from flock.api.batch import run_job
from flock.cli import main
from tests.distributed.conftest import ENGINE, job, results

ray = pytest.importorskip("ray")
from flock.distributed.driver import ClusterConfig, ClusterEngine  # noqa: E402

WORKER = dict(worker_cpus=0.5, worker_threads=1)


def lines(path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


@pytest.mark.parametrize("workers", [2, 3])
def test_workers_equal_one_engine(ray_address, batch, tmp_path, workers, capsys):
    inp, reference, computed = batch
    cluster = ClusterEngine(ENGINE, ClusterConfig(workers, **WORKER))
    try:
        assert run_job(job(inp, tmp_path / "out.jsonl", quiet=False), cluster, summary_rows=cluster.summary_rows) == 0
    finally:
        cluster.shutdown()
    assert results(tmp_path / "out.jsonl") == reference  # greedy, float32: line for line
    assert cluster.stats.computed_prefill_tokens == computed  # the same saving rate: no prefix computed twice
    assert cluster.stats.num_requests == len(reference)
    assert cluster.partition.balance < 1.5 and all(s.done for s in cluster.slots)
    summary = capsys.readouterr().out
    assert f"workers                                 {workers} Ray actors ({workers} alive)" in summary
    assert f"worker {workers - 1} " in summary


def kill_holder(cluster, condition, killed: list, slots=None) -> None:
    """Once `condition()` holds, SIGKILL the first live, started worker of `slots` (default: any, so that no
    worker finishing early can stall a test) that holds requests and is not in `killed`; append (pid, slot)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if condition():
            for s in slots or cluster.slots:
                if s.alive and s.info is not None and s.keys and s.info.pid not in [pid for pid, _ in killed]:
                    killed.append((s.info.pid, s))
                    os.kill(s.info.pid, signal.SIGKILL)
                    return
        time.sleep(0.01)


def test_worker_killed_mid_job(ray_address, batch, tmp_path):
    """A worker is killed twice: its requests go to its restarted actor, then to the other two workers."""
    inp, reference, _ = batch
    out = tmp_path / "out.jsonl"
    cluster = ClusterEngine(ENGINE, ClusterConfig(3, max_restarts=1, **WORKER))
    killed: list = []

    def killer():
        kill_holder(cluster, lambda: lines(out) >= 3, killed)
        slot = killed[0][1]
        kill_holder(cluster, lambda: slot.restarts == 1, killed, [slot])

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        assert run_job(job(inp, out), cluster) == 0
    finally:
        cluster.shutdown()
    thread.join(timeout=1)
    assert len(killed) == 2 and killed[0][1] is killed[1][1], "both kills should hit one worker holding requests"
    assert results(out) == reference  # every line once, and the same results
    slot = killed[0][1]
    assert slot.restarts == 1 and not slot.alive
    assert sorted(s.alive for s in cluster.slots) == [False, True, True]


def test_every_worker_lost_then_resumed(ray_address, batch, tmp_path, capsys):
    inp, reference, _ = batch
    out = tmp_path / "out.jsonl"
    cluster = ClusterEngine(ENGINE, ClusterConfig(2, max_restarts=0, **WORKER))
    killed: list = []

    def killer():  # one worker, then the other once it holds requests (the first one's, if it had finished)
        kill_holder(cluster, lambda: lines(out) >= 2, killed)
        kill_holder(cluster, lambda: True, killed)

    threading.Thread(target=killer, daemon=True).start()
    try:
        assert run_job(job(inp, out), cluster) == 2
    finally:
        cluster.shutdown()
    err = capsys.readouterr().err
    assert "every worker is lost" in err and "--resume" in err
    done = lines(out)
    assert 2 <= done < len(reference)
    resumed = ClusterEngine(ENGINE, ClusterConfig(2, **WORKER))
    try:
        assert run_job(job(inp, out, resume=True), resumed) == 0
    finally:
        resumed.shutdown()
    assert results(out) == reference
    assert resumed.stats.num_requests == len(reference) - done


def test_driver_killed_and_resumed(ray_address, batch, tmp_path):
    inp, reference, _ = batch
    out = tmp_path / "out.jsonl"
    args = ["run", str(inp), "-o", str(out), "--temperature", "0", "-q", "--model", "flock/tiny", "--dtype", "float32",
            "--attention", "torch", "--kv-cache-memory-bytes", str(32 << 20), "--workers", "2", "--worker-cpus", "0.5",
            "--worker-threads", "1"]
    for _ in range(3):  # records come in bursts; now and then the last one lands before the kill: run again
        for path in (out, tmp_path / "out.errors.jsonl"):
            path.unlink(missing_ok=True)
        driver = subprocess.Popen([sys.executable, "-m", "flock.cli", *args, "--ray-address", ray_address],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while lines(out) < 3 and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        driver.kill()
        _, err = driver.communicate()
        killed_at = lines(out)
        if killed_at < len(reference):
            break
    assert 3 <= killed_at < len(reference), err.decode()[-2000:]
    assert main([*args, "--resume"]) == 0  # in this process: on the test's Ray
    assert results(out) == reference


def test_bad_cluster_options(ray_address, batch, tmp_path, capsys):
    inp, _, _ = batch
    out = tmp_path / "out.jsonl"
    base = ["run", str(inp), "-o", str(out), "--model", "flock/tiny"]
    assert main([*base, "--workers", "3"]) == 2  # 3 x 1 CPU on a 2-CPU cluster
    assert "need 3 CPUs, the Ray cluster has 2" in capsys.readouterr().err
    assert main([*base, "--workers", "0"]) == 2
    assert "--workers must be at least 1" in capsys.readouterr().err
    assert main([*base, "--workers", "1", "--worker-cpus", "0.5", "--model", str(tmp_path)]) == 2
    assert "worker 0 could not start" in capsys.readouterr().err
    assert main([*base, "--ray-address", ray_address]) == 2
    assert "need(s) --workers" in capsys.readouterr().err
    assert main([*base, "--worker-cpus", "2", "--max-worker-restarts", "3"]) == 2
    assert "--worker-cpus, --max-worker-restarts need(s) --workers" in capsys.readouterr().err
    assert not out.exists()


def test_a_line_only_the_engine_refuses_fails_alone_and_samples_differ(ray_address, tmp_path):
    """A request the workers' engines refuse (flock/tiny has no thinking tokens) is its line's error record, as
    with one engine, and no worker dies of it; an unseeded line's n samples, spread over two workers, differ."""
    good = [{"custom_id": f"q{i}", "prompt": f"Question {i}", "max_tokens": 4} for i in range(3)]
    think = {"custom_id": "think", "prompt": "hi", "max_tokens": 4, "thinking_token_budget": 5}
    sampled = {"custom_id": "n4", "prompt": "Tell me a story", "max_tokens": 8, "n": 4, "temperature": 1.0}
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in [*good, think]))
    (tmp_path / "n4.jsonl").write_text(json.dumps(sampled) + "\n")
    cluster = ClusterEngine(ENGINE, ClusterConfig(2, **WORKER))
    try:
        assert run_job(job(tmp_path / "in.jsonl", tmp_path / "out.jsonl"), cluster) == 0
        assert all(s.alive and not s.restarts for s in cluster.slots)
        assert run_job(job(tmp_path / "n4.jsonl", tmp_path / "n4.out.jsonl", sampling={}), cluster) == 0
    finally:
        cluster.shutdown()
    assert {json.loads(r)["custom_id"] for r in (tmp_path / "out.jsonl").read_text().splitlines()} == {"q0", "q1", "q2"}
    error, = map(json.loads, (tmp_path / "out.errors.jsonl").read_text().splitlines())
    assert error["custom_id"] == "think" and "thinking_token_budget" in json.dumps(error)
    record, = map(json.loads, (tmp_path / "n4.out.jsonl").read_text().splitlines())
    texts = [c["text"] for c in record["response"]["body"]["choices"]]
    assert len(set(texts)) == 4, texts
