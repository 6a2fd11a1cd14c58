from dataclasses import dataclass

import torch

RATE_WEIGHT = 0.3  # of a step's outcome in a request's running acceptance rate
MIN_WORTH = 0.3  # a draft is proposed while the chance that it and the drafts before it hold is at least this

from flock.request import Request


@dataclass
class DraftRow:
    """The sampling row of a request's logits after its first `len(drafts)` drafts (none: its own row): the
    request's params, generator and grammar, with those drafts as if already generated (penalties, bad words,
    min_tokens and the grammar's mask read them)."""

    request: Request
    drafts: list[int]
    proposal: tuple[int, torch.Tensor] | None = None  # the draft this row verifies, sampled from this distribution

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

    @property
    def grammar_waits(self) -> int | None:
        """Request.grammar_waits as of this row (None once a draft before it ended the thinking)."""
        waits = self.request.grammar_waits
        return None if waits in self.drafts else waits

    @property
    def forced_token(self) -> int | None:
        thinking = self.request.thinking
        return None if thinking is None else thinking.after(self.drafts).forced


def proposals(req: Request, drafts: list[int]) -> list[tuple[int, torch.Tensor] | None]:
    """Each of a request's rows' proposal (SamplingRow.proposal): its next draft with the draft model's
    distribution where that draft was sampled from one (none for the row after the last draft)."""
    probs = req.draft_probs or []
    return [(d, probs[j]) if j < len(probs) else None for j, d in enumerate(drafts)] + [None]


def seeded_states(kept: list[tuple[Request, int, list[int]]]) -> list[torch.Tensor | None]:
    """Before a step samples, the generator state of each request whose rows draw from its own generator after
    n-gram drafts (seeded, drafts without a draft model's distribution), else None: see `rewind_seeded`."""
    return [req.generator.get_state() if drafts and req.generator is not None and not req.draft_probs else None
            for req, _, drafts in kept]


def rewind_seeded(kept: list[tuple[Request, int, list[int]]], states: list[torch.Tensor | None],
                  tokens: list[list[int]]) -> None:
    """Each such request's generator as it would be after drawing only for the tokens it keeps (one uniform
    each, as its rows drew them in order): a draft refused early draws no more than one refused late, so a seeded
    request's tokens depend neither on how many drafts its steps carried nor on the batch."""
    for (req, _, _), state, kept_tokens in zip(kept, states, tokens):
        if state is not None:
            req.generator.set_state(state)
            for _ in kept_tokens:
                torch.rand((), dtype=torch.float64, generator=req.generator)


def accepted(tokens: list[int], drafts: list[int]) -> int:
    """How many leading drafts the tokens sampled at their rows confirm. A draft is a single token, so sampling the
    row and keeping the draft when it is the one drawn accepts it with its probability, and the token drawn in its
    place follows the row's distribution without it: the output is distributed as without drafts (greedy: the
    same tokens)."""
    for i, (token, draft) in enumerate(zip(tokens, drafts)):
        if token != draft:
            return i
    return len(drafts)


def updated_rate(rate: float, drafts: int, accepted: int) -> float:
    """A request's running chance that a draft holds where the drafts before it did, after a step that verified
    `drafts` and confirmed the first `accepted` (each confirmed draft one success; the refused one, if any, one
    failure)."""
    trials = accepted + (accepted < drafts)
    return (1 - RATE_WEIGHT) * rate + RATE_WEIGHT * accepted / trials if trials else rate


def drafts_worth(rate: float, k: int) -> int:
    """How many drafts are worth their rows (each a row of every GEMM in the step) at that rate: the j-th holds
    with chance rate ** j; one at least, to keep measuring."""
    n = 1
    while n < k and rate ** (n + 1) >= MIN_WORTH:
        n += 1
    return n
