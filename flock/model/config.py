from dataclasses import dataclass, field
import json
from pathlib import Path

GEMMA_TYPES = ("gemma", "gemma2", "gemma3_text")
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
# bidirectional encoders (BERT's family) that embed and classify; a position's id is its index plus the offset
ENCODER_POSITION_OFFSETS = {"bert": None, "roberta": "pad", "xlm-roberta": "pad"}  # "pad": pad_token_id + 1
ENCODER_TYPES = (*ENCODER_POSITION_OFFSETS, "modernbert")
MODERNBERT_THETAS = {"full_attention": 160_000.0, "sliding_attention": 10_000.0}  # ModernBertConfig's defaults
ENCODER_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
# sentence-transformers' pooling modes (a folder's 1_Pooling/config.json) -> the row an embedding pools
POOLING_MODES = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_lasttoken": "LAST"}
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "granite", "smollm3", *GEMMA_TYPES,
                         *MOE_TYPES)
# transformers' ACT2FN names of the two activations Flock runs in its gated MLPs
SILU_NAMES = ("silu", "swish")
GELU_TANH_NAMES = ("gelu_pytorch_tanh", "gelu_new")
# transformers' class defaults for keys a config.json may omit
DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768, "phi3": 4096,
                         "granite": 2048, "gemma": 8192, "gemma2": 8192, "gemma3_text": 131072, "mixtral": 131072,
                         "qwen2_moe": 32768, "qwen3_moe": 32768, "smollm3": 32768}
MISTRAL_DEFAULT_WINDOW = 4096
GEMMA_DEFAULT_WINDOW = 4096
QWEN_DEFAULT_WINDOW = 4096  # Qwen2Config / Qwen3Config (and their MoE) sliding_window
GEMMA3_WINDOW_PATTERN = 6  # every 6th layer global, the others sliding (Gemma 3's default)
GEMMA3_THETAS = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
# Gemma3TextConfig's defaults, which the sparse text_config of Gemma 3's multimodal checkpoints leans on
GEMMA3_TEXT_DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256}
# vision-language checkpoints whose text decoder Flock runs -> the text decoder's model type when text_config omits
# it; images go through transformers' vision tower and projector (flock/multimodal)
VISION_LANGUAGE_TYPES = {"llava": "llama", "idefics3": "llama", "smolvlm": "llama", "gemma3": "gemma3_text",
                         "qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3"}
# text decoders of vision-language checkpoints that are a supported type under another name
TEXT_DECODER_TYPES = {"qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2", "qwen3_vl_text": "qwen3"}
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "longrope", "yarn")  # flock/model/rope.py
QWEN3_VL_MROPE = (24, 20, 20)  # Qwen3VLTextConfig's sections where its rope_parameters name none
BIDIRECTIONAL_IMAGES = ("gemma3",)  # whose image tokens attend to all of their image's, before and after them
# a sequence classifier's activation (see ModelConfig.num_labels), as vLLM chooses it from transformers'
# problem_type, or from a cross-encoder's sentence-transformers activation (torch.nn modules)
PROBLEM_ACTIVATIONS = {"regression": "identity", "single_label_classification": "softmax",
                       "multi_label_classification": "sigmoid"}
MODULE_ACTIVATIONS = {"Identity": "identity", "Sigmoid": "sigmoid", "Softmax": "softmax"}
CLASSIFIER_METHODS = ("from_2_way_softmax", "no_post_processing")
# the generation_config.json fields vLLM turns into requests' default sampling (max_new_tokens as max_tokens)
SAMPLING_FIELDS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k", "top_p",
                   "min_p", "max_new_tokens")


