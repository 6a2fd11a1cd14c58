"""A batch job's input and output at http(s) URLs, as `vllm run-batch` takes them: the input downloaded (GET) to
a local file first, the output written to a local file and uploaded (PUT) when the job ends, its failed lines'
records after the results (vLLM's output file holds both)."""

import shutil
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

UPLOAD_TRIES = 3  # vLLM's
TIMEOUT_S = 60


def is_url(path: str) -> bool:
    return urlparse(path).scheme in ("http", "https")


def local_path(url: str, folder: str) -> Path:
    """Where a URL's file is kept: `folder` / its name (`folder` is --output-tmp-dir or a temporary folder)."""
    return Path(folder) / (Path(urlparse(url).path).name or "batch.jsonl")


def download(url: str, folder: str) -> Path:
    """The input at `url`, saved in `folder`; OSError naming the URL when it cannot be read."""
    path = local_path(url, folder)
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response, open(path, "wb") as f:
            shutil.copyfileobj(response, f)
    except OSError as e:
        raise OSError(f"cannot read {url}: {e}") from None
    return path


def upload(paths: list[Path], url: str) -> None:
    """The files, one after the other, PUT to `url` (tried UPLOAD_TRIES times); OSError when it fails."""
    data = b"".join(p.read_bytes() for p in paths if p.is_file())
    for attempt in range(UPLOAD_TRIES):
        try:
            request = urllib.request.Request(url, data=data, method="PUT",
                                             headers={"Content-Type": "application/jsonl"})
            with urllib.request.urlopen(request, timeout=TIMEOUT_S):
                return
        except OSError as e:
            if attempt == UPLOAD_TRIES - 1:
                raise OSError(f"cannot upload the output to {url}: {e}") from None
            time.sleep(2**attempt)
