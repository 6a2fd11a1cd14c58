from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from flock.attention import make_backend
from flock.attention.base import StepLayout
from flock.config import EngineConfig
from flock.engine.heap import keep_freed_memory, release_freed_memory, zeroed
from flock.engine.kernels import prebuild_kernels
from flock.kv import fp8
from flock.lora.model import LoRAModel
from flock.model import ResolvedModel, apply_ops, build_model, resolve_dtype
from flock.model.llama import ImageRows
from flock.multimodal.encoder import VisionEncoder
from flock.multimodal.processor import image_prompts
from flock.pooling_params import PoolingParams
from flock.request import Request
from flock.sample.logprobs import TokenLogprobs, log_softmax, token_logprobs
from flock.sample.sampler import Sampled, Sampler, SamplingRow, whole
from flock.sched.base import StepPlan
from flock.spec import DraftRow, accepted, proposals, rewind_seeded, seeded_states

DEFAULT_KV_BYTES = 1 << 30
WARM_UP_TOKENS = 2048  # at most: a model's start-up pays about one full step for it
LOGPROB_ROWS = 512  # prompt rows turned into logits at a time (a row of logits is 4 bytes a vocabulary entry)


@dataclass
class StepOutput:
    """What a step produced: for each sampling request in plan order, its new tokens (its drafts the step
    confirmed, then the token sampled after them) and their logprobs where asked; the prompt logprobs of the
    prompt tokens it computed, as (request, position of the first, entries)."""

    tokens: list[list[int]]
    logprobs: list[list[TokenLogprobs | None]]
    prompt_logprobs: list[tuple[Request, int, list[TokenLogprobs]]] = field(default_factory=list)
    embeddings: list[list[float]] = field(default_factory=list)  # of each embedding request, in plan order
    mirostat_mu: list[float | None] = field(default_factory=list)  # per sampling request: its bound after the step
    kv_saved: list[tuple[int, tuple[int, ...], np.ndarray]] = field(default_factory=list)  # the plan's kv_saves:
    # (hash, tokens, KV bytes)


