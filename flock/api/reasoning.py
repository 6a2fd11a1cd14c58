"""A reasoning model's thinking split from its answer, as vLLM's server does with `--reasoning-parser`.

"deepseek_r1" (DeepSeek-R1 distills on Qwen2 and Llama, QwQ): the text up to the first `</think>` (after the
`<think>` it starts with, when the model writes it rather than the chat template) is the message's `reasoning`,
the rest its `content`. An answer that never closes its thinking is all reasoning.
"""

REASONING_PARSERS = ("deepseek_r1",)
_START, _END = "<think>", "</think>"
THINKING_END = _END


def thinking_open(tokenizer, prompt_ids: list[int]) -> bool:
    """Whether the answer to this prompt starts by thinking: unless the chat template closed the thinking already
    (a `</think>` after its last `<think>`, as templates do to turn thinking off)."""
    tail = tokenizer.decode(prompt_ids[-64:])
    return tail.rfind(_END) <= tail.rfind(_START)


def split_reasoning(text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole answer; content None when nothing follows the thinking."""
    if text.startswith(_START):
        text = text[len(_START) :]
    reasoning, end, content = text.partition(_END)
    return reasoning, (content or None) if end else None


def reasoning_token_count(tokenizer, output_ids: list[int]) -> int:
    """How many output tokens are thinking (vLLM's usage.completion_tokens_details.reasoning_tokens): those before
    the first `</think>` (all, when it never comes), not a `<think>` the answer starts with."""
    def tokens_within(chars: int) -> int:  # the most leading tokens whose text fits in `chars` characters
        low, high = 0, len(output_ids)
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if len(tokenizer.decode(output_ids[:mid])) <= chars else (low, mid - 1)
        return low

    text = tokenizer.decode(output_ids)
    end = text.find(_END)
    start = len(_START) if text.startswith(_START) else 0
    return tokens_within(end if end >= 0 else len(text)) - (tokens_within(start) if start else 0)


class ReasoningStream:
    """A streamed answer split as it grows: thinking goes out as reasoning until `</think>`, then the rest as
    content. A possible start of either tag is held back until the next delta tells."""

    def __init__(self):
        self.text, self.sent = "", 0  # everything so far; how much of it went out (tags included)
        self.thinking = True

    def delta(self, delta: str, finished: bool) -> tuple[str, str]:
        """(reasoning, content) to send after the answer grew by `delta`."""
        self.text += delta
        reasoning = ""
        if self.thinking:
            reasoning = self._take(_END, finished)
            if not self.thinking:
                self.sent += len(_END)
        return reasoning, self._take(None, finished) if not self.thinking else ""

    def _take(self, end: str | None, finished: bool) -> str:
        """The unsent text up to `end` (which then stops the thinking) or up to what could begin a tag."""
        rest = self.text[self.sent :]
        if self.sent == 0 and rest.startswith(_START):
            self.sent, rest = len(_START), rest[len(_START) :]
        elif self.sent == 0 and _START.startswith(rest) and not finished:
            return ""
        if end is not None and end in rest:
            out = rest[: rest.index(end)]
            self.thinking = False
        elif end is not None and not finished:
            out = rest[: len(rest) - held_back(rest, end)]
        else:
            out = rest
        self.sent += len(out)
        return out


def held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag`."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)
