from dataclasses import dataclass
from enum import Enum, auto

from flock.kv.hashing import chained_hashes, root_hash
from flock.sample.logprobs import TokenLogprobs
from flock.sampling_params import SamplingParams


class RequestStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(frozen=True)
class RequestTimes:
    """Where a finished request's time went, in seconds, as vLLM's metrics define it: waiting until first scheduled,
    then until its first token (prefill, preemptions included), then until its last (decode)."""

    queued: float
    prefill: float | None  # None: no token came
    decode: float | None
    num_preemptions: int


class Request:
    """One sequence: its tokens and how many of them have KV in the cache. The scheduler moves it between
    states and advances `num_computed_tokens`; the engine appends sampled tokens. Its KV blocks belong to the
    KV manager."""

    def __init__(self, request_id: int, prompt_token_ids: list[int], params: SamplingParams, arrival: float = 0.0,
                 prefix_only: bool = False, adapter_id: int = 0):
        self.request_id = request_id
        self.adapter_id = adapter_id  # its LoRA adapter's id in the engine (0: none); one per load of a folder
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.params = params
        self.arrival = arrival
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first admission
        self._block_hashes: list[int] = []
        images = params.multi_modal
        self._image_ids = None if images is None else images.cache_ids(self.prompt_token_ids)
        self.root_hash = root_hash(*self.cache_namespace)  # the parent of its first block's hash
        self.finish_reason: str | None = None
        self.stop_text: str | None = None
        self.num_preemptions = 0
        self.generator = None  # torch.Generator of a seeded request
        self.prefix_only = prefix_only  # a scheduler's pseudo-request for a shared prefix: computes KV, never samples
        self.draft_token_ids: list[int] = []  # proposed to follow its tokens, verified in its next step
        self.draft_probs: list | None = None  # the draft model's distribution each draft was sampled from, if so
        self.draft_rate = 1.0  # running chance that its next draft holds (flock.spec.updated_rate)
        self.mirostat_mu = 2 * params.mirostat_tau if params.mirostat else None  # Mirostat's running bound
        self.grammar = None  # the xgrammar matcher of a structured request, advanced by each sampled token
        # the thinking's end token while its grammar waits for it (the grammar's text-until-</think> part would hold
        # the stop tokens back: they stay allowed, as where no grammar applies in the thinking); None otherwise
        self.grammar_waits: int | None = None
        self.thinking = None  # the ThinkingState of a request with a thinking_token_budget, advanced likewise
        self.detokenizer = None  # the engine's IncrementalText of its output, for stop strings and streams
        self.logprobs: list[TokenLogprobs] | None = [] if params.wants_logprobs else None  # per output token
        # per prompt token (the first has none); filled as the prompt is computed
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            [None] * len(self.prompt_token_ids) if params.wants_prompt_logprobs else None)
        self.prompt_ids = params.prompt_rows_ids(len(self.prompt_token_ids))  # per prompt position: ids to score
        self.whole_prompt = False  # an encoder's prompt attends both ways: computed in one step, never cut
        self.pooling = None  # PoolingParams of an embedding request: its last prompt row is pooled, not sampled
        self.embedding: list[float] | None = None  # then set when its prompt is computed
        # time.monotonic() when first in a step, when its first and last output tokens were sampled, when finished
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finish_time: float | None = None

    def times(self) -> RequestTimes | None:
        """Its phases so far (None: never scheduled)."""
        if self.scheduled_time is None:
            return None
        first, last = self.first_token_time, self.last_token_time
        return RequestTimes(self.scheduled_time - self.arrival, None if first is None else first - self.scheduled_time,
                            None if first is None else last - first, self.num_preemptions)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def cache_namespace(self) -> tuple[str | None, str | None]:
        """Its cache salt and LoRA adapter (the engine's id of its load: an adapter loaded again, whatever its
        folder, is another): requests share prefix-cache blocks only within one namespace."""
        return self.params.cache_salt, str(self.adapter_id) if self.adapter_id else None

    def chunk(self, start: int, n: int) -> int:
        """The tokens a step computes from `start` when n fit: n, or, where its images attend both ways (Gemma
        3's), the chunk moved off the middle of an image (see ImageInputs.fit_chunk); an encoder's prompt whole
        (its step may then pass the token budget)."""
        if self.whole_prompt:
            return self.num_tokens - start
        images = self.params.multi_modal
        return n if images is None or images.spans is None else images.fit_chunk(start, n)

    def cache_ids(self, start: int, end: int) -> list[int]:
        """Its tokens in [start, end) as prefix caching and prefix planning tell them apart: an image placeholder
        stands for its images (equal placeholders of different pixels are different tokens)."""
        if self._image_ids is None:
            return self.token_ids[start:end]
        prompt = self.num_prompt_tokens
        return self._image_ids[start : min(end, prompt)] + self.token_ids[max(start, prompt) : end]

    @property
    def reads_prefix_cache(self) -> bool:
        """False for a request whose prompt logprobs need every prompt token's logits computed, or that asks to
        compute its prompt whole."""
        return not self.params.wants_prompt_logprobs and not self.params.skip_reading_prefix_cache

    def block_hashes(self, block_size: int, num_blocks: int) -> list[int]:
        """Chained hashes of the first `num_blocks` full blocks of `block_size` tokens (each computed once: the
        list grows as later calls ask for more)."""
        hashes, done = self._block_hashes, len(self._block_hashes)
        if done < num_blocks:
            hashes += chained_hashes(self.cache_ids(done * block_size, num_blocks * block_size), block_size,
                                     hashes[-1] if hashes else self.root_hash)
        return hashes

    @property
    def forced_token(self) -> int | None:
        """The token its next one must be (a spent thinking budget's end of thinking), or None."""
        return None if self.thinking is None else self.thinking.forced

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def __repr__(self) -> str:
        return f"Request({self.request_id}, computed={self.num_computed_tokens}/{self.num_tokens})"
