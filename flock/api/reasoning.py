"""A reasoning model's thinking split from its answer, as vLLM's server does with `--reasoning-parser`.

"deepseek_r1" (DeepSeek-R1 distills on Qwen2 and Llama, QwQ): the text up to the first `</think>` (after the
`<think>` it starts with, when the model writes it rather than the chat template) is the message's `reasoning`,
the rest its `content`. An answer that never closes its thinking is all reasoning.
"qwen3" (Qwen3): the same, and a `<tool_call>` also ends the thinking (the call is content, for the tool parser);
`chat_template_kwargs: {"enable_thinking": false}` makes the whole answer content.
"""

from dataclasses import dataclass

_START, _END = "<think>", "</think>"
THINKING_END = _END


@dataclass(frozen=True)
class ReasoningFormat:
    """How a model family's answers end their thinking."""

    kept_ends: tuple[str, ...] = ()  # text that also ends the thinking, and is the content's start
    switch: str | None = None  # the chat_template_kwargs key that turns thinking off when false

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole answer; content None when nothing follows the thinking."""
        if text.startswith(_START):
            text = text[len(_START) :]
        at, skip = self.end(text)
        if at < 0:
            return text, None
        return text[:at], text[at + skip :] or None

    def end(self, text: str) -> tuple[int, int]:
        """Where the first end of the thinking is in `text` (-1: none) and how many characters of it to drop."""
        found = [(at, len(_END)) for at in [text.find(_END)] if at >= 0]
        found += [(at, 0) for at in (text.find(tag) for tag in self.kept_ends) if at >= 0]
        return min(found, default=(-1, 0))

    def tags(self) -> tuple[str, ...]:
        return (_END, *self.kept_ends)


REASONING_PARSERS = {"deepseek_r1": ReasoningFormat(), "qwen3": ReasoningFormat(("<tool_call>",), "enable_thinking")}


# vLLM's StructuredOutputsConfig fields Flock takes (its disable_additional_properties is the guidance backend's)
STRUCTURED_OUTPUTS_CONFIG = ("backend", "disable_any_whitespace", "reasoning_parser", "enable_in_reasoning")


def read_structured_outputs_config(config) -> tuple[bool | None, str | None, bool]:
    """vLLM's structured_outputs_config (a dict) as Flock runs it: (JSON's any whitespace, None where it does not
    say; the reasoning parser, if any; whether the grammar applies within the thinking). ValueError naming what
    Flock cannot run."""
    if not isinstance(config, dict) or config.keys() - set(STRUCTURED_OUTPUTS_CONFIG) \
            or config.get("backend", "auto") not in ("auto", "xgrammar"):
        raise ValueError(f"structured_outputs_config takes {list(STRUCTURED_OUTPUTS_CONFIG)} (backend auto or "
                         f"xgrammar), got {config!r}")
    parser = config.get("reasoning_parser") or None
    if parser is not None and parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}, got {parser!r}")
    any_whitespace = None if "disable_any_whitespace" not in config else not config["disable_any_whitespace"]
    return any_whitespace, parser, bool(config.get("enable_in_reasoning", False))


def thinking_open(tokenizer, prompt_ids: list[int]) -> bool:
    """Whether the answer to this prompt starts by thinking: unless the chat template closed the thinking already
    (a `</think>` after its last `<think>`, as templates do to turn thinking off) in the answer's own turn, after
    the prompt's last special token that is no thinking tag (a turn's header or end: an earlier turn's thinking
    says nothing of this one's)."""
    tail = prompt_ids[-64:]
    special = set(tokenizer.all_special_ids)
    turn = next((i + 1 for i in range(len(tail) - 1, -1, -1)
                 if tail[i] in special and tokenizer.decode([tail[i]]) not in (_START, _END)), 0)
    text = tokenizer.decode(tail[turn:])
    return text.rfind(_END) <= text.rfind(_START)


def reasoning_token_count(tokenizer, output_ids: list[int], fmt: ReasoningFormat) -> int:
    """How many output tokens are thinking (vLLM's usage.completion_tokens_details.reasoning_tokens): those before
    the thinking's end (all, when it never comes), not a `<think>` the answer starts with."""
    text = tokenizer.decode(output_ids)
    end = fmt.end(text)[0]
    start = len(_START) if text.startswith(_START) else 0
    return _tokens_within(tokenizer, output_ids, end if end >= 0 else len(text)) - \
        (_tokens_within(tokenizer, output_ids, start) if start else 0)


def answer_start(tokenizer, output_ids: list[int], fmt: ReasoningFormat) -> int:
    """How many output tokens come before the answer: the thinking and the tag that ends it (all, when it never
    ends)."""
    text = tokenizer.decode(output_ids)
    at, skip = fmt.end(text)
    return _tokens_within(tokenizer, output_ids, at + skip) if at >= 0 else len(output_ids)


def _tokens_within(tokenizer, ids: list[int], chars: int) -> int:
    """The most leading tokens whose text fits in `chars` characters."""
    low, high = 0, len(ids)
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if len(tokenizer.decode(ids[:mid])) <= chars else (low, mid - 1)
    return low


class ReasoningStream:
    """A streamed answer split as it grows: thinking goes out as reasoning until its end, then the rest as
    content. A possible start of a tag is held back until the next delta tells."""

    def __init__(self, fmt: ReasoningFormat):
        self.fmt = fmt
        self.text, self.sent = "", 0  # everything so far; how much of it went out (a dropped tag included)
        self.thinking = True

    def delta(self, delta: str, finished: bool) -> tuple[str, str]:
        """(reasoning, content) to send after the answer grew by `delta`."""
        self.text += delta
        reasoning = self._take_thinking(finished) if self.thinking else ""
        content = self.text[self.sent :] if not self.thinking else ""
        self.sent += len(content)
        return reasoning, content

    def _take_thinking(self, finished: bool) -> str:
        """The unsent thinking up to its end (which stops the thinking) or up to what could begin a tag."""
        rest = self.text[self.sent :]
        if self.sent == 0 and rest.startswith(_START):
            self.sent, rest = len(_START), rest[len(_START) :]
        elif self.sent == 0 and _START.startswith(rest) and not finished:
            return ""
        at, skip = self.fmt.end(rest)
        if at >= 0:
            out, self.thinking = rest[:at], False
            self.sent += skip
        elif not finished:
            out = rest[: len(rest) - max(held_back(rest, tag) for tag in self.fmt.tags())]
        else:
            out = rest
        self.sent += len(out)
        return out


def held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag`."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)
