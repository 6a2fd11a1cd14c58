"""Images from what requests send: PIL images, data: URLs, http(s) URLs and local files."""

import base64
import binascii
import io
import urllib.request
from pathlib import Path

from PIL import Image, UnidentifiedImageError

FETCH_TIMEOUT_S = 10
MAX_IMAGE_BYTES = 32 << 20


def load_image(source, allow_files: bool = True) -> Image.Image:
    """An RGB image from a PIL image, a data: URL, an http(s) URL or (allow_files) a path or file: URL; a
    ValueError says which source failed and why."""
    if isinstance(source, Image.Image):
        return source.convert("RGB")
    if not isinstance(source, (str, Path)):
        raise ValueError(f"an image must be a PIL image, a URL or a path, not {type(source).__name__}")
    text = str(source)
    if text.startswith("data:"):
        return _decode(_data_url(text), "the data URL")
    if text.startswith(("http://", "https://")):
        return _decode(_fetch(text), text)
    if not allow_files:
        raise ValueError(f"image URL {text[:80]!r}: only data: and http(s): URLs are read")
    path = Path(text.removeprefix("file://"))
    if not path.is_file():
        raise ValueError(f"image file {str(path)!r} does not exist")
    return _decode(path.read_bytes(), str(path))


def _data_url(url: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ValueError("an image data URL must be data:<type>;base64,<data>")
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error as e:
        raise ValueError(f"the image data URL is not valid base64: {e}") from None


def _fetch(url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as response:
            data = response.read(MAX_IMAGE_BYTES + 1)
    except OSError as e:
        raise ValueError(f"image URL {url!r} could not be fetched: {e}") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"image URL {url!r}: larger than {MAX_IMAGE_BYTES >> 20} MiB")
    return data


def _decode(data: bytes, where: str) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"{where}: not an image PIL can read ({e})") from None
    return image.convert("RGB")
