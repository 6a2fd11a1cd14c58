import os
from pathlib import Path


def load_tokenizer(path: str | Path):
    """A Hugging Face tokenizer from a local folder (never the network)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