@dataclass
class ModelConfig:
    """The architecture facts Flock needs, read from a Hugging Face `config.json`."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    partial_rotary_factor: float = 1.0  # the share of each head the rotary embedding turns (Phi-4-mini's 0.75)
    rope_layers: tuple[bool, ...] | None = None  # the layers that rotate q and k (None: all); SmolLM3's NoPE layers
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    qk_norm: bool = False  # Qwen3, Gemma 3: an RMSNorm over each head of q and k before the rotary embedding
    base_model: bool = False  # the decoder without an LM head (architectures "Qwen3Model", ...): embeddings only
    # a sequence classifier (architectures "*ForSequenceClassification"): its last token's final hidden state
    # times a `score` matrix gives num_labels logits, turned into probabilities by classifier_activation
    # ("softmax", "sigmoid" or "identity"); classifier_tokens: a causal LM made one (vLLM's hf_overrides
    # classifier_from_token), its score rows taken from the LM head's rows of these tokens, by classifier_method
    # "from_2_way_softmax" (one row: the second token's minus the first's) or "no_post_processing" (the rows)
    num_labels: int = 0
    labels: tuple[str, ...] = ()
    classifier_activation: str = "softmax"
    classifier_tokens: tuple[str, ...] = ()
    classifier_method: str | None = None
    use_sep_token: bool = True  # a cross-encoder's pair as the tokenizer encodes pairs (False: the texts joined)
    multimodal: bool = False  # a vision-language checkpoint whose text decoder runs (VISION_LANGUAGE_TYPES)
    image_token_id: int | None = None  # its image placeholder token, whose rows take the vision tower's features
    # Qwen2-VL's M-RoPE: how many rotary frequencies (of head_dim / 2) turn by a token's time, height and width
    # positions, in that order (a text token's three are equal: plain RoPE); interleaved (Qwen3-VL's): the
    # frequencies take the three in turn (t h w t h w ...) until height's and width's counts run out
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False
    bidirectional_images: bool = False  # Gemma 3's: an image's tokens attend to each other both ways
    # Granite's scales: of the embeddings, of each layer's attention and MLP outputs before the residual add, the
    # logits' divisor, and q k^T's (None: head_dim ** -0.5)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    attention_scale: float | None = None
    hidden_act: str = "silu"  # or "gelu_pytorch_tanh" (Gemma's GeGLU)
    # Gemma's: RMSNorm weights as offsets from 1 and its product in float32; with sandwich_norms (Gemma 2, 3) a
    # norm after attention and after the MLP too; the scores and logits capped by tanh (Gemma 2)
    gemma_norms: bool = False
    sandwich_norms: bool = False
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # a mixture of experts in place of the MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): the top num_experts_per_tok of
    # num_experts by the router's softmax (renormalized with norm_topk_prob), each an MLP moe_intermediate_size
    # wide; Qwen2-MoE's shared expert beside them, gated by a sigmoid; moe_layers: the layers that have one
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[bool, ...] = ()
    sliding_window: int | None = None
    # the layers the window applies to (None: all); Gemma 3's rotate by their own base, unscaled
    sliding_layers: tuple[bool, ...] | None = None
    local_rope_theta: float | None = None
    torch_dtype: str | None = None
    quantization: dict | None = None  # quantization_config: the checkpoint's packed integer weights (hf_quant)
    eos_token_id: list[int] = field(default_factory=list)
    # a bidirectional encoder (ENCODER_TYPES): each prompt attends both ways, computed whole in one
    # step and never cached; its token types (BERT's pairs: 1 after the first separator) and learned positions
    # (from position_offset); `embedding_pooling` the rows an embedding takes: CLS (the first), MEAN or LAST
    encoder: bool = False
    type_vocab_size: int = 0
    position_offset: int = 0
    embedding_pooling: str = "LAST"
    classifier_pooling: str = "CLS"  # the row a classifier reads (ModernBERT's may be MEAN)
    token_classifier: bool = False  # an encoder's *ForTokenClassification: num_labels logits of every token
    # ModernBERT's: biases of its norms, MLP and classifier head, and the head's activation
    norm_bias: bool = True
    mlp_bias: bool = False
    classifier_bias: bool = True
    head_act: str = "gelu"
    max_seq_length: int | None = None  # a sentence-transformers folder's limit, below the positions' (vLLM's too)
    # embeddings: L2-normalized by default (a sentence-transformers folder: when it lists a Normalize module);
    # Matryoshka (config's is_matryoshka: any `dimensions`; matryoshka_dimensions: those only; else none)
    embedding_normalize: bool = True
    matryoshka: bool | tuple[int, ...] = False

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of one layer (None: it attends to the whole context)."""
        return self.sliding_window if self.sliding_layers is None or self.sliding_layers[layer] else None

    @property
    def context_length(self) -> int:
        """The longest sequence the model takes (the default max_model_len): a sentence-transformers folder's
        limit, else its positions; linear and dynamic NTK RoPE's times its factor (as vLLM: positions are divided
        by it, frequencies stretched; Gemma 3's are already scaled); YaRN's the original ones times its factor (the
        length it was extended to; vLLM 0.32 takes max_position_embeddings there)."""
        if self.max_seq_length:
            return self.max_seq_length
        s = self.rope_scaling
        if s is not None and s["rope_type"] == "yarn":
            return int(s["original_max_position_embeddings"] * s["factor"])
        if s is not None and s["rope_type"] in ("linear", "dynamic") and not self.model_type.startswith("gemma3"):
            return int(self.max_position_embeddings * s["factor"])
        return self.max_position_embeddings

    @property
    def default_max_model_len(self) -> int:
        """max_model_len when none is given, as vLLM defaults it: the context length, but LongRoPE's original
        length, whose short factors shorter sequences want (flock.model.rope picks the factors by max_model_len)."""
        s = self.rope_scaling
        if s is not None and s["rope_type"] == "longrope":
            return min(s["original_max_position_embeddings"], self.context_length)
        return self.context_length

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head the rotary embedding turns, as transformers rounds them."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def layer_windows(self) -> list[int | None]:
        return [self.layer_window(i) for i in range(self.num_hidden_layers)]

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        config = cls._from_dict(d)
        dims = d.get("matryoshka_dimensions")
        config.matryoshka = tuple(dims) if dims else bool(d.get("is_matryoshka"))
        return config

    @classmethod
    def _from_dict(cls, d: dict) -> "ModelConfig":
        # Qwen2-VL's checkpoints write the text decoder's fields at the top, beside vision_config
        outer_type = d.get("model_type")
        multimodal = outer_type in VISION_LANGUAGE_TYPES and ("text_config" in d or "vision_config" in d)
        quantization = d.get("quantization_config") or d.get("compression_config")
        image_token_id = d.get("image_token_id", d.get("image_token_index")) if multimodal else None
        if multimodal:
            d = cls._text_config(d)
        model_type = d.get("model_type", "llama")
        if model_type in ENCODER_TYPES:
            return cls._encoder(d, model_type)
        if model_type == "gemma3_text":
            d = GEMMA3_TEXT_DEFAULTS | d
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported (supported: "
                             f"{(*SUPPORTED_MODEL_TYPES, *ENCODER_TYPES)})")
        if d.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention=true (EmbeddingGemma's) is not supported: Flock's "
                             "attention is causal")
        heads = d["num_attention_heads"]
        rope = dict(d.get("rope_parameters") or {})
        local_theta = None
        if model_type == "gemma3_text":  # rope per layer kind: the global layers' (maybe scaled), the local ones'
            rope, local_theta = cls._gemma3_ropes(rope, d)
        scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        mrope = ({**rope, **(scaling or {})}.get("mrope_section")
                 or (QWEN3_VL_MROPE if multimodal and outer_type == "qwen3_vl" else None))
        if scaling is not None:
            scaling = cls._rope_scaling(dict(scaling), d, model_type)
        partial = d.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0
        eos = d.get("eos_token_id")
        act = cls._activation(d, model_type)
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported (Flock's MLP projections have no bias)")
        window, sliding_layers = cls._sliding_window(d, model_type)
        architecture = (d.get("architectures") or ["ForCausalLM"])[0]
        if architecture.endswith("ForTokenClassification"):
            raise ValueError(f"{architecture}: token classification runs on encoders (BERT, RoBERTa, XLM-RoBERTa, "
                             "ModernBERT), not on a decoder")
        base_model = architecture.endswith("Model") and not architecture.endswith("ForCausalLM")
        classifier = cls._classifier(d, architecture)
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=d.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling=scaling if scaling and scaling["rope_type"] != "default" else None,
            partial_rotary_factor=partial,
            rope_layers=cls._rope_layers(d, model_type),
            max_position_embeddings=d.get("max_position_embeddings", DEFAULT_MAX_POSITIONS[model_type]),
            # a head-less model's unused head; Gemma ties unless told not to
            tie_word_embeddings=d.get("tie_word_embeddings", model_type in GEMMA_TYPES) or base_model
            or bool(classifier.get("num_labels") and not classifier.get("classifier_tokens")),
            # Qwen2 (and its MoE): qkv bias always
            attention_bias=model_type in ("qwen2", "qwen2_moe") or d.get("attention_bias", False),
            o_proj_bias=model_type not in ("qwen2", "qwen2_moe") and d.get("attention_bias", False),
            qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe"),
            base_model=base_model,
            multimodal=multimodal,
            image_token_id=image_token_id,
            mrope_section=tuple(mrope) if mrope else None,
            mrope_interleaved=bool(mrope) and outer_type == "qwen3_vl",
            bidirectional_images=multimodal and outer_type in BIDIRECTIONAL_IMAGES,
            **classifier,
            **cls._granite_scales(d, model_type),
            **cls._gemma_fields(d, model_type),
            **cls._moe_fields(d, model_type),
            hidden_act=act,
            sliding_window=window,
            sliding_layers=sliding_layers,
            local_rope_theta=local_theta,
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            quantization=quantization,
            eos_token_id=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        )

    @classmethod
    def _encoder(cls, d: dict, model_type: str) -> "ModelConfig":
        """A BERT, RoBERTa, XLM-RoBERTa or ModernBERT encoder as transformers builds it: an embedding model, a
        sequence classifier (a cross-encoder) with its head, or a token classifier."""
        if d.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type {d['position_embedding_type']!r} is not supported (Flock's "
                             f"encoders learn absolute positions)")
        acts = {d.get("hidden_act", d.get("hidden_activation", "gelu")), d.get("classifier_activation", "gelu")}
        if acts - set(ENCODER_ACTIVATIONS):
            raise ValueError(f"activation {sorted(acts - set(ENCODER_ACTIVATIONS))[0]!r} is not supported (supported: "
                             f"{', '.join(ENCODER_ACTIVATIONS)})")
        heads = d["num_attention_heads"]
        architecture = (d.get("architectures") or ["Model"])[0]
        fields = cls._modernbert_fields(d) if model_type == "modernbert" else cls._bert_fields(d, model_type)
        return cls(
            model_type=model_type, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=heads, head_dim=d["hidden_size"] // heads,
            base_model=True, tie_word_embeddings=True,
            hidden_act=ENCODER_ACTIVATIONS[d.get("hidden_act", d.get("hidden_activation", "gelu"))],
            torch_dtype=d.get("torch_dtype") or d.get("dtype"), encoder=True, embedding_pooling="CLS",
            **fields, **cls._classifier(d, architecture))

    @staticmethod
    def _bert_fields(d: dict, model_type: str) -> dict:
        """BERT's and RoBERTa's learned absolute positions (RoBERTa's past its padding id) and token types."""
        offset = d.get("pad_token_id", 1) + 1 if ENCODER_POSITION_OFFSETS[model_type] == "pad" else 0
        return {"rms_norm_eps": d.get("layer_norm_eps", 1e-12), "position_offset": offset,
                "max_position_embeddings": d["max_position_embeddings"] - offset,
                "type_vocab_size": d.get("type_vocab_size", 2)}

    @staticmethod
    def _modernbert_fields(d: dict) -> dict:
        """ModernBERT's: rotary positions, a base for its global layers and one for its local ones, which see
        local_attention / 2 positions on either side (the kernels' window: one more), with ModernBertConfig's
        defaults."""
        every = d.get("global_attn_every_n_layers", 3)
        types = d.get("layer_types") or ["sliding_attention" if i % every else "full_attention"
                                         for i in range(d["num_hidden_layers"])]
        rope = d.get("rope_parameters") or {}
        theta = {kind: (rope.get(kind) or {}).get("rope_theta", d.get(key, MODERNBERT_THETAS[kind]))
                 for kind, key in (("full_attention", "global_rope_theta"), ("sliding_attention", "local_rope_theta"))}
        pooling = d.get("classifier_pooling", "cls")
        if pooling not in ("cls", "mean"):
            raise ValueError(f"classifier_pooling {pooling!r} is not supported (cls, mean)")
        return {"rms_norm_eps": d.get("norm_eps", 1e-5),
                "max_position_embeddings": d.get("max_position_embeddings", 8192),
                "rope_theta": theta["full_attention"], "local_rope_theta": theta["sliding_attention"],
                "sliding_window": d.get("local_attention", 128) // 2 + 1,
                "sliding_layers": tuple(t == "sliding_attention" for t in types),
                "attention_bias": d.get("attention_bias", False), "norm_bias": d.get("norm_bias", False),
                "mlp_bias": d.get("mlp_bias", False), "classifier_bias": d.get("classifier_bias", False),
                "classifier_pooling": pooling.upper(),
                "head_act": ENCODER_ACTIVATIONS[d.get("classifier_activation", "gelu")]}

    @staticmethod
    def _granite_scales(d: dict, model_type: str) -> dict:
        """Granite's multipliers, with transformers' GraniteConfig defaults (1.0 each, q k^T's too)."""
        if model_type != "granite":
            return {}
        return {"embedding_multiplier": d.get("embedding_multiplier", 1.0),
                "residual_multiplier": d.get("residual_multiplier", 1.0),
                "logits_scaling": d.get("logits_scaling", 1.0),
                "attention_scale": d.get("attention_multiplier", 1.0)}

    @staticmethod
    def _classifier(d: dict, architecture: str) -> dict:
        """A sequence (or an encoder's token) classifier's fields, as vLLM reads them (none for other
        architectures): the labels from id2label (else num_labels, transformers' default 2), the activation from
        problem_type or the sentence-transformers activation, else sigmoid for one label and softmax for more."""
        token = architecture.endswith("ForTokenClassification")
        if not architecture.endswith("ForSequenceClassification") and not token:
            return {}
        tokens = tuple(d.get("classifier_from_token") or ())
        method = d.get("method") or ("from_2_way_softmax" if d.get("is_original_qwen3_reranker") else None)
        if tokens and method not in CLASSIFIER_METHODS:
            raise ValueError(f"classifier_from_token needs method {' or '.join(CLASSIFIER_METHODS)} (or "
                             f"is_original_qwen3_reranker), got {method!r}")
        if method == "from_2_way_softmax" and len(tokens) != 2:
            raise ValueError(f"method from_2_way_softmax takes two classifier_from_token, got {list(tokens)}")
        id2label = {int(k): v for k, v in (d.get("id2label") or {}).items()}
        if tokens:
            num_labels = 1 if method == "from_2_way_softmax" else len(tokens)
        else:
            num_labels = len(id2label) or d.get("num_labels", 2)
        labels = tuple(id2label.get(i, f"LABEL_{i}") for i in range(num_labels))
        return {"num_labels": num_labels, "labels": labels, "classifier_tokens": tokens, "token_classifier": token,
                "classifier_method": method if tokens else None,
                "classifier_activation": ModelConfig._classifier_activation(d, num_labels),
                "use_sep_token": d.get("use_sep_token", not tokens)}

    @staticmethod
    def _classifier_activation(d: dict, num_labels: int) -> str:
        problem = d.get("problem_type")
        if problem in PROBLEM_ACTIVATIONS:
            return PROBLEM_ACTIVATIONS[problem] if problem != "single_label_classification" or num_labels > 1 \
                else "sigmoid"
        function = (d.get("sentence_transformers") or {}).get("activation_fn") \
            or d.get("sbert_ce_default_activation_function")
        if function is not None:
            name = function.rsplit(".", 1)[-1]
            if name not in MODULE_ACTIVATIONS:
                raise ValueError(f"classifier activation {function!r} is not supported (Flock runs "
                                 f"{', '.join(MODULE_ACTIVATIONS)})")
            return MODULE_ACTIVATIONS[name] if name != "Softmax" or num_labels > 1 else "sigmoid"
        return "sigmoid" if num_labels < 2 else "softmax"

    @staticmethod
    def _rope_layers(d: dict, model_type: str) -> tuple[bool, ...] | None:
        """SmolLM3's: `no_rope_layers` (1: the layer rotates), else every `no_rope_layer_interval`-th layer (4th)
        without a rotary embedding, as transformers reads it."""
        if model_type != "smollm3":
            return None
        every = d.get("no_rope_layer_interval", 4)
        flags = d.get("no_rope_layers") or [(i + 1) % every != 0 for i in range(d["num_hidden_layers"])]
        return tuple(bool(f) for f in flags)

    @staticmethod
    def _text_config(d: dict) -> dict:
        """A vision-language checkpoint's text decoder as a causal LM config; the stop ids and dtype are the outer
        config's where the text one lacks them."""
        text = d.get("text_config") or {k: v for k, v in d.items() if k not in ("vision_config", "model_type")}
        model_type = text.get("model_type") or VISION_LANGUAGE_TYPES[d["model_type"]]
        text = {**text, "model_type": TEXT_DECODER_TYPES.get(model_type, model_type), "architectures": ["ForCausalLM"]}
        for key in ("eos_token_id", "torch_dtype", "dtype", "tie_word_embeddings"):
            if text.get(key) is None and d.get(key) is not None:
                text[key] = d[key]
        return text

    @staticmethod
    def _activation(d: dict, model_type: str) -> str:
        """"silu" or "gelu_pytorch_tanh"; Gemma's `hidden_activation` first, its legacy "gelu" the tanh one, as
        transformers and vLLM read it."""
        act = d.get("hidden_activation") or d.get("hidden_act") or ("gelu_pytorch_tanh" if model_type in GEMMA_TYPES
                                                                     else "silu")
        if model_type in GEMMA_TYPES and act == "gelu":
            act = "gelu_pytorch_tanh"
        if act in SILU_NAMES:
            return "silu"
        if act in GELU_TANH_NAMES:
            return "gelu_pytorch_tanh"
        raise ValueError(f"hidden_act {act!r} is not supported (Flock runs {', '.join(SILU_NAMES + GELU_TANH_NAMES)})")

    @staticmethod
    def _moe_fields(d: dict, model_type: str) -> dict:
        """The experts, as transformers reads them: Mixtral's num_local_experts on every layer, renormalized, each
        intermediate_size wide; Qwen's num_experts on the layers decoder_sparse_step and mlp_only_layers leave."""
        if model_type not in MOE_TYPES:
            return {}
        fields = ModelConfig._moe_layout(d, model_type)
        if fields["num_experts"] and not 0 < fields["num_experts_per_tok"] <= fields["num_experts"]:
            raise ValueError(f"num_experts_per_tok {fields['num_experts_per_tok']} of {fields['num_experts']} experts: "
                             "a mixture chooses between 1 and all of them")
        return fields

    @staticmethod
    def _moe_layout(d: dict, model_type: str) -> dict:
        layers = d["num_hidden_layers"]
        if model_type == "mixtral":
            return {"num_experts": d.get("num_local_experts", 8),
                    "num_experts_per_tok": d.get("num_experts_per_tok", 2),
                    "moe_intermediate_size": d["intermediate_size"], "norm_topk_prob": True,
                    "moe_layers": (True,) * layers}
        qwen2 = model_type == "qwen2_moe"  # Qwen2MoeConfig's defaults, else Qwen3MoeConfig's
        experts = d.get("num_experts", d.get("num_local_experts", 60 if qwen2 else 128))  # transformers 5's name
        step, dense = d.get("decoder_sparse_step", 1), d.get("mlp_only_layers") or []
        return {"num_experts": experts, "num_experts_per_tok": d.get("num_experts_per_tok", 4 if qwen2 else 8),
                "moe_intermediate_size": d.get("moe_intermediate_size", 1408 if qwen2 else 768),
                "norm_topk_prob": d.get("norm_topk_prob", False),
                "shared_expert_intermediate_size": d.get("shared_expert_intermediate_size", 5632) if qwen2 else 0,
                "moe_layers": tuple(experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(layers))}

    @staticmethod
    def _gemma_fields(d: dict, model_type: str) -> dict:
        """Gemma's norms and scales, with transformers' class defaults: embeddings times sqrt(hidden_size); Gemma
        2's caps at 50 (scores) and 30 (logits); Gemma 2's and 3's q k^T scaled by query_pre_attn_scalar ** -0.5
        (256)."""
        if model_type not in GEMMA_TYPES:
            return {}
        common = {"gemma_norms": True, "embedding_multiplier": d["hidden_size"] ** 0.5}
        if model_type == "gemma":
            return common
        caps = (50.0, 30.0) if model_type == "gemma2" else (None, None)
        return {**common, "sandwich_norms": True,
                "attention_scale": d.get("query_pre_attn_scalar", 256) ** -0.5,
                "attn_logit_softcapping": d.get("attn_logit_softcapping", caps[0]),
                "final_logit_softcapping": d.get("final_logit_softcapping", caps[1])}

    @staticmethod
    def _gemma3_ropes(rope: dict, d: dict) -> tuple[dict, float]:
        """Gemma 3's global rope (rope_theta, rope_scaling) and its local layers' base, from either form of
        config: rope_parameters per layer kind (transformers 5) or rope_theta, rope_local_base_freq and
        rope_scaling (older files)."""
        if "full_attention" in rope or "sliding_attention" in rope:
            full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
            return ({**full, "rope_theta": full.get("rope_theta", GEMMA3_THETAS["full_attention"])},
                    local.get("rope_theta", GEMMA3_THETAS["sliding_attention"]))
        if "rope_theta" not in d and "rope_theta" not in rope:
            rope["rope_theta"] = GEMMA3_THETAS["full_attention"]
        return rope, d.get("rope_local_base_freq", GEMMA3_THETAS["sliding_attention"])

    @staticmethod
    def _rope_scaling(scaling: dict, d: dict, model_type: str) -> dict:
        """rope_scaling with its rope_type named (ValueError for one Flock does not run); LongRoPE's (Phi-3's "su"
        too), YaRN's and Llama 3's with the lengths they need (the original one: max_position_embeddings unless
        named, as transformers fills it in)."""
        scaling.setdefault("rope_type", scaling.get("type", "default"))
        if scaling["rope_type"] == "su":
            scaling["rope_type"] = "longrope"
        if scaling["rope_type"] == "mrope":  # Qwen2-VL's older name for its default rope (see mrope_section)
            scaling["rope_type"] = "default"
        if scaling["rope_type"] not in ROPE_TYPES:
            raise ValueError(f"rope scaling {scaling['rope_type']!r} is not supported (supported: "
                             f"{', '.join(ROPE_TYPES[1:])})")
        if scaling["rope_type"] in ("longrope", "yarn", "llama3"):
            positions = d.get("max_position_embeddings", DEFAULT_MAX_POSITIONS[model_type])
            original = (scaling.get("original_max_position_embeddings") or d.get("original_max_position_embeddings")
                        or positions)
            scaling |= {"original_max_position_embeddings": original,
                        "factor": scaling.get("factor") or positions / original}
        if scaling["rope_type"] == "dynamic" and "alpha" in scaling:
            raise ValueError("rope scaling 'dynamic' with 'alpha' (Hunyuan's NTK alpha) is not supported; with "
                             "'factor' it is")
        return scaling

    @staticmethod
    def _sliding_window(d: dict, model_type: str) -> tuple[int | None, tuple[bool, ...] | None]:
        """The window and the layers it applies to (None: all), as transformers reads them: Mistral's on every
        layer (4096 when the key is absent), Phi-3's on every layer when set; Gemma 2's on every other layer from
        the first, Gemma 3's on five layers of six, unless `layer_types` says otherwise; Qwen2's and Qwen3's only
        on the layers `layer_types` marks (from `max_window_layers`, default 28; the window 4096 unless set)."""
        if model_type == "mistral":
            return d.get("sliding_window", MISTRAL_DEFAULT_WINDOW), None
        if model_type in ("phi3", "mixtral"):  # on every layer when set, as Mistral's
            return d.get("sliding_window"), None
        layers = d["num_hidden_layers"]
        if model_type in ("gemma2", "gemma3_text"):
            every = 2 if model_type == "gemma2" else d.get("sliding_window_pattern", GEMMA3_WINDOW_PATTERN)
            types = d.get("layer_types") or ["sliding_attention" if (i + 1) % every else "full_attention"
                                             for i in range(layers)]
            window = d.get("sliding_window", GEMMA_DEFAULT_WINDOW)
        elif model_type == "smollm3" and d.get("use_sliding_window", False):  # on the NoPE layers
            rotates = ModelConfig._rope_layers(d, model_type)
            types = d.get("layer_types") or ["full_attention" if r else "sliding_attention" for r in rotates]
            window = d.get("sliding_window")
        elif model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and d.get("use_sliding_window", False):
            types = d.get("layer_types") or ModelConfig._qwen_window_layers(d, model_type)
            window = d.get("sliding_window", QWEN_DEFAULT_WINDOW)
        else:
            return None, None
        sliding = tuple(t == "sliding_attention" for t in types)
        if window is None or not any(sliding):
            return None, None
        return window, None if all(sliding) else sliding

    @staticmethod
    def _qwen_window_layers(d: dict, model_type: str) -> list[str]:
        """A Qwen config's layer types where it lists none, as transformers derives them: Qwen3-MoE windows every
        layer; Qwen2-MoE the even ones below max_window_layers; Qwen2 and Qwen3 those from max_window_layers on."""
        layers, below = d["num_hidden_layers"], d.get("max_window_layers", 28)
        if model_type == "qwen3_moe":
            return ["sliding_attention"] * layers
        if model_type == "qwen2_moe":
            return ["sliding_attention" if i % 2 == 0 and i < below else "full_attention" for i in range(layers)]
        return ["sliding_attention" if i >= below else "full_attention" for i in range(layers)]

    @classmethod
    def from_folder(cls, path: str | Path, overrides: dict | None = None) -> "ModelConfig":
        config_file = Path(path) / "config.json"
        if not config_file.exists():
            raise FileNotFoundError(f"{path}: no config.json (expected a Hugging Face model folder)")
        config = cls.from_dict({**json.loads(config_file.read_text()), **(overrides or {})})
        if config.quantization is None:
            config.quantization = separate_quantization_config(Path(path))
        pooling, normalize = sentence_transformers_pooling(Path(path))
        config.embedding_normalize = normalize
        sbert = Path(path) / "sentence_bert_config.json"
        if sbert.is_file():
            config.max_seq_length = json.loads(sbert.read_text()).get("max_seq_length")
        if config.encoder:
            config.embedding_pooling = pooling or config.embedding_pooling
        elif pooling not in (None, "LAST"):  # what a decoder's KV keeps: its last row has seen the whole prompt
            raise ValueError(f"{path}: sentence-transformers pools {pooling} here; Flock's decoder embedding models "
                             "pool the last token (an encoder's pooling may be CLS or MEAN)")
        generation = Path(path) / "generation_config.json"
        if generation.exists():  # transformers' generate (and vLLM) also stop at generation_config's eos ids
            eos = json.loads(generation.read_text()).get("eos_token_id")
            extra = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
            config.eos_token_id += [e for e in extra if e not in config.eos_token_id]
        return config


