from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from flock.sampling_params import SamplingParams


TASKS = ("embed", "classify", "token_embed", "token_classify")  # the token tasks: a vector per prompt token


@dataclass(frozen=True)
class ModelTasks:
    """What a loaded model serves, to refuse other requests by name: generation (a causal LM), embeddings (a
    causal LM or a base model), or classification and cross-encoder scores (a sequence classifier, nothing
    else)."""

    name: str
    hidden_size: int
    generates: bool = True  # has an LM head (a base model has none)
    num_labels: int = 0  # a sequence classifier's classes
    labels: tuple[str, ...] = ()
    use_sep_token: bool = True  # see ModelConfig.use_sep_token
    score_template: str | None = None  # a cross-encoder's pair prompt (cross_encoder_prompt), given as --chat-template
    encoder: bool = False  # a bidirectional encoder: every prompt row's final state is there to read (token tasks)
    token_classifier: bool = False  # classifies each token (*ForTokenClassification), nothing else
    normalize: bool = True  # its embeddings' default (ModelConfig.embedding_normalize)
    matryoshka: bool | tuple[int, ...] = False  # the `dimensions` it takes (ModelConfig.matryoshka)

    @property
    def encodes_pairs(self) -> bool:
        """A cross-encoder's pair is the tokenizer's pair encoding (not a template's or a joined text's)."""
        return self.score_template is None and self.use_sep_token

    def refusal(self, task: str) -> str | None:
        """Why the model does not serve `task` ("generate" or one of TASKS), or None."""
        if self.token_classifier:
            return None if task == "token_classify" else (
                f"{self.name} is a token classifier: it classifies each token (LLM.encode with pooling_task "
                "token_classify, /pooling with task token_classify) and nothing else")
        if task == "token_classify":
            return f"{self.name} is not a token classifier (its architectures name no ForTokenClassification)"
        if task == "token_embed":
            return None if self.encoder and not self.num_labels else (
                f"{self.name} gives no token embeddings: they are a bidirectional encoder's embedding model's (a "
                "decoder pools its prompt's last token; its earlier rows are not kept)")
        if self.num_labels:
            return None if task == "classify" else (
                f"{self.name} is a sequence classifier: it classifies (LLM.classify, /classify) and scores pairs "
                "(LLM.score, /score, /rerank), it does not " + ("generate" if task == "generate" else "embed"))
        if task == "classify":
            return (f"{self.name} is not a sequence classifier (its architectures name no ForSequenceClassification; "
                    "a causal LM reranker takes hf_overrides with classifier_from_token)")
        if task == "generate" and not self.generates:
            return f"{self.name} is a base model without an LM head: it embeds (LLM.embed, /v1/embeddings), " \
                   "it does not generate"
        return None


