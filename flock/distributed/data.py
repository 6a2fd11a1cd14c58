"""A Ray Data processor in the style of `ray.data.llm`, whose batches are whole prefix groups.

    config = FlockEngineProcessorConfig(model_source="flock/tiny", concurrency=2, batch_size=64,
                                        engine_kwargs={"dtype": "float32"})
    processor = build_processor(config, preprocess=lambda row: {"prompt": row["text"],
                                "sampling_params": {"temperature": 0, "max_tokens": 32}},
                                postprocess=lambda row: {"text": row["text"], "answer": row["generated_text"]})
    ds = processor(ray.data.read_json("rows.jsonl"))

Ray Data's vLLM and SGLang processors hand rows to the replicas in dataset order, so the rows of one shared
document land on every replica and each computes the document again. Here, calling the processor runs the
preprocess and tokenize stages, brings the token ids to the driver, plans the prefix tree of the whole
dataset and cuts it into batches of whole prefix groups (`partition`: about `batch_size` rows each, balanced
by computed tokens; a group larger than a batch is cut along its sub-groups); a `groupby` on the batch then
hands each batch to one replica in one call. Generation runs when the result is consumed, as usual.

Rows after `preprocess` carry `prompt` (text), `messages` (chat) or `prompt_token_ids`, and optionally
`sampling_params` (OpenAI / Flock sampling fields; unset ones take vLLM's SamplingParams defaults, max_tokens 16
for chats too, not the model's generation config, as in Ray Data's vLLM stage; n must be 1). The processor adds
`generated_text`, `generated_tokens`, `num_input_tokens`, `num_generated_tokens`, `finish_reason`, `logprobs` and
`prompt_logprobs` (vLLM's {token id: {logprob, rank, decoded_token}} per token, where asked) and `batch_index`
(the engine batch the row ran in), then maps each row through `postprocess`. A row Flock rejects (checked before
any batch runs, as `flock run` checks a line) fails the dataset with its reason; with `should_continue_on_error`,
as Ray Data's, it gets its reason in `__inference_error__` ("" for the others), empty outputs, and skips
`postprocess`.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import ray
import torch
import xxhash

from flock.api.protocol import COMPLETION_MAX_TOKENS, APIError, parse_request
from flock.config import EngineConfig
from flock.distributed.partition import partition
from flock.engine.detokenizer import TokenPieces
from flock.engine.engine import LLMEngine, check_prompt
from flock.engine.loop import run_to_end
from flock.model import resolve_model
from flock.sample.logprobs import TokenLogprobs, with_texts
from flock.tokenizer import load_tokenizer

IDS, PARAMS, KEY, BATCH, ERROR = "__flock_ids", "__flock_params", "__flock_key", "batch_index", "__inference_error__"
MAX_PARTITIONS = 200  # of the shuffle that gathers each batch (Ray Data's default)


@dataclass
class FlockEngineProcessorConfig:
    model_source: str = "flock/tiny"
    concurrency: int | tuple[int, int] = 1  # engine replicas (min, max: an autoscaling pool)
    batch_size: int = 64  # rows per engine call, on average (batches hold whole prefix groups)
    engine_kwargs: dict = field(default_factory=dict)  # EngineConfig keywords; scheduler default: batchllm
    num_cpus: float = 1.0  # per replica
    num_gpus: float = 0.0
    torch_threads: int | None = None  # per replica; default: num_cpus, at least 1
    should_continue_on_error: bool = False  # a bad row gets its reason in __inference_error__, not the job's end

    def engine_config(self) -> EngineConfig:
        return EngineConfig.from_kwargs(self.model_source, **({"scheduler": "batchllm"} | self.engine_kwargs))


class Processor:
    def __init__(self, config: FlockEngineProcessorConfig, preprocess: Callable[[dict], dict] | None = None,
                 postprocess: Callable[[dict], dict] | None = None):
        pool = config.concurrency if isinstance(config.concurrency, tuple) else (config.concurrency,) * 2
        if not 1 <= pool[0] <= pool[-1] or len(pool) != 2 or config.batch_size < 1:
            raise ValueError(f"concurrency (an int, or (min, max)) and batch_size must be at least 1, got "
                             f"{config.concurrency} and {config.batch_size}")
        config.engine_config()  # bad engine options fail here
        self.config, self.preprocess, self.postprocess = config, preprocess, postprocess

    def __call__(self, ds: ray.data.Dataset) -> ray.data.Dataset:
        cfg = self.config
        self._check_cpus()
        if self.preprocess is not None:
            ds = ds.map(self.preprocess)
        ds = ds.map(_Tokenize, fn_constructor_args=(cfg,), concurrency=1).materialize()
        if ds.count() == 0:  # nothing to plan (a groupby over no rows fails)
            return ds
        batch_of, num_batches = self._plan(ds)
        ds = ds.map_batches(_assign, fn_args=(batch_of,), batch_format="pandas")
        ds = ds.groupby(BATCH, num_partitions=min(num_batches, MAX_PARTITIONS)).map_groups(
            _Replica, fn_constructor_args=(cfg,), batch_format="pandas", concurrency=cfg.concurrency,
            num_cpus=cfg.num_cpus, num_gpus=cfg.num_gpus)
        ds = ds.drop_columns([IDS, PARAMS, KEY] + ([] if cfg.should_continue_on_error else [ERROR]))
        if self.postprocess is None:
            return ds
        post = self.postprocess
        return ds.map(lambda row: row if row[ERROR] else post(row) | {ERROR: ""}) if cfg.should_continue_on_error \
            else ds.map(post)

    def _check_cpus(self) -> None:
        """The replicas' CPUs and one more, for the shuffle that hands them their batches: without it the
        dataset would wait for ever."""
        cfg = self.config
        replicas = cfg.concurrency[0] if isinstance(cfg.concurrency, tuple) else cfg.concurrency
        if not ray.is_initialized():
            ray.init()
        need, have = replicas * cfg.num_cpus + 1, ray.cluster_resources().get("CPU", 0)
        if need > have + 1e-9:
            raise ValueError(f"{replicas} replica(s) x {cfg.num_cpus:g} CPUs and 1 CPU for the shuffle that hands them "
                             f"their batches need {need:g} CPUs, the Ray cluster has {have:g}: lower concurrency or "
                             "num_cpus (a fraction of a CPU each)")

    def _plan(self, ds: ray.data.Dataset) -> tuple[dict[bytes, int], int]:
        """Batches of whole prefix groups: prompt key -> batch, and the number of batches (rows that failed their
        checks run nowhere: batch 0 passes them on)."""
        ids, extra, keys = [], [], []
        for b in ds.select_columns([IDS, PARAMS, KEY, ERROR]).iter_batches(batch_format="numpy"):
            ok = [i for i, e in enumerate(b[ERROR]) if not e]
            ids += [np.asarray(b[IDS][i]) for i in ok]
            extra += [pickle.loads(b[PARAMS][i]).max_tokens for i in ok]
            keys += [b[KEY][i] for i in ok]
        if not ids:
            return {}, 1
        num_batches = max(1, math.ceil(len(ids) / self.config.batch_size))
        part = partition(ids, num_batches, extra)
        return {keys[i]: b for b, shard in enumerate(part.shards) for i in shard}, num_batches


def build_processor(config: FlockEngineProcessorConfig, preprocess: Callable[[dict], dict] | None = None,
                    postprocess: Callable[[dict], dict] | None = None) -> Processor:
    """A processor mapping a Dataset to a Dataset through `config.concurrency` Flock engines."""
    return Processor(config, preprocess, postprocess)


class _Tokenize:
    """Row -> row with its prompt's token ids and sampling params, checked as `flock run` checks a line (against
    the model's context; a KV cache smaller than it is the replica's to find)."""

    def __init__(self, cfg: FlockEngineProcessorConfig):
        engine = cfg.engine_config()
        resolved = resolve_model(engine.model, engine.hf_overrides)
        self.tokenizer = load_tokenizer(engine.tokenizer or resolved.tokenizer_path, engine.chat_template)
        self.max_model_len = engine.max_model_len if engine.max_model_len not in (None, -1) else \
            resolved.config.default_max_model_len
        self.vocab_size = resolved.config.vocab_size
        self.keep_going = cfg.should_continue_on_error

    def __call__(self, row: dict) -> dict:
        sampling = {k: _plain(v) for k, v in (row.get("sampling_params") or {}).items() if v is not None}
        if row.get("messages") is not None:
            kind, body = "chat", {"messages": list(row["messages"])}
            if not isinstance(sampling.get("logprobs", False), bool):  # vLLM's SamplingParams.logprobs: how many
                sampling |= {"logprobs": True, "top_logprobs": sampling["logprobs"]}
        else:
            ids = row.get("prompt_token_ids")
            prompt = [int(t) for t in ids] if ids is not None else row.get("prompt")
            kind, body = "completion", {"prompt": prompt}
        try:
            parsed = parse_request(kind, body | sampling, self.tokenizer, COMPLETION_MAX_TOKENS)
            parsed.fit(self.max_model_len)
            ids = parsed.prompt_token_ids
            check_prompt(ids, parsed.params, self.max_model_len, self.vocab_size)
        except (APIError, ValueError) as e:
            reason = f"row {_short(row)}: {e}"
            if not self.keep_going:
                raise ValueError(reason) from None
            return row | {IDS: [], PARAMS: b"", KEY: b"", ERROR: reason}
        key = xxhash.xxh3_128_digest(np.asarray(ids, dtype=np.int64).tobytes())
        return row | {IDS: ids, PARAMS: pickle.dumps(parsed.params), KEY: key, ERROR: ""}


def _assign(batch: pd.DataFrame, batch_of: dict[bytes, int]) -> pd.DataFrame:
    """Each row's batch, by the key of its token ids (equal prompts share a group, so a batch)."""
    return batch.assign(**{BATCH: [batch_of.get(k, 0) for k in batch[KEY]]})


