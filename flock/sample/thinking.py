"""vLLM's `thinking_token_budget`: a reasoning model's thinking (the tokens after its `<think>` token, in the prompt
or the output) gets at most that many tokens; once it has used them, the end-of-thinking token is the only one the
row may draw, and the answer follows."""

from dataclasses import dataclass, replace

THINK_TOKENS = ("<think>", "</think>")


@dataclass(frozen=True)
class ThinkMarkers:
    """The token ids that open and close a model's thinking."""

    start: int
    end: int

    @classmethod
    def of(cls, tokenizer) -> "ThinkMarkers | None":
        """The tokenizer's `<think>` and `</think>` tokens, where each is one token of its vocabulary."""
        ids = [tokenizer.convert_tokens_to_ids(t) for t in THINK_TOKENS]  # (an unknown one: None or unk's id)
        if any(i is None or tokenizer.convert_ids_to_tokens(i) != t for i, t in zip(ids, THINK_TOKENS)):
            return None
        return cls(*ids)


@dataclass(frozen=True)
class ThinkingState:
    """Whether a sequence is thinking, and how many tokens its thinking has taken."""

    markers: ThinkMarkers
    budget: int
    thinking: bool = False
    used: int = 0

    @classmethod
    def of_prompt(cls, prompt_token_ids: list[int], markers: ThinkMarkers, budget: int) -> "ThinkingState":
        """A prompt thinks on where its last marker opens thinking (a template that starts the answer in it)."""
        last = next((t for t in reversed(prompt_token_ids) if t in (markers.start, markers.end)), None)
        return cls(markers, budget, last == markers.start)

    def after(self, tokens: list[int]) -> "ThinkingState":
        """The state once `tokens` have followed."""
        state = self
        for token in tokens:
            if token == self.markers.start:
                state = replace(state, thinking=True, used=0)
            elif token == self.markers.end:
                state = replace(state, thinking=False)
            elif state.thinking:
                state = replace(state, used=state.used + 1)
        return state

    @property
    def forced(self) -> int | None:
        """The token the next one must be: the end of thinking once the budget is spent."""
        return self.markers.end if self.thinking and self.used >= self.budget else None
