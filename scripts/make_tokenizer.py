"""Regenerate flock/model/assets/tokenizer.json: a byte-level BPE trained on Python's own help topics.

Deterministic: the same Python version gives the same file. The file is shipped so every machine and
Python version sees the same tokenizer; run this only to change it.
"""

from pathlib import Path

from pydoc_data.topics import topics
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL = ["<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
VOCAB_SIZE = 8192


def main() -> None:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([topics[k] for k in sorted(topics)], trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    out = Path(__file__).resolve().parents[1] / "flock/model/assets/tokenizer.json"
    tok.save(str(out))
    print(f"wrote {out} ({VOCAB_SIZE} tokens)")


if __name__ == "__main__":
    main()
