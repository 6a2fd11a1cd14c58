import gc
import logging
import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from flock.config import EngineConfig
from flock.engine.detokenizer import IncrementalText
from flock.engine.draft_model import DraftModelProposer
from flock.engine.encoder_runner import EncoderRunner
from flock.engine.kernels import start_kernel_builds
from flock.engine.runner import ModelRunner, StepOutput, resolve_device
from flock.engine.stats import RunStats
from flock.kv.disk_store import DiskKVStore, fingerprint
from flock.kv.manager import KVCacheManager
from flock.lora import LoRARequest, lora_requests
from flock.model import classifier_token_ids, resolve_model
from flock.model.config import sampling_defaults
from flock.multimodal.processor import IMAGES_REFUSED
from flock.pooling_params import ModelTasks, PoolingParams
from flock.request import Request
from flock.sample.dry import breaker_tokens
from flock.sample.grammar import GrammarCompiler, drafts_in_grammar
from flock.sample.thinking import THINK_TOKENS, ThinkingState, ThinkMarkers
from flock.sampling_params import MAX_LOGPROBS, SamplingParams
from flock.sched import StepPlan, make_scheduler
from flock.spec import NgramProposer, drafts_worth, updated_rate
from flock.tokenizer import load_tokenizer

log = logging.getLogger("flock")
REPETITION_STOP = "repetition_detected"  # vLLM's stop_reason of an output that repetition_detection ended


def check_priority(params: SamplingParams, scheduler: str) -> None:
    """A request's priority is the priority scheduler's to use; with the others it must be 0 (as vLLM's)."""
    if params.priority != 0 and scheduler != "priority":
        raise ValueError(f"priority must be 0 unless the scheduler is 'priority' (vLLM's --scheduling-policy "
                         f"priority), got {params.priority}")


def check_prompt(prompt_token_ids: list[int], params: SamplingParams, max_model_len: int, vocab_size: int,
                 generates: bool = True, max_logprobs: int = MAX_LOGPROBS) -> None:
    """Raise ValueError naming the bad field of a request for an engine with these limits (its prompt as
    truncate_prompt_tokens keeps it; a generation's leaving room for a token, as vLLM's; logprobs up to
    max_logprobs, -1 the vocabulary)."""
    params.validate(vocab_size)
    most = vocab_size if max_logprobs == -1 else max_logprobs
    for name in ("logprobs", "prompt_logprobs"):
        asked = getattr(params, name)
        if asked is not None and (vocab_size if asked == -1 else asked) > most:
            raise ValueError(f"{name} {asked} is more than the engine's max_logprobs {max_logprobs} (-1 asks for the "
                             "whole vocabulary, which max_logprobs -1 allows)")
    prompt_token_ids = params.truncated(prompt_token_ids, max_model_len)
    n = len(prompt_token_ids)
    if n == 0:
        raise ValueError("prompt is empty")
    if n > max_model_len:  # vLLM's words, which clients look for
        raise ValueError(f"This model's maximum context length is {max_model_len} tokens (max_model_len). However, "
                         f"your prompt contains {n} input tokens, which exceeds this limit even without any output "
                         "tokens. Please reduce the length of the input prompt.")
    if n == max_model_len and generates:
        raise ValueError(f"The prompt (length {n}) plus the number of requested output tokens (at least 1) is longer "
                         f"than the maximum model length of {max_model_len} (max_model_len)")
    params.prompt_rows_ids(n)
    ids = np.asarray(prompt_token_ids)
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size)) if ids.dtype.kind in "iu" and ids.ndim == 1 else None
    if bad is None or len(bad):
        position = next(i for i, t in enumerate(prompt_token_ids) if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab_size)
        t = prompt_token_ids[position]
        raise ValueError(f"prompt_token_ids[{position}] = {t!r} is outside the vocabulary [0, {vocab_size})")


def engine_params(params: SamplingParams | PoolingParams, model: ModelTasks, max_model_len: int) -> SamplingParams:
    """The sampling params a request runs with: a pooling request's own (checked against what the model serves;
    see PoolingParams.as_sampling), a generation's as given (ValueError if the model does not generate)."""
    if isinstance(params, PoolingParams):
        params.validate(model)
        return params.as_sampling(max_model_len)
    if why := model.refusal("generate"):
        raise ValueError(why)
    return params


