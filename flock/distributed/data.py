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
`sampling_params` (OpenAI / Flock sampling fields; unset ones take the API's defaults, not the model's
generation config, as in Ray Data's vLLM stage; n must be 1). The processor adds
`generated_text`, `generated_tokens`, `num_input_tokens`, `num_generated_tokens`, `finish_reason` and
`batch_index` (the engine batch the row ran in), then maps each row through `postprocess`. A row Flock
rejects fails the dataset with its reason.
"""

from __future__ import annotations

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
from flock.engine.engine import LLMEngine
from flock.engine.loop import run_to_end
from flock.model import locate_model
from flock.tokenizer import load_tokenizer

IDS, PARAMS, KEY, BATCH = "__flock_ids", "__flock_params", "__flock_key", "batch_index"
MAX_PARTITIONS = 200  # of the shuffle that gathers each batch (Ray Data's default)


@dataclass
class FlockEngineProcessorConfig:
    model_source: str = "flock/tiny"
    concurrency: int = 1  # engine replicas
    batch_size: int = 64  # rows per engine call, on average (batches hold whole prefix groups)
    engine_kwargs: dict = field(default_factory=dict)  # EngineConfig keywords; scheduler default: batchllm
    num_cpus: float = 1.0  # per replica
    num_gpus: float = 0.0
    torch_threads: int | None = None  # per replica; default: num_cpus, at least 1

    def engine_config(self) -> EngineConfig:
        return EngineConfig.from_kwargs(self.model_source, **({"scheduler": "batchllm"} | self.engine_kwargs))


class Processor:
    def __init__(self, config: FlockEngineProcessorConfig, preprocess: Callable[[dict], dict] | None = None,
                 postprocess: Callable[[dict], dict] | None = None):
        if config.concurrency < 1 or config.batch_size < 1:
            raise ValueError("concurrency and batch_size must be at least 1")
        config.engine_config()  # bad engine options fail here
        self.config, self.preprocess, self.postprocess = config, preprocess, postprocess

    def __call__(self, ds: ray.data.Dataset) -> ray.data.Dataset:
        cfg = self.config
        if self.preprocess is not None:
            ds = ds.map(self.preprocess)
        ds = ds.map(_Tokenize, fn_constructor_args=(cfg,), concurrency=1).materialize()
        batch_of, num_batches = self._plan(ds)
        ds = ds.map_batches(_assign, fn_args=(batch_of,), batch_format="pandas")
        ds = ds.groupby(BATCH, num_partitions=min(num_batches, MAX_PARTITIONS)).map_groups(
            _Replica, fn_constructor_args=(cfg,), batch_format="pandas", concurrency=cfg.concurrency,
            num_cpus=cfg.num_cpus, num_gpus=cfg.num_gpus)
        ds = ds.drop_columns([IDS, PARAMS, KEY])
        return ds.map(self.postprocess) if self.postprocess is not None else ds

    def _plan(self, ds: ray.data.Dataset) -> tuple[dict[bytes, int], int]:
        """Batches of whole prefix groups: prompt key -> batch, and the number of batches."""
        ids, extra, keys = [], [], []
        for b in ds.select_columns([IDS, PARAMS, KEY]).iter_batches(batch_format="numpy"):
            ids += [np.asarray(x) for x in b[IDS]]
            extra += [pickle.loads(p).max_tokens or 0 for p in b[PARAMS]]
            keys += list(b[KEY])
        num_batches = max(1, math.ceil(len(ids) / self.config.batch_size))
        part = partition(ids, num_batches, extra)
        return {keys[i]: b for b, shard in enumerate(part.shards) for i in shard}, num_batches


def build_processor(config: FlockEngineProcessorConfig, preprocess: Callable[[dict], dict] | None = None,
                    postprocess: Callable[[dict], dict] | None = None) -> Processor:
    """A processor mapping a Dataset to a Dataset through `config.concurrency` Flock engines."""
    return Processor(config, preprocess, postprocess)


class _Tokenize:
    """Row -> row with its prompt's token ids and sampling params, checked as `flock run` checks a line."""

    def __init__(self, cfg: FlockEngineProcessorConfig):
        engine = cfg.engine_config()
        self.tokenizer = load_tokenizer(engine.tokenizer or locate_model(engine.model), engine.chat_template)

    def __call__(self, row: dict) -> dict:
        sampling = {k: _plain(v) for k, v in (row.get("sampling_params") or {}).items() if v is not None}
        if row.get("messages") is not None:
            kind, body, default_max = "chat", {"messages": list(row["messages"])}, None
        else:
            ids = row.get("prompt_token_ids")
            prompt = [int(t) for t in ids] if ids is not None else row.get("prompt")
            kind, body, default_max = "completion", {"prompt": prompt}, COMPLETION_MAX_TOKENS
        try:
            parsed = parse_request(kind, body | sampling, self.tokenizer, default_max)
            ids = parsed.prompt_token_ids
        except APIError as e:
            raise ValueError(f"row {_short(row)}: {e.message}") from None
        key = xxhash.xxh3_128_digest(np.asarray(ids, dtype=np.int64).tobytes())
        return row | {IDS: ids, PARAMS: pickle.dumps(parsed.params), KEY: key}


def _assign(batch: pd.DataFrame, batch_of: dict[bytes, int]) -> pd.DataFrame:
    """Each row's batch, by the key of its token ids (equal prompts share a group, so a batch)."""
    return batch.assign(**{BATCH: [batch_of[k] for k in batch[KEY]]})


class _Replica:
    """One engine; each call runs one batch (whole prefix groups) to the end."""

    def __init__(self, cfg: FlockEngineProcessorConfig):
        torch.set_num_threads(cfg.torch_threads or max(1, int(cfg.num_cpus)))
        self.engine = LLMEngine(cfg.engine_config())

    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        engine = self.engine
        requests = [engine.add_request([int(t) for t in ids], pickle.loads(p))
                    for ids, p in zip(batch[IDS], batch[PARAMS])]
        run_to_end(engine)
        return batch.assign(
            generated_text=[engine.decode(r) for r in requests],
            generated_tokens=[r.output_token_ids for r in requests],
            num_input_tokens=[r.num_prompt_tokens for r in requests],
            num_generated_tokens=[r.num_output_tokens for r in requests],
            finish_reason=[r.finish_reason for r in requests],
        )


def _plain(value):
    """A numpy scalar or array from a Ray Data row as the Python value the request checks expect."""
    return value.item() if isinstance(value, np.generic) else value.tolist() if isinstance(value, np.ndarray) else value


def _short(row: dict) -> str:
    text = repr({k: v for k, v in row.items() if k not in (IDS, PARAMS)})
    return text if len(text) <= 120 else text[:117] + "..."
