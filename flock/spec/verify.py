from dataclasses import dataclass

from flock.request import Request


@dataclass
class DraftRow:
    """The sampling row of a request's logits after its first `len(drafts)` drafts (none: its own row): the
    request's params, generator and grammar, with those drafts as if already generated (penalties, bad words,
    min_tokens and the grammar's mask read them)."""

    request: Request
    drafts: list[int]

    @property
    def params(self):
        return self.request.params

    @property
    def generator(self):
        return self.request.generator

    @property
    def grammar(self):
        return self.request.grammar

    @property
    def mirostat_mu(self) -> float | None:
        return self.request.mirostat_mu  # a Mirostat request gets no drafts

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + self.drafts if self.drafts else self.request.output_token_ids


def accepted(tokens: list[int], drafts: list[int]) -> int:
    """How many leading drafts the tokens sampled at their rows confirm. A draft is a single token, so sampling the
    row and keeping the draft when it is the one drawn accepts it with its probability, and the token drawn in its
    place follows the row's distribution without it: the output is distributed as without drafts (greedy: the
    same tokens)."""
    for i, (token, draft) in enumerate(zip(tokens, drafts)):
        if token != draft:
            return i
    return len(drafts)
