import os
from pathlib import Path

# A ChatML-style template for tokenizers that ship none.
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def load_tokenizer(path: str | Path):
    """A Hugging Face tokenizer from a local folder, or from a GGUF file (or a folder holding one) as
    transformers converts it: BPE or SentencePiece vocabulary, special tokens, chat template. Never the network."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from flock.model.gguf import find_gguf

    gguf_file = find_gguf(Path(path))
    if gguf_file is None:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    gguf_file = gguf_file.resolve()
    # the fast class itself: AutoTokenizer would first read the whole file again for its config
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                        local_files_only=True)
    tokenizer.name_or_path = str(gguf_file)  # loading it again by this name finds the same file
    return tokenizer


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat through the tokenizer's chat template (the ChatML fallback when it has none), ready
    for the assistant's answer."""
    template = None if getattr(tokenizer, "chat_template", None) else FALLBACK_CHAT_TEMPLATE
    try:
        out = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True, add_generation_prompt=True)
    except Exception as e:  # templates raise anything (jinja errors, "roles must alternate", ...)
        raise ValueError(f"chat template failed: {e}") from None
    return list(out["input_ids"] if hasattr(out, "keys") else out)
