"""Who writes a Request: the scheduler (states, computed tokens) and the engine (sampled tokens, finishing).
The KV manager, the attention backends and the model read requests at most."""

import ast
from pathlib import Path

from flock.request import Request
from flock.sampling_params import SamplingParams

PACKAGE = Path(__file__).resolve().parent.parent / "flock"
READ_ONLY_ROOMS = ("kv", "attention", "model")


def request_attributes() -> set[str]:
    req = Request(0, [1, 2], SamplingParams())
    properties = {name for name, v in vars(Request).items() if isinstance(v, property)}
    return set(vars(req)) | properties


def assigned_attributes(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and isinstance(t.ctx, ast.Store) and not (
                        isinstance(t.value, ast.Name) and t.value.id == "self"):
                    out.append((t.lineno, t.attr))
    return out


def test_no_request_attribute_is_assigned_in_kv_attention_or_model():
    attrs = request_attributes()
    assert {"num_computed_tokens", "token_ids", "status"} <= attrs
    found = []
    for room in READ_ONLY_ROOMS:
        for path in sorted((PACKAGE / room).rglob("*.py")):
            for line, attr in assigned_attributes(ast.parse(path.read_text())):
                if attr in attrs:
                    found.append(f"{path.relative_to(PACKAGE)}:{line} assigns .{attr}")
    assert not found, "\n".join(found)


def test_the_check_sees_an_assignment():
    tree = ast.parse("def f(req):\n    req.num_computed_tokens += 3\n    x.y.status = 1\n    self.status = 2\n")
    assert assigned_attributes(tree) == [(2, "num_computed_tokens"), (3, "status")]