def encoder_config(config: EngineConfig) -> EngineConfig:
    """The settings an encoder runs with: no prefix cache (a prefix's hidden states depend on what follows it) and
    fcfs or priority scheduling (nothing to share); ValueError for what needs a decoder's KV or LM head."""
    for name, value in (("kv_cache_disk_dir", config.kv_cache_disk_dir), ("speculative_config",
                        config.speculative_config), ("enable_lora", config.enable_lora)):
        if value:
            raise ValueError(f"{name}: {config.model} is a bidirectional encoder (no KV cache, no LM head)")
    scheduler = config.scheduler if config.scheduler in ("fcfs", "priority") else "fcfs"
    if scheduler != config.scheduler:
        log.info("%s is an encoder: its prompts share no KV, so the %s scheduler runs as fcfs", config.model,
                 config.scheduler)
    return replace(config, enable_prefix_caching=False, scheduler=scheduler)


def allow_long_max_model_len() -> bool:
    """FLOCK_ALLOW_LONG_MAX_MODEL_LEN read as vLLM reads its VLLM_ALLOW_LONG_MAX_MODEL_LEN: "1" or "true"."""
    return os.environ.get("FLOCK_ALLOW_LONG_MAX_MODEL_LEN", "0").strip().lower() in ("1", "true")


