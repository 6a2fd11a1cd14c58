from enum import Enum, auto

from flock.sampling_params import SamplingParams


class RequestStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Request:
    """One sequence: its tokens, how many of them have KV in the cache, and its block table."""

    def __init__(self, request_id: int, prompt_token_ids: list[int], params: SamplingParams, arrival: float = 0.0):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.params = params
        self.arrival = arrival
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first admission
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of full blocks, computed once
        self.num_registered_blocks = 0  # leading blocks of the table already in the prefix cache
        self.kv_copy: tuple[int, int, int] | None = None  # (source block, own block, tokens): KV to copy this step
        self.finish_reason: str | None = None
        self.stop_text: str | None = None
        self.num_preemptions = 0
        self.generator = None  # torch.Generator of a seeded request
        self.samples = True  # False for a scheduler's prefix-only pseudo-request: computes KV, never samples
        self.first_token_time: float | None = None  # time.monotonic() when the first output token was sampled
        self.finish_time: float | None = None

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
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def __repr__(self) -> str:
        return f"Request({self.request_id}, computed={self.num_computed_tokens}/{self.num_tokens})"
