"""`flock serve` in a child process on a free loopback port: for tests and load benchmarks."""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

import flock

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(flock.__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, name: str, logs) -> bool:
    """Poll `url`/health until it answers 200 (True) or `timeout` passes (False); RuntimeError with the
    process's `logs()` if it exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{logs()}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    return False


class ServerProcess:
    """Starts `python -m flock.api.server ARGS --port P`, waits for /health; `stop()` sends SIGTERM (graceful).
    After a graceful shutdown uvicorn re-raises the signal, so the exit code is -SIGTERM."""

    def __init__(self, *args: str, ready_timeout: float = 120.0, env: dict | None = None):
        self.args = list(args)
        self.ready_timeout = ready_timeout
        self.env = env
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile("w+", prefix="flock-serve-", suffix=".log", delete=False)

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        os.unlink(self._log.name)

    def start(self) -> "ServerProcess":
        cmd = [sys.executable, "-m", "flock.api.server", *self.args, "--port", str(self.port)]
        path = os.pathsep.join(p for p in (PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path, **(self.env or {})}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        if wait_healthy(self.proc, self.url, self.ready_timeout, "flock serve", self.logs):
            return self
        self.stop()
        raise RuntimeError(f"flock serve was not ready within {self.ready_timeout} s:\n{self.logs()}")

    def stop(self, timeout: float = 30.0) -> int | None:
        """Graceful shutdown; kill if it takes longer than `timeout`. Returns the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def logs(self) -> str:
        self._log.flush()
        with open(self._log.name, encoding="utf-8", errors="replace") as f:
            return f.read()
