from dataclasses import dataclass

from flock.request import Request


@dataclass
class DraftRow:
    """The sampling row of a request's logits after its first `len(drafts)` drafts: the request's params and
    generator, with those drafts as if already generated (penalties, bad words and min_tokens read them)."""

    request: Request
    drafts: list[int]
    grammar = None  # a request with a grammar gets no drafts

    @property
    def params(self):
        return self.request.params

    @property
    def generator(self):
        return self.request.generator

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + self.drafts


def accepted(tokens: list[int], drafts: list[int]) -> int:
    """How many leading drafts the tokens sampled at their rows confirm. A draft is a single token, so sampling the
    row and keeping the draft when it is the one drawn accepts it with its probability, and the token drawn in its
    place follows the row's distribution without it: the output is distributed as without drafts (greedy: the
    same tokens)."""
    for i, (token, draft) in enumerate(zip(tokens, drafts)):
        if token != draft:
            return i
    return len(drafts)