def separate_quantization_config(folder: Path) -> dict | None:
    """AutoGPTQ's quantize_config.json or AutoAWQ's quant_config.json, which vLLM reads where config.json has no
    quantization_config."""
    for name, method in (("quantize_config.json", "gptq"), ("quant_config.json", "awq")):
        if (folder / name).is_file():
            return {"quant_method": method} | json.loads((folder / name).read_text())
    return None


def sentence_transformers_pooling(folder: Path) -> tuple[str | None, bool]:
    """The pooling a sentence-transformers folder's modules.json names (None: no such file), and whether its
    embeddings are normalized (a Normalize module; True without the file), as vLLM reads them; ValueError for a
    module after pooling that would change the vector (a Dense projection)."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None, True
    pooling, normalize = None, False
    for module in json.loads(modules_file.read_text()):
        kind = module.get("type", "").rsplit(".", 1)[-1]
        if kind == "Pooling":
            modes = json.loads((folder / module.get("path", "") / "config.json").read_text())
            named = [mode for key, mode in POOLING_MODES.items() if modes.get(key)]
            if len(named) != 1:
                raise ValueError(f"{folder}: sentence-transformers pooling {modes} is not one of "
                                 f"{', '.join(POOLING_MODES)}")
            pooling = named[0]
        elif kind == "Normalize":
            normalize = True
        elif kind != "Transformer":
            raise ValueError(f"{folder}: the sentence-transformers module {kind} ({module.get('path')}) is not "
                             "supported (Flock runs Transformer, Pooling and Normalize)")
    return pooling, normalize


def sampling_defaults(folder: str | Path | None, overrides: dict | None = None) -> dict:
    """The sampling fields a folder's generation_config.json sets (`overrides` over them: vLLM's
    override_generation_config), named as requests name them: the defaults vLLM's `--generation-config auto` gives
    requests that leave them unset (transformers 5 has no defaults of its own for them, so every field the file
    sets counts). Empty without a file or overrides."""
    path = Path(folder) / "generation_config.json" if folder is not None else None
    config = json.loads(path.read_text()) if path is not None and path.is_file() else {}
    config |= overrides or {}
    out = {name: config[name] for name in SAMPLING_FIELDS if config.get(name) is not None}
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    return out
