"""Random sequence classifiers and a causal LM reranker, saved by transformers as their checkpoints are."""

from pathlib import Path

import torch

from flock.model.builtin import write_tokenizer
from tests.conftest import HF_CONFIGS, VOCAB

LABELS = {0: "negative", 1: "neutral", 2: "positive"}
RERANK_TOKENS = ["no", "part"]  # two tokens of the test vocabulary, as Qwen3-Reranker's "no" and "yes"
RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": RERANK_TOKENS,
            "is_original_qwen3_reranker": True}


def save(folder: Path, kind: str, seed: int = 0, causal: bool = False, **config_kw) -> Path:
    """A `kind` (HF_CONFIGS) model's folder: a *ForSequenceClassification (config_kw: num_labels, id2label, ...),
    or with `causal` a *ForCausalLM."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    spec = dict(HF_CONFIGS[kind])
    config = AutoConfig.for_model(spec.pop("model_type"), vocab_size=VOCAB, pad_token_id=0, **spec, **config_kw)
    torch.manual_seed(seed)
    auto = AutoModelForCausalLM if causal else AutoModelForSequenceClassification
    model = auto.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(folder)
    write_tokenizer(folder, VOCAB)
    return folder


def reference_logits(folder: Path, prompts: list[list[int]]) -> torch.Tensor:
    """transformers' float64 class logits of each prompt (a causal LM's: its last token's vocabulary logits)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    causal = AutoConfig.from_pretrained(folder).architectures[0].endswith("ForCausalLM")
    auto = AutoModelForCausalLM if causal else AutoModelForSequenceClassification
    model = auto.from_pretrained(folder, dtype=torch.float64).eval()
    with torch.no_grad():
        return torch.stack([model(torch.tensor([p])).logits[0, -1 if causal else slice(None)].reshape(-1)
                            for p in prompts])
