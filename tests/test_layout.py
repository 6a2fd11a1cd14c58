"""The package's layout: no import cycle between flock's top-level rooms (modules and packages), read from the
source with ast, imports inside functions counted too (a lazy import hides a cycle; it does not remove it);
imports under `if TYPE_CHECKING:` never run and are left out."""

import ast
from pathlib import Path

import flock

ROOT = Path(flock.__file__).parent


def room_of(module: str) -> str | None:
    """`flock.api.batch` -> `api`; None outside flock and for the package itself."""
    parts = module.split(".")
    return parts[1] if parts[0] == "flock" and len(parts) > 1 else None


def imported_modules(path: Path, module: str) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):  # type-only imports never run: they make no cycle
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            node.body = []
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            if base == "flock":  # `from flock import api`: the names may be rooms
                found.update(f"flock.{alias.name}" for alias in node.names)
    return found


def room_graph() -> dict[str, set[str]]:
    rooms = {p.stem for p in ROOT.glob("*.py") if p.stem != "__init__"} | {p.parent.name for p in ROOT.glob("*/__init__.py")}
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        parts = ("flock",) + path.relative_to(ROOT).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        room = room_of(module)
        if room is None:
            continue
        edges = graph.setdefault(room, set())
        for target in imported_modules(path, module):
            other = room_of(target)
            if other in rooms and other != room:
                edges.add(other)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path [a, b, ..., a], or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle_and_accepts_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_function_level_and_relative_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import flock.sched\n"
                      "def f():\n    from flock.api import batch\n    from .. import model\n")
    found = imported_modules(source, "flock.engine.m")
    assert {"flock.api", "flock", "flock.model"} <= found and "flock.sched" not in found


def test_no_import_cycle_between_the_rooms_of_flock():
    graph = room_graph()
    assert {"engine", "api", "model", "sched"} <= set(graph)
    assert find_cycle(graph) is None, f"import cycle between flock's rooms: {' -> '.join(find_cycle(graph))}"


if __name__ == "__main__":
    for room, edges in sorted(room_graph().items()):
        print(f"{room}: {', '.join(sorted(edges))}")