class LLMEngine:
    """The step loop: scheduler -> plan -> runner (model, sampler) -> postprocess -> scheduler."""

    def __init__(self, config: EngineConfig):
        self.config = config
        if resolve_device(config.device).type == "cpu":
            start_kernel_builds()  # beside the model's resolving and loading
        resolved = resolve_model(config.model, config.hf_overrides)
        self.model_config = resolved.config
        self.model_folder = resolved.folder
        max_len = config.max_model_len if config.max_model_len not in (None, -1) else \
            resolved.config.default_max_model_len
        if max_len > resolved.config.context_length and not allow_long_max_model_len():
            raise ValueError(f"max_model_len={max_len} is longer than the model's {resolved.config.context_length} "
                             "positions (as vLLM, set FLOCK_ALLOW_LONG_MAX_MODEL_LEN=1 to run past them anyway)")
        self.tokenizer = load_tokenizer(config.tokenizer or resolved.tokenizer_path, config.chat_template)
        self.think_markers = ThinkMarkers.of(self.tokenizer)
        self.eos_token_ids = set(resolved.config.eos_token_id)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        classifier_ids = classifier_token_ids(self.tokenizer, resolved.config) if resolved.config.classifier_tokens \
            else ()
        encoder = resolved.config.encoder
        if encoder:
            config = self.config = encoder_config(config)
            self.runner = EncoderRunner(config, resolved, max_len, self.tokenizer.sep_token_id)
        else:
            self.runner = ModelRunner(config, resolved, max_len, self.eos_token_ids, classifier_ids)
        disk = self._disk_store(config, resolved, max_len) if config.kv_cache_disk_dir else None
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching, disk)
        if max_len > self.kv.capacity_tokens and config.max_model_len not in (None, -1):  # asked for, as vLLM
            raise ValueError(f"max_model_len={max_len}: one request of that length needs {max_len} tokens of KV "
                             f"cache, which holds {self.kv.capacity_tokens} (raise kv_cache_memory_bytes or "
                             "num_kv_blocks, or lower max_model_len; -1 or auto fits it to the cache)")
        if max_len > self.kv.capacity_tokens:
            log.warning("max_model_len %d exceeds the KV cache (%d tokens); capping it", max_len, self.kv.capacity_tokens)
            max_len = self.kv.capacity_tokens
        self.max_model_len = max_len
        c = resolved.config
        template = self.tokenizer.chat_template if config.chat_template and c.num_labels else None  # the flag's
        self.tasks = ModelTasks(config.model, c.hidden_size, not c.base_model, c.num_labels, c.labels, c.use_sep_token,
                                template, c.encoder, c.token_classifier, c.embedding_normalize, c.matryoshka)
        self.sampling_defaults = self._sampling_defaults(config.generation_config, resolved,
                                                         config.override_generation_config)
        self.scheduler = make_scheduler(config.scheduler, config, self.kv)
        self.speculative = config.speculative()
        self.proposer = self._proposer(config, max_len)
        self.stats = RunStats(num_kv_blocks=self.runner.num_blocks)
        self.lora_requests = lora_requests(config.lora_modules or [])  # the adapters the API knows by name
        for request in self.lora_requests.values():
            self.load_lora(request)
        self.grammars = GrammarCompiler(self.tokenizer, resolved.config.vocab_size, sorted(self.eos_token_ids),
                                        config.structured_outputs_any_whitespace)
        self._next_id = 0
        # what loading made (modules, tokenizer tables) lives as long as the engine: out of the collector's
        # full passes, which otherwise traverse it all, ~2% of a long run (as vLLM and SGLang do)
        gc.collect()
        gc.freeze()

    def _disk_store(self, config: EngineConfig, resolved, max_len: int) -> DiskKVStore:
        """The prefix cache's disk tier: a folder of its own for the model's files, dtypes, KV layout and RoPE
        table (LongRoPE's factors follow max_model_len): a block another run wrote is read only where it would
        have computed the same bits."""
        runner = self.runner
        files = [Path(resolved.gguf.path)] if resolved.gguf is not None else \
            sorted(p for p in Path(resolved.folder).iterdir() if p.is_file())
        identity = {"files": [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files],
                    "hf_overrides": config.hf_overrides, "load_format": config.load_format, "seed": config.seed,
                    "quantization": config.quantization, "ops": config.ops, "backend": type(runner.backend).__name__,
                    "dtype": str(runner.dtype), "kv_dtype": str(runner.kv_dtype), "block_size": config.block_size,
                    "block_bytes": runner.kv_bytes_per_block}
        if (resolved.config.rope_scaling or {}).get("rope_type") == "longrope":
            identity["rope_positions"] = max_len
        return DiskKVStore(Path(config.kv_cache_disk_dir) / fingerprint(identity), config.kv_cache_disk_bytes,
                           config.block_size, runner.kv_bytes_per_block)

    def _proposer(self, config: EngineConfig, max_len: int) -> NgramProposer | DraftModelProposer | None:
        spec = self.speculative
        if spec is None:
            return None
        if spec.method == "ngram":
            return NgramProposer(spec)
        return DraftModelProposer(config, spec, self.runner.dtype, max_len, self.runner.num_blocks,
                                  self.vocab_size)

    @staticmethod
    def _sampling_defaults(source: str, resolved, overrides: dict | None) -> dict:
        """Requests' default sampling fields from a generation_config.json (see EngineConfig.generation_config),
        `overrides` over them."""
        if source == "vllm" or (source == "auto" and resolved.gguf is not None):  # a GGUF file carries none
            return sampling_defaults(None, overrides)
        folder = resolved.folder if source == "auto" else Path(source)
        if source != "auto" and not (folder / "generation_config.json").is_file():
            raise ValueError(f"generation_config={source!r}: no generation_config.json there")
        defaults = sampling_defaults(folder, overrides)
        if defaults:
            log.warning("requests that leave them unset sample with %s, from %s/generation_config.json (as vLLM; "
                        "--generation-config vllm turns this off)", defaults, folder)
        return defaults

    def get_tokenizer(self):
        """vLLM's `llm_engine.get_tokenizer()`."""
        return self.tokenizer

    @property
    def vocab_size(self) -> int:
        """The model's (its logits' width)."""
        return self.model_config.vocab_size

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams) -> None:
        """Raise ValueError naming the bad field (a structured-output spec the grammar engine rejects included);
        changes nothing but the grammar cache."""
        generates = not isinstance(params, PoolingParams)
        params = engine_params(params, self.tasks, self.max_model_len)
        check_prompt(prompt_token_ids, params, self.max_model_len, self.vocab_size, generates, self.config.max_logprobs)
        check_priority(params, self.config.scheduler)
        if params.thinking_token_budget is not None and self.think_markers is None:
            raise ValueError(f"thinking_token_budget needs a model whose tokenizer has {' and '.join(THINK_TOKENS)} "
                             "tokens (its thinking's bounds); this one has none")
        spec, budget = params.structured_outputs, params.thinking_token_budget
        if budget is not None and spec is not None and spec.after is None and \
                ThinkingState.of_prompt(prompt_token_ids, self.think_markers, budget).thinking:
            raise ValueError("thinking_token_budget with structured outputs needs a reasoning parser "
                             "(--reasoning-parser, LLM(reasoning_parser=...)): the grammar then starts after the "
                             "thinking, which the budget ends")
        if params.lora_request is not None:
            self._lora(params.lora_request).check(params.lora_request)
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)
        if params.multi_modal is not None:
            self._encode_images(prompt_token_ids, params)

    def _encode_images(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """The prompt's image features from the vision encoder (its cache first)."""
        if self.runner.vision is None:
            raise ValueError(IMAGES_REFUSED)
        if len(params.truncated(prompt_token_ids, self.max_model_len)) < len(prompt_token_ids):
            raise ValueError("truncate_prompt_tokens cannot cut a prompt with images")
        images = params.multi_modal
        if len(images.positions) and images.positions[-1] >= len(prompt_token_ids):
            raise ValueError("the prompt's image placeholders lie past its tokens")
        self.runner.vision.encode(images)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams) -> Request:
        """Queue a generation (SamplingParams) or an embedding (PoolingParams) of the prompt."""
        pooling = params if isinstance(params, PoolingParams) else None
        if pooling is None and params.n != 1:
            raise ValueError(f"n={params.n}: an engine request is one sample (add params.samples() one by one)")
        self.check_request(prompt_token_ids, params)
        if pooling is not None:
            pooling = pooling.resolved(self.tasks)
            params = pooling.as_sampling(self.max_model_len, getattr(self.tokenizer, "truncation_side", "right"))
        prompt_token_ids = self._truncated(prompt_token_ids, params)
        if params.bad_words:
            params.tokenize_bad_words(self.tokenizer)
        if params.dry:
            params.dry_breakers = breaker_tokens(self.tokenizer, tuple(params.dry_sequence_breakers))
        adapter_id = 0 if params.lora_request is None else self.runner.lora.admit(params.lora_request, self._next_id)
        req = Request(self._next_id, prompt_token_ids, params, arrival=time.monotonic(), adapter_id=adapter_id)
        req.pooling = pooling
        req.whole_prompt = self.model_config.encoder
        self._next_id += 1
        if params.structured_outputs is not None:
            req.grammar = self.grammars.matcher(params.structured_outputs)
            if params.structured_outputs.after == THINK_TOKENS[1] and self.think_markers is not None \
                    and not params.ignore_eos:
                req.grammar_waits = self.think_markers.end
        if params.thinking_token_budget is not None:
            req.thinking = ThinkingState.of_prompt(prompt_token_ids, self.think_markers, params.thinking_token_budget)
        if params.seed is not None:
            req.generator = torch.Generator().manual_seed(params.seed)
        self.scheduler.add(req)
        self.stats.add_request(req)
        return req

    def _truncated(self, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt cut to its truncate_prompt_tokens; an encoder's keeps the [CLS] and [SEP] at its ends, as a
        tokenizer's truncation keeps them."""
        cut = params.truncated(prompt_token_ids, self.max_model_len)
        if not self.model_config.encoder or len(cut) == len(prompt_token_ids) or not cut:
            return cut
        tok = self.tokenizer
        if params.truncation_side == "left" and prompt_token_ids[0] == tok.cls_token_id:
            return prompt_token_ids[:1] + cut[1:]
        if params.truncation_side != "left" and prompt_token_ids[-1] == tok.sep_token_id:
            return cut[:-1] + prompt_token_ids[-1:]
        return cut

    def load_lora(self, request: LoRARequest, inplace: bool = False) -> None:
        """Load a LoRA adapter (once per name and folder; `inplace`: read again, the requests admitted before
        keeping what they ran with); ValueError naming what is wrong with it."""
        self._lora(request).load(request, inplace or request.load_inplace)

    def unload_lora(self, name: str) -> None:
        """Unload a LoRA adapter (ValueError if none has that name): its requests already admitted finish with it,
        its cached prefixes age out of the cache (a later load of the name is another adapter)."""
        if self.runner.lora is None:
            raise ValueError(f"no LoRA adapter is loaded as {name!r}")
        self.runner.lora.unload(name)
        self.lora_requests.pop(name, None)

    def _lora(self, request: LoRARequest):
        if self.runner.lora is None:
            raise ValueError(f"lora_request {request.lora_name!r}: this engine serves no LoRA adapters (start it with "
                             "enable_lora=True, --enable-lora or --lora-modules)")
        return self.runner.lora

    def _done(self, reqs: list[Request]) -> None:
        """Finished requests let go of their LoRA adapters."""
        for req in reqs:
            if req.adapter_id:
                self.runner.lora.finished(req.adapter_id, req.request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (a benchmark's cold start), unless requests are running or waiting:
        then nothing changes and it returns False, as vLLM's and SGLang's do."""
        if self.has_unfinished():
            return False
        self.kv.pool.reset_cache()
        if self.proposer is not None:
            self.proposer.reset_cache()
        return True

    def abort(self, req: Request) -> None:
        if not req.is_finished:
            self.scheduler.abort(req)
            self._done([req])

    def step(self) -> list[Request]:
        """Run one step; return the requests that finished in it."""
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        t1 = time.perf_counter()
        if not plan:
            raise RuntimeError("the scheduler planned nothing while requests are pending (deadlock)")
        now = time.monotonic()
        for req, _ in plan.scheduled:
            if req.scheduled_time is None:
                req.scheduled_time = now
        out = self.runner.run(plan)
        self.kv.end_step()
        if out.kv_saved:
            self.kv.save(out.kv_saved)
            self.stats.disk_saved_blocks += len(out.kv_saved)
        t2 = time.perf_counter()
        self.stats.add_step(plan, t1 - t0, t2 - t1, self.kv.pool.num_used)
        self.scheduler.observe(plan, t2 - t1)
        finished = self._postprocess(plan, out)
        self._done(finished)
        return finished

    def _postprocess(self, plan: StepPlan, out: StepOutput) -> list[Request]:
        """Apply a step's results, the one place that does: each request's computed tokens advance, the sampled
        ones get their token (its logprobs, and its grammar advances), and those that stop finish."""
        for req, first, entries in out.prompt_logprobs:
            req.prompt_logprobs[first : first + len(entries)] = entries
        finished, drafting = [], []
        sampled, pooled, mirostat = iter(zip(out.tokens, out.logprobs)), iter(out.embeddings), iter(out.mirostat_mu)
        now = time.monotonic()
        for (req, n), samples, drafts in zip(plan.scheduled, plan.samples, plan.drafts):
            req.num_computed_tokens += n - len(drafts)
            if not samples:
                continue
            if req.num_output_tokens == 0:
                self.stats.cached_prefill_tokens += req.num_cached_tokens
                req.first_token_time = now
            req.last_token_time = now
            if req.pooling is not None:
                req.embedding, req.finish_reason, req.finish_time = next(pooled), "stop", now
                self.scheduler.finish(req)
                finished.append(req)
                continue
            tokens, logprobs = next(sampled)
            mu = next(mirostat, None)
            if mu is not None:
                req.mirostat_mu = mu
            req.num_computed_tokens += len(tokens) - 1  # the confirmed drafts
            if drafts:
                self.stats.add_drafts(len(drafts), len(tokens) - 1)
                req.draft_rate = updated_rate(req.draft_rate, len(drafts), len(tokens) - 1)
            if self._append(req, tokens, logprobs):
                req.finish_time = now
                self.scheduler.finish(req)
                finished.append(req)
            elif self.proposer is not None:
                drafting.append(req)
        if drafting or finished and self.proposer is not None:  # (a draft model's sequences of finished ones go)
            for req, (drafts, probs) in zip(drafting, self._propose(drafting)):
                req.draft_token_ids, req.draft_probs = drafts, probs
        return finished

    def _append(self, req: Request, tokens: list[int], logprobs: list) -> bool:
        """Give the request its new tokens, one by one until one stops it (True then: the rest are dropped). A
        token its grammar refuses (the request's other filters, allowed_token_ids or bad_words, left none that it
        allows) is not given: the request ends there, finish_reason "abort"."""
        for token, entry in zip(tokens, logprobs):
            stops_thinking = req.grammar_waits is not None and token in self.eos_token_ids  # no grammar to meet
            if req.grammar is not None and not req.grammar.is_terminated() and not stops_thinking \
                    and not req.grammar.accept_token(token):
                req.finish_reason = "abort"
                return True
            if token == req.grammar_waits:
                req.grammar_waits = None
            req.token_ids.append(token)
            if req.logprobs is not None:
                req.logprobs.append(entry)
            if req.thinking is not None:
                req.thinking = req.thinking.after([token])
            self.stats.generated_tokens += 1
            if self._check_stop(req):
                return True
        return False

    def _propose(self, reqs: list[Request]) -> list[tuple[list[int], list | None]]:
        """Drafts to verify in each request's next step, no more than its length caps leave room for beside the
        token sampled after them; under a grammar, those it allows (the tokens it forces, where it does); none for
        Mirostat, whose bound moves with each token, nor XTC, whose second draw a row's order would move (see
        flock.spec.rewind_seeded). With each, the distributions the drafts were sampled from
        (the draft model's, probabilistic drafting; None: verified as one token each). A constrained request's are
        always verified as tokens: which drafts its grammar keeps (or replaces by the tokens it forces) depends on
        their values, and the test against the draft's distribution would skew what it samples then."""
        k = self.speculative.drafts_for(len(reqs))
        limits = [0 if req.params.mirostat or req.params.xtc or not k else
                  min(self._room(req) - 1, drafts_worth(req.draft_rate, k)) for req in reqs]
        out = []
        for req, drafts, limit in zip(reqs, self.proposer.propose(reqs, limits), limits):
            if req.grammar is None or req.grammar.is_terminated():
                out.append((drafts, self.proposer.draft_probs(req)))
            else:
                out.append((drafts_in_grammar(req.grammar, drafts, limit), None))
        return out

    def _room(self, req: Request) -> int:
        """Tokens the request may still get before a length cap."""
        left = self.max_model_len - req.num_tokens
        return left if req.params.max_tokens is None else min(left, req.params.max_tokens - req.num_output_tokens)

    def _check_stop(self, req: Request) -> bool:
        token, p = req.token_ids[-1], req.params
        # as vLLM: no EOS or stop token before min_tokens output tokens, no stop string within them
        stoppable = req.num_output_tokens >= p.min_tokens
        if stoppable and not p.ignore_eos and token in self.eos_token_ids:
            # as vLLM: the generation config's other EOS ids are stop tokens, named as the stop reason
            req.finish_reason, req.stop_text = "stop", None if token == self.tokenizer.eos_token_id else token
        elif req.grammar is not None and req.grammar.is_terminated():  # its stop token ended the grammar
            req.finish_reason = "stop"
        elif stoppable and token in p.stop_token_ids:
            req.finish_reason, req.stop_text = "stop", token
        elif p.stop and req.num_output_tokens > p.min_tokens and self._find_stop_string(req):
            req.finish_reason = "stop"  # before the length caps: a stop string in the last token still stops
        elif p.max_tokens is not None and req.num_output_tokens >= p.max_tokens:
            req.finish_reason = "length"
        elif req.num_tokens >= self.max_model_len:
            req.finish_reason = "length"
        elif stoppable and p.repetition_detection is not None and p.repetition_detection.found(req.output_token_ids):
            req.finish_reason, req.stop_text = "repetition", REPETITION_STOP
        return req.finish_reason is not None

    def _find_stop_string(self, req: Request) -> bool:
        """Whether the new text holds a stop string (the one that ends first there, the first listed of those, as
        vLLM picks it)."""
        searched = len(req.detokenizer.text) if req.detokenizer is not None else 0
        text = self.running_text(req)
        ends = []
        for i, s in enumerate(req.params.stop):
            # in the new text and the end of the text before it (one character more: a clean-up may drop a space)
            at = text.find(s, max(self._stop_search_start(req, s), searched - len(s)))
            if at >= 0:
                ends.append((at + len(s), i))
        if ends:
            req.stop_text = req.params.stop[min(ends)[1]]
        return bool(ends)

    def _stop_search_start(self, req: Request, stop: str) -> int:
        """Where a stop string may begin: anywhere, or, with min_tokens, ending past the text of the first
        min_tokens output tokens (vLLM checks only the text that follows them)."""
        n = req.params.min_tokens
        if n == 0:
            return 0
        held = self._text(req).final(req.output_token_ids[:n])  # a character split at n is not its text yet
        return max(0, len(held) - len(stop) + 1)

    def _text(self, req: Request) -> IncrementalText:
        """A fresh incremental text of the request's output after its prompt."""
        return IncrementalText(self.tokenizer, req.params.skip_special_tokens, prompt_ids=req.prompt_token_ids)

    def running_text(self, req: Request) -> str:
        """The output text so far: of a running request, the text of its settled tokens, decoded incrementally
        (at a cost per token that does not grow with the output); of a finished one, `decode`."""
        if req.is_finished:
            return self.decode(req)
        if req.detokenizer is None:
            req.detokenizer = self._text(req)
        return req.detokenizer.update(req.output_token_ids)

    def decode(self, req: Request) -> str:
        """Output text, as vLLM gives it: without the stop string or the EOS / stop token that ended the request
        (unless `include_stop_str_in_output`)."""
        ids, keep = req.output_token_ids, req.params.include_stop_str_in_output
        if not req.params.detokenize:
            return ""
        if req.finish_reason == "stop" and not isinstance(req.stop_text, str) and not keep:
            ids = ids[:-1]
        text = self._text(req).final(ids)
        if isinstance(req.stop_text, str) and req.finish_reason == "stop":
            at = text.find(req.stop_text, self._stop_search_start(req, req.stop_text))
            text = text[: at + len(req.stop_text) if keep else at]
        return text

    def reset_stats(self) -> None:
        self.stats = RunStats(num_kv_blocks=self.runner.num_blocks)
