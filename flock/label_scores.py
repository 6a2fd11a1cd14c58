"""Generative scoring: how likely each of a few label tokens ("Yes"/"No", "A".."D") is to come next after each item
joined to a shared query, as vLLM's /generative_scoring and SGLang's /v1/score (with label_token_ids) and
Engine.score give it. Each item is one prompt that samples one token with the labels' logprobs
(SamplingParams.logprob_token_ids); the query is the items' shared prefix, so its KV is computed once."""

import math
from collections.abc import Sequence
from dataclasses import dataclass

from flock.sampling_params import SamplingParams


@dataclass
class LabelQuery:
    """The query, the items and the labels of one scoring request. Texts are joined as text, SGLang's way
    (`join_text`), or each tokenized alone and their ids joined, vLLM's way (the query with the tokenizer's
    special tokens where `add_special_tokens`, the items without); token ids are always joined as ids."""

    query: str | list[int]
    items: Sequence[str] | Sequence[list[int]]
    label_token_ids: list[int]
    apply_softmax: bool = False  # over the labels alone; False: each label's probability over the whole vocabulary
    item_first: bool = False  # the item before the query
    add_special_tokens: bool = True
    join_text: bool = True

    def validate(self, vocab_size: int) -> None:
        labels = self.label_token_ids
        if not isinstance(labels, list) or not labels or not all(_is_int(t) for t in labels):
            raise ValueError(f"label_token_ids must be a non-empty list of token ids, got {labels!r}")
        outside = [t for t in labels if not 0 <= t < vocab_size]
        if outside:
            raise ValueError(f"label_token_ids {outside} are outside the vocabulary [0, {vocab_size})")
        if not isinstance(self.query, str) and not _is_ids(self.query):
            raise ValueError("query must be a string or a list of token ids")
        if isinstance(self.items, str) or not isinstance(self.items, Sequence) or not self.items:
            raise ValueError("items must be a non-empty list of strings or of token id lists")
        kinds = {isinstance(item, str) for item in self.items}
        if len(kinds) > 1 or not all(isinstance(item, str) or _is_ids(item) for item in self.items):
            raise ValueError("items must all be strings or all be lists of token ids")
        if kinds == {True} and not isinstance(self.query, str):
            raise ValueError("query must be text for text items (token id items take either)")
        for name in ("apply_softmax", "item_first", "add_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")

    def prompts(self, tokenizer) -> list[list[int]]:
        """Each item's prompt token ids."""
        if isinstance(self.query, str) and isinstance(self.items[0], str) and self.join_text:
            joined = (item + self.query if self.item_first else self.query + item for item in self.items)
            return [tokenizer.encode(text, add_special_tokens=self.add_special_tokens) for text in joined]
        query = self._ids(self.query, tokenizer, self.add_special_tokens)
        items = [self._ids(item, tokenizer, False) for item in self.items]
        return [item + query if self.item_first else query + item for item in items]

    @staticmethod
    def _ids(part: str | list[int], tokenizer, special: bool) -> list[int]:
        return tokenizer.encode(part, add_special_tokens=special) if isinstance(part, str) else list(part)

    def params(self, **fields) -> SamplingParams:
        """One greedy token with the labels' logprobs (`fields`: the request's others, e.g. its cache_salt)."""
        return SamplingParams(temperature=0.0, max_tokens=1, logprob_token_ids=list(self.label_token_ids), **fields)

    def probabilities(self, top: list[tuple[int, float]]) -> list[float]:
        """The labels' probabilities from a sampled token's listed logprobs (TokenLogprobs.top)."""
        logprobs = [lp for _, lp in top]
        if not self.apply_softmax:
            return [math.exp(lp) for lp in logprobs]
        peak = max(logprobs)
        if peak == -math.inf:  # every label masked out: no preference among them
            return [1.0 / len(logprobs)] * len(logprobs)
        weights = [math.exp(lp - peak) for lp in logprobs]
        total = sum(weights)
        return [w / total for w in weights]


def _is_int(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _is_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_int(t) and t >= 0 for t in value)
