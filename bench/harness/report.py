"""What a benchmark writes: markdown tables to paste into the README, JSON of every figure, matplotlib plots."""

import argparse
import json
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "out"  # bench/out: every benchmark's default output folder

__all__ = ["OUT", "fmt", "markdown_table", "args_dict", "write_json", "pyplot", "save_figure"]


def fmt(x, spec: str = ",") -> str:
    """`x` formatted with `spec`, or "-" for None."""
    return "-" if x is None else format(x, spec)


def markdown_table(head: list[str], rows: list[list], align: str | None = None) -> str:
    """A markdown table; `align` has one letter per column, "l" (left) or "r" (right), default: the first
    column left, the others right."""
    align = align or "l" + "r" * (len(head) - 1)
    rule = "|" + "|".join("---" if a == "l" else "--:" for a in align) + "|"
    return "\n".join(["| " + " | ".join(head) + " |", rule] + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def args_dict(args: argparse.Namespace) -> dict:
    """The parsed arguments, JSON-ready (paths as strings)."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def write_json(path: Path | str, data, indent: int | None = 1) -> Path:
    """Write `data` as JSON (creating the folder); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent, default=str))
    return path


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path | str, dpi: int = 110) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
