import functools
from collections.abc import Sequence
from dataclasses import replace

import torch
from tqdm import tqdm

from flock.api.reasoning import THINKING_END, read_structured_outputs_config, thinking_open
from flock.chat_content import CONTENT_FORMATS
from flock.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from flock.config import EngineConfig
from flock.engine.detokenizer import TokenPieces
from flock.engine.engine import LLMEngine
from flock.engine.loop import run
from flock.label_scores import LabelQuery
from flock.lora import LoRARequest
from flock.multimodal import ImageInputs
from flock.multimodal.processor import IMAGES_REFUSED, ImagePrompts, has_images, image_prompts, split_images
from flock.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
    id_logprobs,
)
from flock.pooling_params import TASKS, PoolingParams, cross_encoder_prompt, pair_scores
from flock.request import Request
from flock.sample.logprobs import with_texts
from flock.sampling_params import SamplingParams
from flock.tokenizer import bos_prefix, chat_text, encode_chat, read_chat_template

Prompt = str | dict | list[int]


class LLM:
    """Offline generation, as in vLLM: `LLM(model, **config).generate(prompts, sampling_params)`."""

    def __init__(self, model: str = "flock/tiny", reasoning_parser: str | None = None,
                 structured_outputs_config: dict | None = None, **kwargs):
        """`reasoning_parser` (flock.api.reasoning.REASONING_PARSERS; or in vLLM's `structured_outputs_config`,
        whose `disable_any_whitespace` and `enable_in_reasoning` it also takes): a structured output's grammar
        applies once the prompt's open thinking has ended, unless enable_in_reasoning."""
        config = dict(structured_outputs_config or {})
        if reasoning_parser:
            config["reasoning_parser"] = reasoning_parser
        any_whitespace, self.reasoning_parser, self.grammar_in_reasoning = read_structured_outputs_config(config)
        if any_whitespace is not None:
            kwargs.setdefault("structured_outputs_any_whitespace", any_whitespace)
        self.config = EngineConfig.from_kwargs(model, **kwargs)
        self.engine = LLMEngine(self.config)

    def get_tokenizer(self):
        return self.engine.tokenizer

    @functools.cached_property
    def token_pieces(self) -> TokenPieces:
        """Each token's text for logprobs (vLLM's decoded_token)."""
        return TokenPieces(self.engine.tokenizer)

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine (vLLM's name for it)."""
        return self.engine

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: int | Sequence[int] | None = None,
        tokenization_kwargs: dict | None = None,
        mm_processor_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (its params' n samples, each a request sharing the prompt's KV blocks);
        outputs come back in input order. A dict prompt may carry vLLM's `cache_salt` (see SamplingParams) and,
        for a vision-language model, vLLM's `multi_modal_data` {"image": one or a list of PIL images, URLs or
        paths} beside a text `prompt` that marks each image with the model's image token; a `lora_request` (one
        for all prompts, or one each) runs them with a LoRA adapter (engine started with enable_lora=True);
        `priority` (one for all, or one each) sets their params' priority; `tokenization_kwargs` (vLLM's
        truncate_prompt_tokens and truncation_side) set their params' fields of those names, and its
        add_special_tokens=False encodes text prompts without the BOS (a prompt already rendered). All prompts and
        parameters are checked before any work starts: a bad one raises ValueError naming its index and field."""
        if mm_processor_kwargs:
            raise ValueError("mm_processor_kwargs is not supported (images are processed with the model's defaults)")
        if not isinstance(prompts, (str, dict, Sequence)):
            raise TypeError(f"prompts must be a string, a dict, a list of token ids or a list of those, not "
                            f"{type(prompts).__name__}")
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        kwargs = dict(tokenization_kwargs or {})
        add_special = kwargs.pop("add_special_tokens", True)
        sampling_params = self._tokenized(sampling_params, len(prompts), kwargs)
        return self._generate([self._encode(p, i, add_special) for i, p in enumerate(prompts)], prompts,
                              sampling_params, use_tqdm, lora_request, priority)

    def _tokenized(self, sampling_params, n: int, tokenization_kwargs: dict | None):
        """The params of n prompts with vLLM's tokenization_kwargs (truncate_prompt_tokens, truncation_side)."""
        check_tokenization_kwargs(tokenization_kwargs)
        if not tokenization_kwargs:
            return sampling_params
        return [replace(p, **tokenization_kwargs) for p in self._params_per_prompt(sampling_params, n)]

    def _generate(self, encoded: list[tuple], prompts: Sequence[Prompt], sampling_params, use_tqdm: bool,
                  lora_request, priority: int | Sequence[int] | None = None) -> list[RequestOutput]:
        """Run prompts encoded as (text, token ids, ImageInputs or None)."""
        params = [replace(p, cache_salt=prompt["cache_salt"]) if isinstance(prompt, dict) and "cache_salt" in prompt
                  else p for p, prompt in zip(self._params_per_prompt(sampling_params, len(prompts)), prompts)]
        for name, given, kind in (("lora_request", lora_request, LoRARequest), ("priority", priority, int)):
            if given is not None:
                values = [given] * len(prompts) if isinstance(given, kind) else list(given)
                if len(values) != len(prompts):
                    raise ValueError(f"got {len(values)} values of {name} for {len(prompts)} prompts")
                params = [replace(p, **{name: value}) for p, value in zip(params, values)]
        texts, token_ids, images = zip(*encoded) if encoded else ((), (), ())
        params = [p if im is None else replace(p, multi_modal=im) for p, im in zip(params, images)]
        params = [self._after_thinking(p, ids) for p, ids in zip(params, token_ids)]
        self._check_all(token_ids, params)
        self.engine.reset_stats()
        samples = [[self.engine.add_request(ids, s) for s in p.samples()] for ids, p in zip(token_ids, params)]
        self._run([req for reqs in samples for req in reqs], use_tqdm)
        return [self._output(reqs, text) for reqs, text in zip(samples, texts)]

    def _after_thinking(self, params: SamplingParams, prompt_ids: list[int]) -> SamplingParams:
        """Params whose grammar waits for the end of the thinking the prompt leaves open (with a reasoning parser,
        as vLLM's structured outputs)."""
        spec = params.structured_outputs
        if self.reasoning_parser is None or self.grammar_in_reasoning or spec is None or spec.after is not None \
                or not thinking_open(self.engine.tokenizer, prompt_ids):
            return params
        return replace(params, structured_outputs=replace(spec, after=THINKING_END))

    def _encode(self, prompt: Prompt, index: int, add_special: bool = True
                ) -> tuple[str | None, list[int], ImageInputs | None]:
        """A prompt's text, token ids and images (vLLM's multi_modal_data)."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if not data:
            return *self.encode_prompt(prompt, index, add_special), None
        try:
            if not isinstance(data, dict) or data.keys() != {"image"}:
                raise ValueError(f"multi_modal_data takes {{'image': images}} only, got {data!r:.80}")
            images = data["image"] if isinstance(data["image"], list) else [data["image"]]
            text, token_ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
            if isinstance(text, str):
                ids, inputs = self._image_prompts().encode(text, images)
            elif isinstance(token_ids, list) and token_ids and all(isinstance(t, int) for t in token_ids):
                ids, inputs = self._image_prompts().encode_ids(token_ids, images)
            else:
                raise ValueError("images need a text 'prompt' or 'prompt_token_ids' marking where each goes")
        except ValueError as e:
            raise ValueError(f"request {index}: {e}") from None
        return text, ids, inputs

    def _image_prompts(self) -> ImagePrompts:
        processor = image_prompts(str(self.engine.model_folder))
        if processor is None or self.engine.runner.vision is None:
            raise ValueError(IMAGES_REFUSED)
        return processor

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        tokenization_kwargs: dict | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """The embedding of every prompt (see PoolingParams: one for all, or one each), in input order, as vLLM's
        `LLM.embed`. A string is tokenized with the tokenizer's special tokens (an embedding model's end-of-text
        token included). `tokenization_kwargs` as generate's; `lora_request` is vLLM's, refused: adapters
        generate, embeddings come from the base model."""
        requests = self._pool(prompts, pooling_params, use_tqdm, lora_request, tokenization_kwargs)
        return [EmbeddingRequestOutput(str(r.request_id), r.prompt_token_ids, EmbeddingOutput(r.embedding),
                                       r.is_finished, r.num_cached_tokens) for r in requests]

    def classify(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        tokenization_kwargs: dict | None = None,
    ) -> list[ClassificationRequestOutput]:
        """A sequence classifier's class probabilities of every prompt, in input order, as vLLM's `LLM.classify`
        (logits when `pooling_params.use_activation` is False); the other arguments as `embed`'s."""
        requests = self._pool(prompts, pooling_params, use_tqdm, lora_request, tokenization_kwargs, task="classify")
        return [ClassificationRequestOutput(str(r.request_id), r.prompt_token_ids, ClassificationOutput(r.embedding),
                                            r.is_finished, r.num_cached_tokens) for r in requests]

    def encode(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        pooling_task: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        tokenization_kwargs: dict | None = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's `LLM.encode`: each prompt's vector for `pooling_task` "embed" (as `embed`) or "classify" (as
        `classify`), or an encoder's vector of each prompt token for "token_embed" (each normalized as an
        embedding) or "token_classify" (a token classifier's probabilities), as a tensor in `out.outputs.data`;
        the other arguments as `embed`'s."""
        if pooling_task not in TASKS:
            raise ValueError(f"pooling_task must be one of {', '.join(TASKS)}, got {pooling_task!r}")
        requests = self._pool(prompts, pooling_params, use_tqdm, lora_request, tokenization_kwargs, task=pooling_task)
        dtype = torch.promote_types(self.engine.runner.dtype, torch.float32)  # the vectors' own precision
        return [PoolingRequestOutput(str(r.request_id), PoolingOutput(torch.tensor(r.embedding, dtype=dtype)),
                                     r.prompt_token_ids, r.num_cached_tokens, r.is_finished) for r in requests]

    def _pool(self, prompts: Prompt | Sequence[Prompt], params: PoolingParams | Sequence[PoolingParams] | None,
              use_tqdm: bool, lora_request=None, tokenization_kwargs: dict | None = None, **fixed) -> list[Request]:
        """The finished pooling requests of `prompts` (text: tokenized with the tokenizer's special tokens unless
        tokenization_kwargs' add_special_tokens says not, an embedding model's end-of-text token included) with
        their params (one for all, or one each; tokenization_kwargs' truncation and `fixed`'s fields set in
        each)."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if lora_request is not None and any(r is not None for r in (
                [lora_request] if isinstance(lora_request, LoRARequest) else lora_request)):
            raise ValueError("lora_request: LoRA adapters generate; embeddings, classes and scores come from the "
                             "base model")
        each = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(each) != len(prompts):
            raise ValueError(f"got {len(each)} pooling_params for {len(prompts)} prompts")
        if not all(p is None or isinstance(p, PoolingParams) for p in each):
            raise TypeError("pooling_params must be PoolingParams (one for all prompts, or a list of one each)")
        kwargs = dict(tokenization_kwargs or {})
        add_special = kwargs.pop("add_special_tokens", True)
        check_tokenization_kwargs(kwargs)
        each = [replace(p or PoolingParams(), **kwargs, **fixed) for p in each]
        token_ids = [self.encode_prompt(p, i, add_special)[1] for i, p in enumerate(prompts)]
        self._check_all(token_ids, each)
        self.engine.reset_stats()
        requests = [self.engine.add_request(ids, p) for ids, p in zip(token_ids, each)]
        self._run(requests, use_tqdm)
        return requests

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search` (flock/beam_search.py): each prompt's best `params.beam_width` sequences, best
        first, in input order (each one's `text` the prompt's and its own, as vLLM's). The beams of
        `concurrency_limit` prompts at a time (None: all) go through the engine together, a token a step; a beam
        that fills max_model_len ends there. A dict prompt may carry `multi_modal_data`, as in `generate`; a
        `lora_request` is one for all prompts or one each."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params.validate(max_logprobs=self.engine.config.max_logprobs)
        _, token_ids, images = zip(*[self._encode(p, i) for i, p in enumerate(prompts)]) if prompts else ((), (), ())
        loras = [lora_request] * len(prompts) if lora_request is None or isinstance(lora_request, LoRARequest) \
            else list(lora_request)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} values of lora_request for {len(prompts)} prompts")
        per_prompt = [replace(params, multi_modal=im, lora_request=lora or params.lora_request).fitted(
            len(ids), self.engine.max_model_len) for ids, im, lora in zip(token_ids, images, loras)]
        self._check_all(token_ids, [replace(p.step_params(), max_tokens=p.max_tokens) for p in per_prompt])
        self.engine.reset_stats()
        searches = [BeamSearch(ids, p, sorted(self.engine.eos_token_ids)) for ids, p in zip(token_ids, per_prompt)]
        limit = concurrency_limit or len(searches) or 1
        for start in range(0, len(searches), limit):
            self._search(searches[start : start + limit], use_tqdm)
        outputs = []
        for search in searches:
            best = search.result()
            for beam in best:  # as vLLM's: the prompt's text and the beam's
                beam.text = self.engine.tokenizer.decode(beam.tokens, skip_special_tokens=params.skip_special_tokens)
            outputs.append(BeamSearchOutput(best))
        return outputs

    def _search(self, searches: list[BeamSearch], use_tqdm: bool) -> None:
        """Step these searches together until each is done."""
        bar = progress_bar(use_tqdm, total=max(s.params.max_tokens for s in searches), desc="beam search",
                           unit="token")
        while live := [s for s in searches if not s.done]:
            requests = [[self.engine.add_request(ids, p) for ids, p in s.requests()] for s in live]
            self._run([r for rs in requests for r in rs], use_tqdm=False)
            for search, rs in zip(live, requests):
                search.advance([r.logprobs[0] for r in rs])
            bar.update()
        bar.close()

    def score(
        self,
        data_1: Prompt | Sequence[Prompt],
        data_2: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        tokenization_kwargs: dict | None = None,
        chat_template: str | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's `LLM.score`: each pair's score; one prompt in `data_1` is scored against every one in `data_2`,
        else they pair up in order. A sequence classifier of one label (a cross-encoder, a reranker) scores each
        pair's joint prompt (`cross_encoder_prompt`, texts only; `chat_template`: vLLM's score template, as
        --chat-template gives it); an embedding model gives the cosine similarity of the two embeddings
        (`pair_scores`). The other arguments as `embed`'s."""
        left, right = ([d] if isinstance(d, (str, dict)) or (d and isinstance(d[0], int)) else list(d)
                       for d in (data_1, data_2))
        if not right or len(left) not in (1, len(right)):
            raise ValueError(f"data_1 must hold one prompt or as many as data_2 ({len(left)} vs {len(right)})")
        if self.engine.tasks.num_labels:
            return self._cross_encode(left * (len(right) if len(left) == 1 else 1), right, pooling_params, use_tqdm,
                                      lora_request, tokenization_kwargs, chat_template)
        if chat_template is not None:
            raise ValueError("chat_template is a cross-encoder's score template; an embedding model scores cosines")
        embedded = self.embed(left + right, pooling_params, use_tqdm, lora_request, tokenization_kwargs)
        vectors = [e.outputs.embedding for e in embedded]
        scores = pair_scores(vectors[: len(left)], vectors[len(left):])
        firsts = embedded[: len(left)] * (len(right) if len(left) == 1 else 1)
        return [ScoringRequestOutput(f"{a.request_id}_{b.request_id}", a.prompt_token_ids + b.prompt_token_ids,
                                     ScoringOutput(s)) for a, b, s in zip(firsts, embedded[len(left):], scores)]

    def generative_score(
        self,
        query: str | list[int],
        items: Sequence[str] | Sequence[list[int]],
        label_token_ids: list[int],
        apply_softmax: bool = False,
        item_first: bool = False,
        use_tqdm: bool = True,
    ) -> list[list[float]]:
        """SGLang's `Engine.score` (named apart from vLLM's `LLM.score`): for each item joined to the query
        (after it, or before it with `item_first`; texts joined as text), the probability of each label token as
        the next token, over the whole vocabulary or, with `apply_softmax`, over the labels alone. The items
        share the query as a prefix, so its KV is computed once (flock/label_scores.py)."""
        scoring = LabelQuery(query, items, label_token_ids, apply_softmax, item_first)
        scoring.validate(self.engine.vocab_size)
        prompts = [{"prompt_token_ids": ids} for ids in scoring.prompts(self.engine.tokenizer)]
        outputs = self.generate(prompts, scoring.params(), use_tqdm=use_tqdm)
        return [scoring.probabilities(out.outputs[0].logprobs[0].top) for out in outputs]

    def _cross_encode(self, left: list, right: list, pooling_params: PoolingParams | None, use_tqdm: bool,
                      lora_request, tokenization_kwargs: dict | None, chat_template: str | None
                      ) -> list[ScoringRequestOutput]:
        tasks = self.engine.tasks
        if chat_template is not None:
            tasks = replace(tasks, score_template=read_chat_template(chat_template))
        if tasks.num_labels != 1:
            raise ValueError(f"{tasks.name} classifies into {tasks.num_labels} classes: scores need a classifier "
                             "of one label (a cross-encoder)")
        if not all(isinstance(t, str) for t in left + right):
            raise ValueError("a cross-encoder scores pairs of texts (strings)")
        limit = (tokenization_kwargs or {}).get("truncate_prompt_tokens") or \
            (pooling_params.truncate_prompt_tokens if pooling_params is not None else None)
        prompts = [cross_encoder_prompt(self.engine.tokenizer, a, b, tasks, max_length=limit)
                   for a, b in zip(left, right)]
        requests = self._pool(prompts, pooling_params, use_tqdm, lora_request, tokenization_kwargs, task="classify",
                              pair=tasks.encodes_pairs)
        return [ScoringRequestOutput(str(r.request_id), r.prompt_token_ids, ScoringOutput(r.embedding[0]))
                for r in requests]

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: int | Sequence[int] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        tokenization_kwargs: dict | None = None,
        mm_processor_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate the assistant's next message for one conversation (a list of {"role", "content"} dicts) or
        for a list of them, through the tokenizer's chat template (or `chat_template`), as vLLM's `LLM.chat` (whose
        template options it takes: `tools` are shown to the template; their calls come back as text). Contents
        reach the template as one string or as a list of parts, as it reads them ("auto": see
        flock.chat_content), or as `chat_template_content_format` says. `tokenization_kwargs` as generate's
        (`add_special_tokens` True: the tokenizer's BOS before the rendered template, as vLLM adds it)."""
        if chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format must be one of {', '.join(CONTENT_FORMATS)}, got "
                             f"{chat_template_content_format!r}")
        if mm_processor_kwargs:
            raise ValueError("mm_processor_kwargs is not supported (images are processed with the model's defaults)")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        options = dict(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                       tools=tools, chat_template_kwargs=chat_template_kwargs, chat_template=chat_template,
                       content_format=chat_template_content_format)
        encoded = []
        for i, conversation in enumerate(conversations):
            try:
                encoded.append(self._encode_chat(conversation, options))
            except ValueError as e:
                raise ValueError(f"conversation {i}: {e}") from None
        kwargs = dict(tokenization_kwargs or {})
        if kwargs.pop("add_special_tokens", False):
            encoded = [(text, bos_prefix(self.engine.tokenizer) + ids, images) for text, ids, images in encoded]
        sampling_params = self._tokenized(sampling_params, len(encoded), kwargs)
        return self._generate(encoded, [{}] * len(encoded), sampling_params, use_tqdm, lora_request, priority)

    def _encode_chat(self, conversation: list[dict], options: dict) -> tuple[str, list[int], ImageInputs | None]:
        """A conversation's prompt text, token ids and images (its content parts of type image_url, image_pil or
        image)."""
        tokenizer = self.engine.tokenizer
        if not has_images(conversation):
            ids = encode_chat(tokenizer, conversation, **options)
            return tokenizer.decode(ids), ids, None
        messages, sources = [], []
        for m in conversation:
            if isinstance(m.get("content"), list):
                parts, found = split_images(m["content"])
                m, sources = m | {"content": parts}, sources + found
            messages.append(m)
        prompts = self._image_prompts()
        text = chat_text(tokenizer, messages, image_text=prompts.placeholder, **options)
        return text, *prompts.encode(text, sources, add_special_tokens=False)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix (see LLMEngine.reset_prefix_cache), as vLLM's `LLM.reset_prefix_cache`
        (between calls nothing runs, so `reset_running_requests` has nothing to reset)."""
        return self.engine.reset_prefix_cache()

    def stats(self) -> dict:
        """Statistics of the last `generate` call."""
        return self.engine.stats.as_dict()

    def _check_all(self, token_ids: Sequence[list[int]], params: list[SamplingParams | PoolingParams]) -> None:
        """Every request checked before any work starts: ValueError naming the first bad one's index and field."""
        for i, (ids, p) in enumerate(zip(token_ids, params)):
            try:
                self.engine.check_request(ids, p)
            except ValueError as e:
                raise ValueError(f"request {i}: {e}") from None

    def _run(self, requests: list[Request], use_tqdm: bool) -> None:
        engine = self.engine
        bar = progress_bar(use_tqdm, total=len(requests), desc="generate", unit="req")
        try:
            for step in run(engine):
                if step.finished:
                    bar.update(len(step.finished))
                    bar.set_postfix_str(f"{engine.stats.generated_tokens / engine.stats.elapsed:.0f} tok/s out")
        finally:
            bar.close()
            for req in requests:
                engine.abort(req)  # no-op for finished ones; leaves the engine clean after an exception

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` sample with when given no params: the model's generation_config.json fields
        over SamplingParams' defaults, as vLLM's (see EngineConfig.generation_config)."""
        return SamplingParams(**self.engine.sampling_defaults)

    def _params_per_prompt(self, sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if len(sampling_params) != n:
            raise ValueError(f"got {len(sampling_params)} sampling params for {n} prompts")
        return list(sampling_params)

    def encode_prompt(self, prompt: Prompt, index: int, add_special: bool = True) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.engine.tokenizer.encode(prompt, add_special_tokens=add_special)
        if isinstance(prompt, dict):
            if prompt.get("multi_modal_data"):
                raise ValueError(f"request {index}: images (multi_modal_data) are taken by generate and chat only")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.encode_prompt(prompt["prompt"], index, add_special)
            raise ValueError(f"request {index}: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, list):
            return None, list(prompt)
        raise ValueError(f"request {index}: prompt must be a string, a token-id list or a dict, not {type(prompt).__name__}")

    def _output(self, samples: list[Request], prompt: str | None) -> RequestOutput:
        if samples[0].params.detokenize:
            for entries in [*(req.logprobs for req in samples), samples[0].prompt_logprobs]:
                with_texts(entries or [], self.token_pieces)
        completions = [CompletionOutput(
            index=j,
            text=self.engine.decode(req),
            token_ids=req.output_token_ids,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_text,
            logprobs=req.logprobs,
            cumulative_logprob=None if req.logprobs is None else sum(e.logprob for e in req.logprobs),
            lora_request=req.params.lora_request,
        ) for j, req in enumerate(samples)]
        first = samples[0]
        return RequestOutput(
            request_id=str(first.request_id),
            prompt=prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=completions,
            finished=all(req.is_finished for req in samples),
            num_cached_tokens=first.num_cached_tokens,
            prompt_logprobs=first.prompt_logprobs if first.params.prompt_logprobs is not None else None,
            prompt_token_id_logprobs=None if first.prompt_ids is None else
            id_logprobs(first.prompt_logprobs, first.params.prompt_logprob_start or 0),
            lora_request=first.params.lora_request,
        )


def check_tokenization_kwargs(kwargs: dict | None) -> None:
    """vLLM's tokenization_kwargs, add_special_tokens taken out: truncate_prompt_tokens and truncation_side."""
    unknown = sorted((kwargs or {}).keys() - {"truncate_prompt_tokens", "truncation_side"})
    if unknown:
        raise ValueError(f"tokenization_kwargs takes add_special_tokens, truncate_prompt_tokens and truncation_side, "
                         f"got {unknown}")


def progress_bar(use_tqdm, **kw) -> tqdm:
    """vLLM's use_tqdm: True (a bar), False (none), or a callable making the bar (functools.partial(tqdm, ...))."""
    if callable(use_tqdm):
        return use_tqdm(**kw)
    return tqdm(**kw, disable=None if use_tqdm else True)
