import numpy as np

from flock.request import Request
from flock.spec.config import SpeculativeConfig


class NgramProposer:
    """Prompt lookup: the context's longest suffix of `prompt_lookup_min` to `prompt_lookup_max` tokens that
    occurred earlier in the context (prompt and output), at its last such occurrence; the tokens that followed it
    there are the drafts. One vectorized comparison over the context finds the occurrences of the last token, and
    each longer suffix only narrows those: about a microsecond per thousand tokens of context."""

    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def reset_cache(self) -> None:
        """Nothing to forget: drafts come from each request's own tokens."""

    def draft_probs(self, req: Request) -> None:
        """None: a looked-up draft is one token, verified as such."""

    def propose(self, requests: list[Request], limits: list[int]) -> list[list[int]]:
        """At most `limits[i]` drafts to follow each request's tokens."""
        return [self.lookup(req.token_ids, limit) for req, limit in zip(requests, limits)]

    def lookup(self, token_ids: list[int], limit: int) -> list[int]:
        """At most min(num_speculative_tokens, limit) drafts to follow `token_ids`."""
        k = min(self.k, limit)
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        ids = np.asarray(token_ids)
        ends = np.flatnonzero(ids[:-1] == ids[-1]) + 1  # an earlier occurrence ends before ends[i]
        n = 1
        while ends.size and n < min(self.max_n, len(ids) - 1):
            before = ends - 1 - n
            longer = ends[(before >= 0) & (ids[np.maximum(before, 0)] == ids[-1 - n])]
            if not longer.size:
                break
            ends, n = longer, n + 1
        if not ends.size or n < self.min_n:
            return []
        start = int(ends[-1])
        return ids[start : start + k].tolist()