class _Replica:
    """One engine; each call runs one batch (whole prefix groups) to the end."""

    def __init__(self, cfg: FlockEngineProcessorConfig):
        torch.set_num_threads(cfg.torch_threads or max(1, int(cfg.num_cpus)))
        self.engine = LLMEngine(cfg.engine_config())
        self.keep_going = cfg.should_continue_on_error
        self.pieces = TokenPieces(self.engine.tokenizer)

    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        engine, errors, requests = self.engine, list(batch[ERROR]), []
        for i, (ids, p) in enumerate(zip(batch[IDS], batch[PARAMS])):
            try:
                requests.append(None if errors[i] else engine.add_request([int(t) for t in ids], pickle.loads(p)))
            except ValueError as e:  # what only the engine knows (its KV cache's size)
                if not self.keep_going:
                    raise
                errors[i], requests = f"{type(e).__name__}: {e}", requests + [None]
        run_to_end(engine)
        done = [r for r in requests if r is not None]

        def column(of, empty=None) -> list:
            values = iter(of(r) for r in done)
            return [empty if r is None else next(values) for r in requests]

        return batch.assign(**{
            "generated_text": column(engine.decode, ""), "generated_tokens": column(lambda r: r.output_token_ids, []),
            "num_input_tokens": column(lambda r: r.num_prompt_tokens, 0),
            "num_generated_tokens": column(lambda r: r.num_output_tokens, 0),
            "finish_reason": column(lambda r: r.finish_reason, ""),
            "logprobs": column(lambda r: self._logprobs(r.logprobs)),
            "prompt_logprobs": column(lambda r: self._logprobs(r.prompt_logprobs)), ERROR: errors})

    def _logprobs(self, entries: list[TokenLogprobs | None] | None) -> list[dict | None] | None:
        """vLLM's logprobs as Ray Data's vLLM stage writes them: per token {token id: {logprob, rank,
        decoded_token}}."""
        if entries is None:
            return None
        with_texts(entries, self.pieces)
        return [None if e is None else {t: dataclasses.asdict(lp) for t, lp in e.items()} for e in entries]


def _plain(value):
    """A numpy scalar or array from a Ray Data row as the Python value the request checks expect."""
    return value.item() if isinstance(value, np.generic) else value.tolist() if isinstance(value, np.ndarray) else value


def _short(row: dict) -> str:
    text = repr({k: v for k, v in row.items() if k not in (IDS, PARAMS)})
    return text if len(text) <= 120 else text[:117] + "..."
