import logging
from dataclasses import replace

import numpy as np
import torch

from flock.attention.base import StepLayout
from flock.config import EngineConfig
from flock.engine.runner import ModelRunner
from flock.kv.manager import CachedPrefix, KVCacheManager
from flock.model import resolve_model
from flock.request import Request
from flock.sample.sampler import distribution, draw
from flock.spec import SpeculativeConfig

log = logging.getLogger("flock")
DRAFT_SEED = 0x9E3779B97F4A7C15  # a request's seed, scrambled: its drafts' own random stream
SHORT_PASS = 256  # rows of a pass that run every row through the last layer (not just each sequence's last)


class DraftSequence:
    """A request as the draft model's KV manager sees it: the request's tokens and prefix-cache keys, the draft's own
    count of computed tokens, and the drafts whose KV it wrote after them in its last round."""

    def __init__(self, request: Request):
        self.request = request
        self.num_computed_tokens = 0
        self.fed: list[int] = []
        seed = request.params.seed  # a seeded request's drafts are drawn the same in any batch
        self.generator = None if seed is None else torch.Generator().manual_seed((seed * DRAFT_SEED + 1) % 2**64)

    @property
    def num_tokens(self) -> int:
        return self.request.num_tokens

    @property
    def reads_prefix_cache(self) -> bool:
        return self.request.reads_prefix_cache

    @property
    def root_hash(self) -> int:
        return self.request.root_hash

    def block_hashes(self, block_size: int, num_blocks: int) -> list[int]:
        return self.request.block_hashes(block_size, num_blocks)

    def cache_ids(self, start: int, end: int) -> list[int]:
        return self.request.cache_ids(start, end)

    def settle(self) -> None:
        """The drafts the target confirmed become computed tokens (their KV is the draft's already)."""
        fed, ids, start = self.fed, self.request.token_ids, self.num_computed_tokens
        confirmed = 0  # (the token sampled after them is not computed here yet)
        while confirmed < min(len(fed), len(ids) - 1 - start) and ids[start + confirmed] == fed[confirmed]:
            confirmed += 1
        self.num_computed_tokens += confirmed
        self.fed = []


