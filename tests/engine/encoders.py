"""Random BERT-family encoders (BERT, XLM-RoBERTa; base models and sequence classifiers) with a WordPiece
tokenizer, saved by transformers as their checkpoints are."""

import json
from pathlib import Path

import torch

WORDS = ("the a of to and in is it that was for on are with as they be at one have this from or had by hot word "
         "but what some we can out other were all there when up use your how said an each she which do their time "
         "if will way about many then them write would like so these her long make thing see him two has look more "
         "day could go come did number sound no most people my over know water than call first who may down side "
         "been now find blocks cache pool").split()
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
SIZES = dict(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def save_encoder(folder: Path, model_type: str = "bert", num_labels: int = 0, seed: int = 0, pooling: str | None = None,
                 token_classifier: bool = False, **config_kw) -> Path:
    """A `model_type` ("bert" or "xlm-roberta") encoder: a base model, or with `num_labels` a sequence (or with
    `token_classifier` a token) classifier; `pooling` a sentence-transformers pooling mode key (modules.json and
    1_Pooling/config.json written)."""
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification, AutoModelForTokenClassification

    positions = {"max_position_embeddings": 64 + 2, "pad_token_id": 1} if model_type == "xlm-roberta" else \
        {"max_position_embeddings": 64}
    config = AutoConfig.for_model(model_type, **SIZES, **positions, **config_kw,
                                  **({"num_labels": num_labels} if num_labels else {}))
    torch.manual_seed(seed)
    auto = AutoModelForTokenClassification if token_classifier else AutoModelForSequenceClassification
    model = (auto if num_labels else AutoModel).from_config(config, dtype=torch.float32)
    _save_random(model, folder)
    if pooling is not None:
        (folder / "1_Pooling").mkdir()
        (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, pooling: True}))
        modules = [("0", "", "Transformer"), ("1", "1_Pooling", "Pooling"), ("2", "2_Normalize", "Normalize")]
        (folder / "modules.json").write_text(json.dumps([
            {"idx": int(i), "name": i, "path": path, "type": f"sentence_transformers.models.{kind}"}
            for i, path, kind in modules]))
    return folder


def _save_random(model, folder: Path) -> None:
    """The model's weights drawn at random (seeded by the caller), saved with the WordPiece tokenizer."""
    from transformers import BertTokenizerFast

    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    BertTokenizerFast(vocab={w: i for i, w in enumerate(VOCAB)}).save_pretrained(folder)


def reference(folder: Path, texts: list[str | tuple[str, str]]) -> list[torch.Tensor]:
    """transformers' float64 final hidden states (a classifier: logits; a token classifier's of each token) of
    each text or pair."""
    from transformers import (AutoConfig, AutoModel, AutoModelForSequenceClassification,
                              AutoModelForTokenClassification, AutoTokenizer)

    architecture = AutoConfig.from_pretrained(folder).architectures[0]
    classifier = architecture.endswith(("ForSequenceClassification", "ForTokenClassification"))
    auto = AutoModelForTokenClassification if architecture.endswith("ForTokenClassification") else \
        AutoModelForSequenceClassification
    model = (auto if classifier else AutoModel).from_pretrained(folder, dtype=torch.float64).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        outs = [model(**tokenizer(*([t] if isinstance(t, str) else t), return_tensors="pt")) for t in texts]
    return [o.logits[0] if classifier else o.last_hidden_state[0] for o in outs]


def save_modernbert(folder: Path, num_labels: int = 0, seed: int = 0, **config_kw) -> Path:
    """A ModernBERT of 4 layers (0 and 3 global, 1 and 2 local with `local_attention` 8: 4 positions either side)
    and the WordPiece tokenizer; with `num_labels` a sequence classifier."""
    from transformers import (AutoModel, AutoModelForSequenceClassification, AutoModelForTokenClassification,
                              ModernBertConfig)

    sizes = {**SIZES, "num_hidden_layers": 4}
    config_kw = {"global_attn_every_n_layers": 3, **config_kw, **({"num_labels": num_labels} if num_labels else {})}
    config = ModernBertConfig(**sizes, max_position_embeddings=64, local_attention=8, pad_token_id=0, bos_token_id=2,
                              eos_token_id=3, cls_token_id=2, sep_token_id=3, **config_kw)
    torch.manual_seed(seed)
    token = (config.architectures or [""])[0].endswith("ForTokenClassification")
    auto = AutoModelForTokenClassification if token else AutoModelForSequenceClassification
    model = (auto if num_labels else AutoModel).from_config(config, dtype=torch.float32)
    _save_random(model, folder)
    return folder
