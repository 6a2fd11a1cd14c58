"""A larger target for draft-model speculation, built from a small real model (no larger sibling can be fetched
here): each of its layers followed by `copies` copies of itself whose MLP outputs (down_proj) are scaled by
`scale` and whose attention outputs (o_proj) are zero. The copies cost what real layers cost and nudge the residual
stream, so the target's greedy answers follow the small model's often, not always, as a larger model of a family
follows its small sibling; the small model itself is then the draft. (Copies with attention outputs kept lose
long prompts: their answers turn to newlines.)"""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file



def deep_target(folder: Path, out: Path, copies: int, scale: float) -> Path:
    """`folder`'s Llama-family model with (1 + copies) times its layers, saved under `out` (once)."""
    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    layers = config["num_hidden_layers"]
    weights = load_file(folder / "model.safetensors")
    deep = {k: v for k, v in weights.items() if ".layers." not in k}
    for i in range(layers):
        own = {k.split(f".layers.{i}.", 1)[1]: v for k, v in weights.items() if f".layers.{i}." in k}
        for c in range(1 + copies):
            for name, w in own.items():
                w = w * {"self_attn.o_proj.weight": 0.0, "mlp.down_proj.weight": scale}.get(name, 1.0) if c else w
                deep[f"model.layers.{i * (1 + copies) + c}.{name}"] = w.to(torch.bfloat16).clone()
    save_file(deep, out / "model.safetensors")
    for f in folder.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps(config | {"num_hidden_layers": layers * (1 + copies)}, indent=2))
    return out