def draft_rows(finishing: list[tuple[Request, int, list[int]]]) -> tuple[list[SamplingRow], list[int]]:
    """The sampling rows of requests (with the step row of their last new token, and the drafts it ends with):
    a request's own row at its last verified token, then a row after each draft."""
    rows, indices = [], []
    for req, last, drafts in finishing:
        rows += [DraftRow(req, drafts[:j], p) for j, p in enumerate(proposals(req, drafts))]
        indices += range(last - len(drafts), last + 1)
    return rows, indices


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class ModelRunner:
    """Turns a step plan into tensors (once per step), runs the model, samples the finished contexts."""

    def __init__(self, config: EngineConfig, resolved: ResolvedModel, max_model_len: int,
                 eos_token_ids: Iterable[int] = (), classifier_ids: Iterable[int] = ()):
        c = resolved.config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, c, self.device)
        if self.device.type == "cpu":
            keep_freed_memory()
            prebuild_kernels()
        self.block_size = config.block_size
        self.kv_dtype = fp8.cache_dtype(config.kv_cache_dtype, self.dtype)
        self.backend = make_backend(config.attention, c, self.device, self.dtype, self.kv_dtype)
        self.model = build_model(
            resolved, self.backend, config.load_format, self.dtype, self.device, max_model_len, config.seed,
            config.quantization, list(classifier_ids),
        )
        # adapters' updates go on the projections before the GEMMs pack their weights (see LoRAModel)
        self.lora = LoRAModel(self.model, config.max_lora_rank, self.dtype, self.device) if config.enable_lora else None
        self.paths = apply_ops(self.model, config.ops, self.dtype, self.device)
        self.vision = None  # the VisionEncoder of a vision-language model
        if c.image_token_id is not None and resolved.gguf is None and image_prompts(str(resolved.folder)):
            self.vision = VisionEncoder(resolved.folder, self.dtype, self.device, config.load_format, config.seed,
                                        config.ops)
        self.num_blocks = self._num_blocks(config)
        shape = (self.num_blocks, self.block_size, c.num_key_value_heads, fp8.row_width(c.head_dim, self.kv_dtype))
        for attn in self.model.attention_layers():
            attn.k_cache = zeroed(shape, self.kv_dtype, self.device)
            attn.v_cache = zeroed(shape, self.kv_dtype, self.device)
        # one guard for every step (not reentrant): the decorator's new one a step costs a decode step ~100 us
        self.inference = torch.inference_mode()
        self.logits: torch.Tensor | None = None  # float32 rows the lm_head writes, kept across steps (_logits_out)
        # min_tokens holds the EOS ids back
        self.sampler = Sampler(config.seed, eos_token_ids, c.vocab_size, config.logprobs_mode)
        if self.device.type == "cpu":
            release_freed_memory()
            self.warm_up(min(config.max_num_batched_tokens, WARM_UP_TOKENS, max_model_len,
                             self.num_blocks * self.block_size))

    @property
    def attention_path(self) -> str:
        backend = self.backend
        return backend.name + (f" ({backend.isa})" if getattr(backend, "isa", None) else "")

    @property
    def kv_bytes_per_block(self) -> int:
        c = self.model.config
        row = fp8.row_width(c.head_dim, self.kv_dtype) * self.kv_dtype.itemsize
        return 2 * c.num_hidden_layers * self.block_size * c.num_key_value_heads * row

    def _num_blocks(self, config: EngineConfig) -> int:
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        budget = DEFAULT_KV_BYTES if config.kv_cache_memory_bytes is None else config.kv_cache_memory_bytes
        blocks = budget // self.kv_bytes_per_block
        if blocks < 1:
            raise ValueError(f"kv_cache_memory_bytes={budget} holds no block of {self.kv_bytes_per_block} bytes")
        return blocks

    def run(self, plan: StepPlan) -> StepOutput:
        """Run one forward pass; sample every request whose context is now complete (see `StepPlan.sampling`)."""
        with self.inference:
            return self._run(plan)

    def _run(self, plan: StepPlan) -> StepOutput:
        input_ids, positions, layout, last_rows = self._prepare(plan)
        image_rows = self._image_rows(plan, layout.query_start)
        prompt_rows = self._prompt_rows(plan, layout.query_start)
        drafts = [d for d, s in zip(plan.drafts, plan.samples) if s]
        if prompt_rows:
            layout.sampled = None  # the last layer finishes more rows than the sampled ones
        elif any(drafts):
            layout.sample_counts = np.array([len(d) + 1 for d in drafts])  # a row after each draft too
        self._load_kv(plan)
        self._copy_kv(plan)
        meta = self.backend.build_metadata(layout)
        # embedding requests' last rows are pooled, not sampled
        finishing = list(zip(plan.sampling(), last_rows, drafts))
        pooled = [(req.pooling, row) for req, row, _ in finishing if req.pooling is not None]
        kept = [(req, row, d) for req, row, d in finishing if req.pooling is None]
        sampling, sample_rows = draft_rows(kept)
        masks = self.sampler.start_masks(sampling)  # grammar bitmasks, filled while the model runs
        seeded = seeded_states(kept)
        # the last layer finishes only the rows it must (all of a decode step: no gather then)
        rows = sorted(set(sample_rows).union((row for _, row in pooled), *(r for *_, r in prompt_rows)))
        out_rows = None if len(rows) == len(input_ids) else torch.tensor(rows, dtype=torch.long, device=self.device)
        if self.lora is not None:
            self.lora.set_step([req.adapter_id for req, _ in plan.scheduled],
                               np.fromiter((n for _, n in plan.scheduled), np.int64), None if out_rows is None else rows)
        hidden = self.model(input_ids, positions, meta, out_rows, image_rows)
        at = {row: i for i, row in enumerate(rows)}
        out = StepOutput([], [], self._prompt_logprobs(hidden, at, prompt_rows))
        out.embeddings = [self._pool(pooling, hidden[at[row]]) for pooling, row in pooled]
        if sample_rows:
            finished = hidden[[at[r] for r in sample_rows]] if prompt_rows or pooled else hidden
            logits = self.model.compute_logits(finished, self._logits_out(len(finished)))
            sampled = self.sampler.sample(logits, sampling, masks)
            tokens = sampled.tokens.tolist()
            if len(tokens) == len(kept):  # no drafts: a row each
                out.tokens, out.mirostat_mu = [[t] for t in tokens], sampled.mirostat_mu
                out.logprobs = [[entry] for entry in sampled.logprobs]
            else:
                self._draft_outputs(out, kept, tokens, sampled)
                rewind_seeded(kept, seeded, out.tokens)
        out.kv_saved = self._saved_kv(plan)
        return out

    def _logits_out(self, rows: int) -> torch.Tensor | None:
        """Float32 [rows, vocab] for a step's logits on the CPU, a view of a buffer the next step overwrites: a
        fresh tensor of over 32 MiB (a few hundred rows) would be a fresh mapping whose pages fault in at every
        step (keep_freed_memory cannot keep it)."""
        if self.device.type != "cpu":
            return None
        if self.logits is None or len(self.logits) < rows:
            kept = 0 if self.logits is None else len(self.logits)
            self.logits = torch.empty((max(rows, 2 * kept), self.model.lm_head.out_features), dtype=torch.float32)
        return self.logits[:rows]

    @staticmethod
    def _draft_outputs(out: StepOutput, kept: list, tokens: list[int], sampled: Sampled) -> None:
        """Each request's tokens of a step with drafts: its last token's row, then one after each draft it keeps."""
        first = 0
        for _, _, d in kept:
            n = accepted(tokens[first : first + len(d)], d) + 1
            out.tokens.append(tokens[first : first + n])
            out.logprobs.append(sampled.logprobs[first : first + n])
            out.mirostat_mu.append(sampled.mirostat_mu[first])
            first += len(d) + 1

    def _image_rows(self, plan: StepPlan, query_start: np.ndarray) -> ImageRows | None:
        """The step rows of image placeholder tokens, the image features that replace their embeddings and their
        DeepStack rows (Qwen3-VL's)."""
        rows, features, deepstack = [], [], []
        for i, ((req, n), start) in enumerate(zip(plan.scheduled, plan.starts)):
            images = req.params.multi_modal
            if images is not None and start < req.num_prompt_tokens:
                positions, taken = images.rows_in(start, min(start + n, req.num_prompt_tokens))
                rows.append(positions - start + query_start[i])
                features.append(images.features[taken])
                if images.deepstack is not None:
                    deepstack.append(images.deepstack[:, taken])
        if not rows or not sum(len(r) for r in rows):
            return None
        return ImageRows(torch.from_numpy(np.concatenate(rows)).to(self.device), torch.cat(features),
                         torch.cat(deepstack, 1) if deepstack else None)

    @staticmethod
    def _prompt_rows(plan: StepPlan, query_start: np.ndarray) -> list[tuple[Request, int, range]]:
        """(request, first position, step rows) of the prompt tokens whose logprobs this step can give: a row
        at position p gives the logprob of prompt token p + 1."""
        out = []
        for i, ((req, n), start) in enumerate(zip(plan.scheduled, plan.starts)):
            if req.prompt_logprobs is None or req.prefix_only:
                continue
            end = min(start + n, req.num_prompt_tokens - 1)
            if end > start:
                first = int(query_start[i])
                out.append((req, start + 1, range(first, first + end - start)))
        return out

    def _prompt_logprobs(self, hidden: torch.Tensor, at: dict[int, int],
                         prompt_rows: list[tuple[Request, int, range]]) -> list[tuple[Request, int, list[TokenLogprobs]]]:
        out = []
        for req, first, rows in prompt_rows:
            entries = []
            targets = torch.tensor(req.token_ids[first : first + len(rows)])
            for lo in range(0, len(rows), LOGPROB_ROWS):
                chunk = [at[r] for r in rows[lo : lo + LOGPROB_ROWS]]
                kept = self._logits_out(len(chunk))
                logits = self.model.compute_logits(hidden[chunk], kept)
                logprobs = log_softmax(logits, logits if logits is kept else None)  # in place: no fresh rows
                listed = req.prompt_ids and req.prompt_ids[first + lo : first + lo + len(chunk)]
                entries += token_logprobs(logprobs, targets[lo : lo + len(chunk)],
                                          [whole(req.params.prompt_logprobs, logits.shape[-1])] * len(chunk), listed)
            out.append((req, first, entries))
        return out

    @torch.inference_mode()
    def warm_up(self, num_tokens: int) -> None:
        """A forward pass of a full token budget of dummy tokens, written to the first blocks (nothing is cached
        or sampled): a step's activations then reuse heap pages already mapped, where the first full steps
        would fault them in (2% of a bench-mid run). Every layer needs the same activations, so the pass runs
        the first and the last layer only: a full pass would cost a large model a full step's compute at start."""
        bs = self.block_size
        blocks = np.arange((num_tokens + bs - 1) // bs)
        layout = StepLayout(query_start=np.array([0, num_tokens]), seq_lens=np.array([num_tokens]),
                            block_tables=[blocks], block_size=bs,
                            slot_mapping=torch.arange(num_tokens, device=self.device))
        positions = torch.arange(num_tokens, device=self.device)
        layers = self.model.layers
        self.model.layers = nn.ModuleList([layers[0], layers[-1]])
        try:
            hidden = self.model(torch.zeros_like(positions), positions, self.backend.build_metadata(layout),
                                positions[-1:])
        finally:
            self.model.layers = layers
        if self.model.lm_head is not None:  # (a classifier's own head is freed)
            self.model.compute_logits(hidden)

    def _copy_kv(self, plan: StepPlan) -> None:
        """The cached first tokens of a block that admitted requests take instead of computing them: their KV
        copied from the source block, in every layer, before any of this step's writes."""
        copies = plan.kv_copies
        if not copies:
            return
        bs = self.block_size
        src = torch.tensor([s * bs + t for s, _, n in copies for t in range(n)], device=self.device)
        dst = torch.tensor([d * bs + t for _, d, n in copies for t in range(n)], device=self.device)
        for attn in self.model.attention_layers():
            for cache in (attn.k_cache, attn.v_cache):
                rows = cache.view(torch.uint8 if fp8.is_fp8(cache.dtype) else cache.dtype).view(-1, *cache.shape[2:])
                rows.index_copy_(0, dst, rows.index_select(0, src))

    def _kv_bytes(self) -> list[torch.Tensor]:
        """Every layer's K and V cache as bytes, a row per block: a block's KV, as the disk tier keeps it, is its
        rows in this order."""
        return [c.view(torch.uint8).view(self.num_blocks, -1)
                for attn in self.model.attention_layers() for c in (attn.k_cache, attn.v_cache)]

    def _load_kv(self, plan: StepPlan) -> None:
        """Blocks read from the disk tier, written into every layer before the step (and its copies) runs."""
        if not plan.kv_loads:
            return
        blocks = torch.tensor([b for b, _ in plan.kv_loads], device=self.device)
        data = torch.from_numpy(np.stack([d for _, d in plan.kv_loads])).to(self.device)
        at = 0
        for rows in self._kv_bytes():
            rows[blocks] = data[:, at : at + rows.shape[1]]
            at += rows.shape[1]

    def _saved_kv(self, plan: StepPlan) -> list[tuple[int, tuple[int, ...], np.ndarray]]:
        """The KV bytes of the full blocks the step computed that the disk tier keeps (copies: the blocks may be
        reused later)."""
        if not plan.kv_saves:
            return []
        blocks = torch.tensor([b for b, _, _ in plan.kv_saves], device=self.device)
        data = torch.cat([rows[blocks] for rows in self._kv_bytes()], dim=1).cpu().numpy()
        return [(h, tokens, data[i]) for i, (_, h, tokens) in enumerate(plan.kv_saves)]

    def _pool(self, pooling: PoolingParams, hidden: torch.Tensor) -> list[float]:
        """An embedding request's vector, or a classification's class probabilities, of its last hidden state."""
        if pooling.task == "classify":
            return self.model.classify(hidden, pooling.use_activation).tolist()
        return pooling.pool(hidden)

    def _prepare(self, plan: StepPlan):
        """Token ids, positions, the attention layout and the rows to sample. Lists built in Python, then one
        array each: a decode step's few rows take longer in numpy's many calls, whose code the weights' stream
        has evicted."""
        bs, query_start, seq_lens, positions, slots, ids = self.block_size, [0], [], [], [], []
        sampled, last_rows = [], []
        for i, ((req, n), start, table, drafts, samples) in enumerate(
                zip(plan.scheduled, plan.starts, plan.block_tables, plan.drafts, plan.samples)):
            end = start + n
            query_start.append(query_start[-1] + n)
            seq_lens.append(end)
            if n == 1:
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                positions += range(start, end)
                slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            ids += req.token_ids[start : end - len(drafts)]
            ids += drafts
            if samples:
                sampled.append(i)
                last_rows.append(query_start[-1] - 1)
        query_start, positions = np.array(query_start, dtype=np.int64), np.array(positions, dtype=np.int64)
        layout = StepLayout(query_start=query_start, seq_lens=np.array(seq_lens, dtype=np.int64),
                            block_tables=[np.array(t, dtype=np.int64) for t in plan.block_tables], block_size=bs,
                            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
                            sampled=np.array(sampled, dtype=np.int64),
                            attend_ends=self._attend_ends(plan, positions, query_start))
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        rope_positions = torch.from_numpy(self._rope_positions(plan, positions, query_start))
        return input_ids, rope_positions.to(self.device), layout, last_rows

    def _attend_ends(self, plan: StepPlan, positions: np.ndarray, query_start: np.ndarray) -> np.ndarray | None:
        """StepLayout.attend_ends: where the step's image tokens attend to their whole image (Gemma 3's), else
        None."""
        if not self.model.config.bidirectional_images:
            return None
        ends = positions.copy()
        for i, (req, _) in enumerate(plan.scheduled):
            images = req.params.multi_modal
            if images is not None and images.spans is not None:
                lo, hi = query_start[i], query_start[i + 1]
                ends[lo:hi] = images.attend_ends(positions[lo:hi])
        return None if (ends == positions).all() else ends

    def _rope_positions(self, plan: StepPlan, positions: np.ndarray, query_start: np.ndarray) -> np.ndarray:
        """The rotary positions of the step's tokens: their positions in their sequences, unless an M-RoPE prompt's
        images set them (then [3, tokens] time, height and width positions where any of the three differ)."""
        if self.model.config.mrope_section is None:
            return positions
        mixed = [(i, req.params.multi_modal) for i, (req, _) in enumerate(plan.scheduled)
                 if req.params.multi_modal is not None and req.params.multi_modal.rope_positions is not None]
        if not mixed:
            return positions
        out = np.broadcast_to(positions, (3, len(positions))).copy()
        for i, images in mixed:
            lo, hi = query_start[i], query_start[i + 1]
            out[:, lo:hi] = images.rope_rows(positions[lo], positions[lo] + hi - lo)
        return out[0] if (out == out[0]).all() else out
