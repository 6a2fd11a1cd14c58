import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from flock.chat_content import detect_content_format, joined_text, template_message

# A ChatML-style template for tokenizers that ship none.
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def load_tokenizer(path: str | Path, chat_template: str | None = None):
    """A Hugging Face tokenizer from a local folder, or from a GGUF file (or a folder holding one), see
    `flock.model.load_gguf_tokenizer`. Never the network. `chat_template` (a Jinja template or a file holding one)
    replaces the one it ships, as vLLM's --chat-template."""
    from flock.model import load_gguf_tokenizer
    from flock.model.gguf import find_gguf

    gguf_file = find_gguf(Path(path))
    if gguf_file is not None:
        tokenizer = load_gguf_tokenizer(gguf_file)
    else:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        processor_template = Path(path) / "chat_template.json"  # a vision-language processor's, as vLLM reads it
        if tokenizer.chat_template is None and processor_template.is_file():
            tokenizer.chat_template = json.loads(processor_template.read_text()).get("chat_template")
        sbert = Path(path) / "sentence_bert_config.json"
        if sbert.is_file() and json.loads(sbert.read_text()).get("do_lower_case"):
            lowercased(tokenizer)
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


def lowercased(tokenizer) -> None:
    """Text lower-cased before it is split, as sentence-transformers' do_lower_case (and vLLM) have it; special
    tokens, matched before normalization, stay as they are."""
    from tokenizers import normalizers

    backend = tokenizer.backend_tokenizer
    backend.normalizer = normalizers.Sequence([normalizers.Lowercase(), *([backend.normalizer] if backend.normalizer
                                                                          else [])])


def read_chat_template(template: str) -> str:
    """The template itself, or the text of the file it names."""
    if "{{" in template or "{%" in template:
        return template
    path = Path(template)
    if not path.is_file():
        raise ValueError(f"chat_template {template!r} is neither a file nor a Jinja template")
    return path.read_text()


@dataclass
class ChatOptions:
    """How a server renders chats besides its template (vLLM's serve flags), kept on the tokenizer
    (`tokenizer.chat_options`) so that every endpoint renders alike."""

    content_format: str = "auto"  # --chat-template-content-format: "auto" detects it from the template
    default_kwargs: dict = field(default_factory=dict)  # --default-chat-template-kwargs, under a request's own
    trust_request_template: bool = False  # --trust-request-chat-template: a request's chat_template is used
    exclude_tools_when_none: bool = False  # --exclude-tools-when-tool-choice-none
    response_role: str = "assistant"  # --response-role: a chat answer's role (with add_generation_prompt)


def chat_options(tokenizer) -> ChatOptions:
    return getattr(tokenizer, "chat_options", None) or ChatOptions()


def encode_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                continue_final_message: bool = False, tools: list[dict] | None = None,
                chat_template_kwargs: dict | None = None, add_special_tokens: bool = False,
                chat_template: str | None = None, content_format: str | None = None,
                image_text: str | None = None) -> list[int]:
    """Token ids of a chat through the tokenizer's chat template (or `chat_template`; the ChatML fallback when
    there is none): ready for the assistant's answer, or, with continue_final_message, continuing the last message
    (as vLLM's). `tools` and `chat_template_kwargs` go to the template (the arguments win over the kwargs'
    add_generation_prompt, continue_final_message and tools); assistant messages' tool call arguments as objects;
    contents in the template's format (`flock.chat_content`; None: the tokenizer's ChatOptions');
    add_special_tokens adds the tokenizer's (a BOS) to what the template writes."""
    text = chat_text(tokenizer, messages, add_generation_prompt, continue_final_message, tools, chat_template_kwargs,
                     chat_template, content_format, image_text)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def chat_text(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
              continue_final_message: bool = False, tools: list[dict] | None = None,
              chat_template_kwargs: dict | None = None, chat_template: str | None = None,
              content_format: str | None = None, image_text: str | None = None) -> str:
    """The text the chat template writes for a chat (see encode_chat; `image_text`, template_message's)."""
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
    options = chat_options(tokenizer)
    given = chat_template or (None if getattr(tokenizer, "chat_template", None) else FALLBACK_CHAT_TEMPLATE)
    template = given or tokenizer.chat_template  # a str, or a dict of named templates (transformers picks one)
    if any(m.get("role") == "developer" for m in messages) and not knows_developer(template):
        messages = developer_as_system(messages)
    content_format = content_format or options.content_format
    if content_format == "auto":
        content_format = detect_content_format(template) if isinstance(template, str) else "string"
    messages = [assistant_tool_calls(template_message(m, content_format, image_text)) for m in messages]
    kwargs = options.default_kwargs | (chat_template_kwargs or {})
    tools = kwargs.get("tools") if tools is None else tools
    kwargs = {k: v for k, v in kwargs.items() if k not in ("tools", "add_generation_prompt", "continue_final_message")}
    reserved = sorted(kwargs.keys() & {"conversation", "messages", "chat_template", "tokenize", "return_dict"})
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {reserved}")
    try:
        return tokenizer.apply_chat_template(messages, chat_template=given, tokenize=False, tools=tools,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **kwargs)
    except Exception as e:  # templates raise anything (jinja errors, "roles must alternate", ...)
        raise ValueError(f"chat template failed: {e}") from None


