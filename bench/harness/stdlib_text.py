"""Real English text that every machine has offline: the docstrings of Python's standard library and the Zen of
Python (the `this` module), for benchmarks that compare engines on text nobody here wrote."""

import ast
import codecs
import importlib
import importlib.util
import inspect
import re

from bench.harness.documents import MODULES  # modules whose docstrings are long prose

__all__ = ["module_docs", "member_docs", "sentences", "zen_lines"]


def _import(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _clean(doc: str | None) -> str:
    return re.sub(r"[ \t]+\n", "\n", inspect.cleandoc(doc)).strip() if doc else ""


def module_docs() -> list[tuple[str, str]]:
    """(module name, its docstring) for the MODULES that have one, in MODULES order."""
    docs = [(name, _clean(getattr(_import(name), "__doc__", None))) for name in MODULES]
    return [(name, doc) for name, doc in docs if doc]


def member_docs() -> list[tuple[str, str]]:
    """(qualified name, docstring) of the public functions and classes defined in MODULES, sorted by name."""
    out = []
    for name in MODULES:
        mod = _import(name)
        for attr, obj in sorted(vars(mod).items()) if mod else ():
            if attr.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            if getattr(obj, "__module__", None) == name and (doc := _clean(obj.__doc__)):
                out.append((f"{name}.{attr}", doc))
    return out


def sentences(text: str, min_words: int = 6, max_words: int = 40) -> list[str]:
    """The prose sentences of a docstring (lines joined; code, tables and doctest lines left out)."""
    prose = [p for p in re.split(r"\n\s*\n|\n\s*[-*] ", text) if not re.search(r"^\s*(>>>|\$|\||-{3,}|={3,})", p, re.M)]
    flat = " ".join(" ".join(line.strip() for line in p.splitlines()) for p in prose)
    parts = re.split(r"(?<=[a-z0-9)][.!?])\s+(?=[A-Z])", flat)
    return [s for s in parts if min_words <= len(s.split()) <= max_words and s[-1] in ".!?"]


def zen_lines() -> list[str]:
    """The Zen of Python's aphorisms, read from the `this` module's source (importing it would print them)."""
    source = open(importlib.util.find_spec("this").origin, encoding="utf-8").read()
    s = next(ast.literal_eval(n.value) for n in ast.parse(source).body
             if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "s")
    text = codecs.decode(s, "rot_13")
    return [line for line in text.splitlines()[2:] if line.strip()]
