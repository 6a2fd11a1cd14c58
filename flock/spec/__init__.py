"""Speculative decoding: drafts proposed from a request's own tokens (n-gram prompt lookup, as vLLM's `ngram`
method), verified by the model in the request's next step."""

from flock.spec.config import SpeculativeConfig
from flock.spec.ngram import NgramProposer
from flock.spec.verify import (DraftRow, accepted, drafts_worth, proposals, rewind_seeded, seeded_states,
                               updated_rate)

__all__ = ["SpeculativeConfig", "NgramProposer", "DraftRow", "accepted", "drafts_worth", "proposals", "rewind_seeded",
           "seeded_states", "updated_rate"]