def knows_developer(template) -> bool:
    """Whether a chat template (a string, or a dict of named templates) writes OpenAI's developer role."""
    texts = template.values() if isinstance(template, dict) else [template or ""]
    return any('"developer"' in t or "'developer'" in t for t in texts)


def developer_as_system(messages: list[dict]) -> list[dict]:
    """Developer messages as system messages, every system message's text merged into one first (as vLLM does for
    templates that know no developer role: some templates take a system message only first)."""
    messages = [m | {"role": "system"} if m.get("role") == "developer" else m for m in messages]
    systems = [m for m in messages if m.get("role") == "system"]
    if len(systems) == 1 and messages[0] is systems[0]:
        return messages
    texts = [t for t in (joined_text(m.get("content")) for m in systems) if t]
    return [{"role": "system", "content": "\n\n".join(texts)}, *(m for m in messages if m.get("role") != "system")]


def assistant_tool_calls(message: dict) -> dict:
    """An assistant message with `tool_calls` as chat templates expect it (as vLLM passes it): each call's
    arguments as an object, not JSON text (not an object: {})."""
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not isinstance(calls, list):
        return message
    if not calls:
        return {k: v for k, v in message.items() if k != "tool_calls"}
    out = []
    for call in calls:
        f = call.get("function") if isinstance(call, dict) else None
        if isinstance(f, dict) and not isinstance(f.get("arguments"), dict):
            try:
                args = json.loads(f.get("arguments") or "{}")
            except (TypeError, ValueError):
                args = {}
            call = call | {"function": f | {"arguments": args if isinstance(args, dict) else {}}}
        out.append(call)
    return message | {"tool_calls": out}



# llama.cpp's names of each fill-in-the-middle token (llama-vocab.cpp), the first found wins
FIM_NAMES = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
            "<|code_prefix|>", "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
            "<|code_suffix|>", "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
            "<|code_middle|>", "<|middle|>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}


def fim_tokens(tokenizer) -> dict[str, int]:
    """The model's fill-in-the-middle token ids by role (pre, suf, mid, rep, sep), those it has."""
    vocab = tokenizer.get_vocab()
    found = {}
    for role, names in FIM_NAMES.items():
        token = next((vocab[name] for name in names if name in vocab), None)
        if token is not None:
            found[role] = token
    return found


def bos_prefix(tokenizer) -> list[int]:
    """[BOS] where the tokenizer adds one to a text (llama.cpp's add_bos), else []."""
    bos = tokenizer.bos_token_id
    return [bos] if bos is not None and tokenizer.encode("a")[:1] == [bos] else []


def fim_prompt(fim: dict[str, int], bos: list[int], prefix: list[int], suffix: list[int]) -> list[int]:
    """The fill-in-the-middle prompt (prefix-suffix-middle order): [BOS][PRE]prefix[SUF]suffix[MID]."""
    return [*bos, fim["pre"], *prefix, fim["suf"], *suffix, fim["mid"]]
