"""A chat answer split as it streams, the same way a whole one is split: its thinking (with a reasoning parser),
its content, and its tool calls, parsed at the end (with a tool parser)."""

from __future__ import annotations

from flock.api.protocol import GenerationRequest
from flock.api.reasoning import ReasoningStream, answer_start, reasoning_token_count
from flock.api.tools import ToolCallStream
from flock.engine.async_engine import StreamOutput


class AnswerStream:
    def __init__(self, gen: GenerationRequest, tokenizer):
        self.gen, self.tokenizer = gen, tokenizer
        self.thinking = ReasoningStream(gen.reasoning) if gen.reasoning else None
        self.calls = ToolCallStream(gen.tools) if gen.tools is not None else None
        self.output_ids: list[int] = []
        self.reasoning_tokens = 0  # at the end: how many output tokens were thinking
        self.answer_start: int | None = None if gen.reasoning else 0  # output tokens before the answer, once known

    def split(self, out: StreamOutput) -> tuple[str, str, list[dict] | None, str | None]:
        """(reasoning, content, tool calls, finish reason) of this output."""
        reasoning, text, tool_calls, finish_reason = "", out.text, None, out.finish_reason
        if self.thinking is not None:
            self.output_ids += out.token_ids
            reasoning, text = self.thinking.delta(text, out.finished)
            if self.answer_start is None and (not self.thinking.thinking or out.finished):
                self.answer_start = answer_start(self.tokenizer, self.output_ids, self.gen.reasoning)
            if out.finished:
                self.reasoning_tokens = reasoning_token_count(self.tokenizer, self.output_ids, self.gen.reasoning)
        if self.calls is not None:
            text = self.calls.content(text)
            if out.finished:
                rest, tool_calls = self.calls.finish()
                text, finish_reason = text + rest, self.gen.tools.finish_reason(tool_calls, finish_reason)
        return reasoning, text, tool_calls, finish_reason