class DraftModelProposer:
    """vLLM's `draft_model` speculation: a small model of the same vocabulary runs up to k greedy steps ahead of each
    decoding request, on its own paged KV cache (as many tokens as the target's, with its own prefix cache, so a
    shared prefix is computed once here too). A round is one pass over every request's tokens the draft has not
    computed (the target's last token and the drafts it confirmed; a new request's prompt, in chunks of the token
    budget), then one pass per further draft. With `draft_sample_method` "probabilistic", a sampled request's
    drafts are drawn from the draft's distribution under the request's temperature and truncations, kept for
    verification (`draft_probs`)."""

    def __init__(self, config: EngineConfig, spec: SpeculativeConfig, dtype: torch.dtype, max_model_len: int,
                 num_blocks: int, vocab_size: int):
        draft = replace(config, model=spec.model, tokenizer=None, hf_overrides=None, dtype=str(dtype).split(".")[-1],
                        quantization=spec.quantization or "auto", speculative_config=None, enable_lora=False,
                        lora_modules=None, num_kv_blocks=num_blocks, kv_cache_memory_bytes=None)
        resolved = resolve_model(spec.model)
        if resolved.config.base_model or resolved.config.num_labels:
            raise ValueError(f"speculative_config.model={spec.model!r} does not generate (it has no LM head)")
        self.runner = ModelRunner(draft, resolved, max_model_len)
        self.vocab_size = min(vocab_size, resolved.config.vocab_size)  # drafts stay in the target's vocabulary
        if resolved.config.vocab_size != vocab_size:
            log.warning("the draft model's vocabulary has %d entries, the target's %d: its drafts are read as the "
                        "target's token ids (the same tokenizer is assumed)", resolved.config.vocab_size, vocab_size)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.k = spec.num_speculative_tokens
        self.budget = config.max_num_batched_tokens
        self.sequences: dict[Request, DraftSequence] = {}
        self.probabilistic = spec.draft_sample_method == "probabilistic"
        self.generator = torch.Generator().manual_seed(config.seed + 1)  # of unseeded requests' drafts
        self.probs: dict[Request, list[torch.Tensor]] = {}  # this round's sampled drafts' distributions
        self.computed_tokens = 0  # tokens the draft model has run (prompts' cached blocks are not)

    @torch.inference_mode()
    def propose(self, requests: list[Request], limits: list[int]) -> list[list[int]]:
        """At most `limits[i]` drafts to follow each request's tokens (none for a request whose prompt the draft
        is still reading, or whose blocks its pool cannot hold)."""
        self.release({r for r, n in zip(requests, limits) if n > 0})
        self.probs = {}
        chunks: list[tuple[int, DraftSequence, int, int]] = []  # (index, sequence, new tokens, drafts)
        budget = self.budget
        for i, (req, limit) in enumerate(zip(requests, limits)):
            if limit > 0 and budget > 0 and req.params.multi_modal is None:
                chunk = self._admit(req, limit, budget)
                if chunk is not None:
                    chunks.append((i, *chunk))
                    budget -= chunk[1]
        drafts: list[list[int]] = [[] for _ in requests]
        if chunks:
            self._run(chunks, drafts)
        return drafts

    def draft_probs(self, req: Request) -> list[torch.Tensor] | None:
        """The distributions the request's latest drafts were sampled from (None: argmax drafts)."""
        return self.probs.get(req)

    def _admit(self, req: Request, limit: int, budget: int) -> tuple[DraftSequence, int, int] | None:
        """The request's sequence with slots for its uncomputed tokens (up to the budget) and the drafts to feed
        back after them: (sequence, new tokens, drafts), or None when the pool cannot hold them."""
        seq = self.sequences.get(req)
        cached = CachedPrefix()
        if seq is None:
            seq = DraftSequence(req)
            cached = self.kv.cached_prefix(seq)
            cached.tail_block, cached.tail_tokens = None, 0  # whole blocks only: no copies to run
        seq.settle()
        todo = req.num_tokens - seq.num_computed_tokens - self.kv.prefix_tokens(cached)
        n = min(todo, budget)
        m = limit if n == todo else 0
        if not self.kv.allocate(seq, n + max(m - 1, 0), cached):
            return None
        seq.num_computed_tokens += self.kv.prefix_tokens(cached)
        self.sequences[req] = seq
        return seq, n, m

    def _run(self, chunks: list[tuple[int, DraftSequence, int, int]], drafts: list[list[int]]) -> None:
        """The round's passes: the new tokens of every sequence, then one draft per sequence at a time."""
        starts = [seq.num_computed_tokens for _, seq, _, _ in chunks]
        ids = [seq.request.token_ids[s : s + n] for (_, seq, n, _), s in zip(chunks, starts)]
        tokens = self._forward([seq for _, seq, _, _ in chunks], starts, ids)
        for (i, seq, n, m), token in zip(chunks, tokens):
            seq.num_computed_tokens += n
            if m:
                self._add(drafts[i], seq, token)
        for j in range(1, max(m for *_, m in chunks)):
            going = [(i, seq) for i, seq, _, m in chunks if m > j]
            tokens = self._forward([seq for _, seq in going], [seq.num_computed_tokens + j - 1 for _, seq in going],
                                   [[drafts[i][-1]] for i, _ in going])
            for (i, seq), token in zip(going, tokens):
                self._add(drafts[i], seq, token)
        for i, seq, _, _ in chunks:
            seq.fed = drafts[i][:-1]
        self.kv.end_step()

    def _add(self, drafts: list[int], seq: DraftSequence, token: tuple[int, torch.Tensor | None]) -> None:
        drafts.append(token[0])
        if token[1] is not None:
            self.probs.setdefault(seq.request, []).append(token[1])

    def _forward(self, seqs: list[DraftSequence], starts: list[int], ids: list[list[int]]
                 ) -> list[tuple[int, torch.Tensor | None]]:
        """One pass of the draft model over each sequence's tokens from its start; each one's next token (and the
        distribution it was drawn from, or None: the argmax)."""
        bs = self.kv.block_size
        counts = np.array([len(t) for t in ids], dtype=np.int64)
        query_start = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start[1:])
        positions = np.concatenate([np.arange(s, s + len(t)) for s, t in zip(starts, ids)])
        tables = [np.asarray(self.kv.block_table(seq), dtype=np.int64) for seq in seqs]
        slots = np.concatenate([t[p // bs] * bs + p % bs for t, p in
                                zip(tables, np.split(positions, query_start[1:-1]))])
        self.computed_tokens += len(positions)
        device = self.runner.device
        layout = StepLayout(query_start=query_start, seq_lens=np.array(starts) + counts, block_tables=tables,
                            block_size=bs, slot_mapping=torch.from_numpy(slots).to(device),
                            sampled=np.arange(len(seqs)))
        last = torch.from_numpy(query_start[1:] - 1).to(device)
        # a short pass runs every row through the last layer: the step program then runs all of it (one C call)
        out_rows = None if len(positions) <= SHORT_PASS else last
        model = self.runner.model
        hidden = model(torch.tensor(sum(ids, []), dtype=torch.long, device=device),
                       torch.from_numpy(positions).to(device), self.runner.backend.build_metadata(layout), out_rows)
        hidden = hidden if out_rows is not None or len(last) == len(positions) else hidden[last]
        return self._pick(seqs, model.compute_logits(hidden)[:, : self.vocab_size])

    def _pick(self, seqs: list[DraftSequence], logits: torch.Tensor) -> list[tuple[int, torch.Tensor | None]]:
        """Each row's draft: the argmax, or for a sampled request when drafting is probabilistic, a draw from its
        distribution under the request's temperature and truncations."""
        tokens, probs = logits.argmax(-1), [None] * len(seqs)
        rows = [i for i, s in enumerate(seqs) if self.probabilistic and not s.request.params.greedy]
        if rows:
            q = distribution(logits[rows], [seqs[i].request.params for i in rows])
            u = torch.stack([torch.rand((), dtype=torch.float64, generator=seqs[i].generator or self.generator)
                             for i in rows])
            tokens[rows] = draw(q, u)
            for i, row in zip(rows, q):
                probs[i] = row
        return list(zip(tokens.tolist(), probs))

    def reset_cache(self) -> None:
        """Forget the draft's cached prefixes (with the target's: no request is running)."""
        self.release()
        self.kv.pool.reset_cache()

    def release(self, active: set[Request] = frozenset()) -> None:
        """Free the blocks of finished requests, and, when the pool runs short, of those not drafting now (a
        preempted one reads its prompt again if it comes back)."""
        short = self.kv.pool.num_free < len(active) * self.kv.blocks_needed(self.k + 1)
        for req in [r for r in self.sequences if r.is_finished or (short and r not in active)]:
            self.kv.free(self.sequences.pop(req))
