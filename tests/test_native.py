"""flock.native's gcc build cache: a library is rebuilt when its source, a header beside it or its flags change."""

import ctypes
import shutil

import pytest

from flock.native import build

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")


def test_a_changed_header_rebuilds(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOCK_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "value.h").write_text("#define VALUE 1\n")
    (src / "lib.c").write_text('#include "value.h"\nint value(void) { return VALUE; }\n')
    first = build(src / "lib.c", ["-O2"])
    assert build(src / "lib.c", ["-O2"]) == first  # cached
    (src / "value.h").write_text("#define VALUE 2\n")
    second = build(src / "lib.c", ["-O2"])
    assert second != first and ctypes.CDLL(str(second)).value() == 2
    assert build(src / "lib.c", ["-O1"]) not in (first, second)