@dataclass
class PoolingParams:
    """How a pooling request turns its prompt into a vector, as vLLM's `PoolingParams` for a decoder model: from
    the final hidden state of the prompt's last token (it has seen the whole prompt, so a shared prefix's KV
    serves every prompt that starts with it). Task "embed" (Qwen3-Embedding, e5-mistral): its first `dimensions`
    values (a Matryoshka model's shorter embeddings), L2-normalized where `normalize` (None: `use_activation`,
    vLLM 0.32's name for it, else the model's default: a sentence-transformers folder normalizes when it lists a
    Normalize module). Task "classify" (a sequence classifier): the class probabilities, or the raw logits when
    `use_activation` is False. `pair`: the prompt is a cross-encoder's pair (BERT's token type 1 after its first
    separator; a single text's are all 0)."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None  # as SamplingParams': keep this many prompt tokens (-1: the limit)
    task: str = "embed"
    use_activation: bool | None = None
    truncation_side: str | None = None  # which end truncate_prompt_tokens keeps (None: the model's tokenizer's)
    priority: int = 0  # SamplingParams'
    cache_salt: str | None = None  # SamplingParams'
    pair: bool = False

    def validate(self, model: ModelTasks) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if why := model.refusal(self.task):
            raise ValueError(why)
        d = self.dimensions
        if d is not None and self.task not in ("embed", "token_embed"):  # a token embedding: each token's
            raise ValueError("dimensions is an embedding's, not a classification's")
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or not 1 <= d <= model.hidden_size):
            raise ValueError(f"dimensions must be an integer in [1, {model.hidden_size}] (the model's hidden size), "
                             f"got {d!r}")
        if d is not None and not model.matryoshka:
            raise ValueError(f"dimensions must be unset: {model.name} does not support Matryoshka embeddings (its "
                             "config has no is_matryoshka or matryoshka_dimensions; hf_overrides="
                             "{\"is_matryoshka\": true} if it was trained so)")
        if d is not None and isinstance(model.matryoshka, tuple) and d not in model.matryoshka:
            raise ValueError(f"dimensions must be one of {model.name}'s Matryoshka dimensions "
                             f"{list(model.matryoshka)}, not {d}")
        for name in ("normalize", "use_activation"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")

    def resolved(self, model: ModelTasks) -> "PoolingParams":
        """Its defaults made the model's: an embedding normalized as the model says, a classifier's activation
        on."""
        normalize = next((v for v in (self.normalize, self.use_activation) if v is not None), model.normalize)
        use_activation = True if self.use_activation is None else self.use_activation
        return replace(self, normalize=normalize, use_activation=use_activation if self.task.endswith("classify")
                       else normalize)

    def as_sampling(self, max_model_len: int, truncation_side: str = "right") -> SamplingParams:
        """The engine request that computes the prompt (and samples nothing: the runner pools its last row): a
        prompt cut as vLLM's pooling models cut it, from `truncation_side` (the tokenizer's) unless its own says,
        to max_model_len tokens for truncate_prompt_tokens -1 (nothing is generated after them)."""
        keep = max_model_len if self.truncate_prompt_tokens == -1 else self.truncate_prompt_tokens
        return SamplingParams(temperature=0.0, max_tokens=1, truncate_prompt_tokens=keep,
                              truncation_side=self.truncation_side or truncation_side, priority=self.priority,
                              cache_salt=self.cache_salt)

    def pool(self, hidden: torch.Tensor) -> list[float]:
        """The embedding of a pooled final hidden state (a token task's: of each row of them), in float32 (float64
        models: float64); normalized unless `resolved` said not."""
        x = hidden[..., : self.dimensions].to(torch.promote_types(hidden.dtype, torch.float32))
        return (x if self.normalize is False else F.normalize(x, dim=-1)).tolist()


def pair_scores(left: list[list[float]], right: list[list[float]]) -> list[float]:
    """vLLM's score of an embedding model (a bi-encoder): each pair's cosine similarity, in float64; one vector on
    the left is scored against every one on the right, else they pair up in order."""
    a, b = (F.normalize(torch.tensor(v, dtype=torch.float64), dim=1) for v in (left, right))
    return (b @ a[0] if len(a) == 1 else (a * b).sum(1)).tolist()


def cross_encoder_prompt(tokenizer, first: str, second: str, model: ModelTasks,
                         template_kwargs: dict | None = None, max_length: int | None = None) -> list[int]:
    """The token ids of a pair a sequence classifier scores, as vLLM builds them: with a score template (a chat
    template given explicitly, e.g. examples/qwen3_reranker.jinja) the pair as a "query" and a "document" turn
    through it (`template_kwargs` its variables); else the tokenizer's pair encoding (its separators between the
    texts; `max_length`: cut longest first, as vLLM's truncate_prompt_tokens cuts a pair), or, for a causal LM made
    a reranker (use_sep_token False), the two texts joined and encoded as one."""
    if model.score_template is not None:
        turns = [{"role": "query", "content": first}, {"role": "document", "content": second}]
        text = tokenizer.apply_chat_template(turns, chat_template=model.score_template, tokenize=False,
                                             **(template_kwargs or {}))
        return tokenizer(text)["input_ids"]
    if model.use_sep_token:
        cut = {"truncation": True, "max_length": max_length} if max_length and max_length > 0 else {}
        return tokenizer(first, text_pair=second, **cut)["input_ids"]
    return tokenizer(first + second)["input_ids"]
