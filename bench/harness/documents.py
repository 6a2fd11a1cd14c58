"""Real documents that no one here wrote, offline on any machine with Python 3.11: the reference text of
standard-library modules (a module's docstring followed by those of its public functions and classes, as
`pydoc` shows them), cut at paragraph breaks into documents of `min_chars` to `max_chars` characters.

The order is fixed (MODULES, then each module's `__all__` or sorted public names); `seed` shuffles it. A
module that does not import on a platform is left out. Under `python -OO` there are no docstrings, so no
documents (`documents` raises).
"""

import importlib
import inspect
import random
import warnings

__all__ = ["MODULES", "documents"]

# Modules with substantial reference text in their docstrings; none deprecated in 3.11 (no import warnings).
MODULES = (
    "abc", "argparse", "array", "ast", "asyncio", "base64", "bisect", "bz2", "calendar", "cmd", "codecs",
    "collections", "concurrent.futures", "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime",
    "decimal", "difflib", "doctest", "email.message", "enum", "fileinput", "fnmatch", "fractions", "ftplib",
    "functools", "gc", "getopt", "gettext", "glob", "gzip", "hashlib", "heapq", "hmac", "html.parser",
    "http.client", "http.cookies", "imaplib", "inspect", "io", "ipaddress", "itertools", "json", "logging",
    "lzma", "mailbox", "math", "mimetypes", "operator", "optparse", "os", "pathlib", "pdb", "pickle",
    "pickletools", "platform", "plistlib", "poplib", "pprint", "pyclbr", "queue", "random", "re", "sched",
    "secrets", "selectors", "shelve", "shlex", "shutil", "signal", "site", "smtplib", "socket", "socketserver",
    "sqlite3", "ssl", "statistics", "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap",
    "threading", "timeit", "tokenize", "trace", "traceback", "typing", "unittest", "urllib.parse",
    "urllib.request", "uuid", "warnings", "wave", "weakref", "xml.dom.minidom", "zipfile", "zlib",
)


def documents(n: int | None = None, seed: int | None = None, min_chars: int = 1500,
              max_chars: int = 4000) -> list[tuple[str, str]]:
    """(title, text) pairs: the first `n` (all by default) in the fixed order, or in an order shuffled with
    `seed` (then the first `n` of that order). Titles are the module's name, with "(part i)" where a
    module's text makes several documents."""
    docs = [doc for name in MODULES for doc in _module_documents(name, min_chars, max_chars)]
    if not docs:
        raise RuntimeError("no docstrings to read (python -OO?)")
    if seed is not None:
        random.Random(seed).shuffle(docs)
    return docs[:n]


def _module_documents(name: str, min_chars: int, max_chars: int) -> list[tuple[str, str]]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = importlib.import_module(name)
    except ImportError:
        return []
    parts = _chunks(_paragraphs(_reference_text(module)), min_chars, max_chars)
    if len(parts) == 1:
        return [(name, parts[0])]
    return [(f"{name} (part {i + 1})", text) for i, text in enumerate(parts)]


def _reference_text(module) -> str:
    """The module's docstring, then each public function's and class's: "name(signature)" and its docstring."""
    sections = [inspect.getdoc(module) or ""]
    names = getattr(module, "__all__", None) or sorted(n for n in vars(module) if not n.startswith("_"))
    for attr in names:
        obj = getattr(module, attr, None)
        if not (inspect.isclass(obj) or inspect.isroutine(obj)) or not _defined_in(obj, module):
            continue
        doc = inspect.getdoc(obj)
        if doc:
            sections.append(f"{attr}{_signature(obj)}\n\n{doc}")
    return "\n\n".join(s for s in sections if s)


def _defined_in(obj, module) -> bool:
    """Not a name the module imported from elsewhere (its C accelerator `_json` etc. counts as its own)."""
    home = getattr(obj, "__module__", None) or ""
    base = module.__name__
    return home in (base, f"_{base}") or home.startswith(base + ".")


def _signature(obj) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""


def _paragraphs(text: str) -> list[str]:
    return [p.strip("\n") for p in text.split("\n\n") if p.strip()]


def _chunks(paragraphs: list[str], min_chars: int, max_chars: int) -> list[str]:
    """Paragraphs joined in order into pieces that stop growing past the middle of min_chars..max_chars and
    never pass max_chars (a longer paragraph is cut at line breaks); pieces under min_chars are dropped."""
    target = (min_chars + max_chars) // 2
    pieces, current = [], ""
    for p in (q for p in paragraphs for q in _split_long(p, max_chars)):
        if current and len(current) + 2 + len(p) > max_chars:
            pieces.append(current)
            current = ""
        current = f"{current}\n\n{p}" if current else p
        if len(current) >= target:
            pieces.append(current)
            current = ""
    return [p for p in pieces + [current] if len(p) >= min_chars]


def _split_long(paragraph: str, max_chars: int) -> list[str]:
    if len(paragraph) <= max_chars:
        return [paragraph]
    out, current = [], ""
    for line in paragraph.split("\n"):
        line = line[:max_chars]
        if current and len(current) + 1 + len(line) > max_chars:
            out.append(current)
            current = ""
        current = f"{current}\n{line}" if current else line
    return out + ([current] if current else [])
