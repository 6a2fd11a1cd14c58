"""`flock run`: an OpenAI Batch job through the engine, resumable after any crash.

Every line becomes an engine request per choice (n samples of each of its prompts; bodies are checked by
`flock.api.protocol`, as the server checks them); a line's record, with all its choices, is appended to the
output once they have all finished (see `batch_output`). A resumed job reads the output back, skips the
custom_ids already there and runs the rest; bad lines go to the error file once, however often the job is
resumed.

Sampling defaults for a line that sets none: the CLI flags when given, else OpenAI's (temperature 1,
max_tokens 16 for completions; a chat runs until EOS or max_model_len).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from flock.api.analyze import key_value_table
from flock.api.batch_input import BatchLine, LineError, read_lines
from flock.api.batch_output import (CorruptFileError, JsonlAppender, drop_records, error_record, load_records,
                                    result_record)
from flock.api.classify import ClassifyRequest
from flock.api.generative_scores import LabelScoreRequest, parse_label_scores
from flock.api.job_engine import EngineError, FinishedRequest, JobEngine
from flock.api.logprobs import TokenText
from flock.api.messages import MessagesRequest, parse_messages
from flock.api.messages import renamed as messages_renamed
from flock.api.pooling import KINDS as POOLING_KINDS, PoolingRequest, pooling_request
from flock.api.protocol import (COMPLETION_MAX_TOKENS, APIError, GenerationRequest, choices_usage, engine_error,
                                make_choice, max_tokens_cap, model_defaults, new_id, parse_request, reasoning_usage,
                                refuse_adapter_embeddings, response_body, with_defaults)
from flock.api.responses import ResponsesRequest, parse_responses, renamed
from flock.api.scores import ScoreRequest
from flock.beam_search import BeamSearch
from flock.config import EngineConfig
from flock.engine.engine import LLMEngine
from flock.engine.loop import run
from flock.tokenizer import ChatOptions
from flock.lora import lora_requests

SummaryRows = Callable[[], list[tuple[str, str]]]
SHOWN_ERRORS = 5  # on stderr; all of them are in the error file
SHOWN_ANSWERS = 8  # lines spread over the input whose answers the summary shows
ANSWER_WIDTH = 100


@dataclass
class JobConfig:
    input: str
    output: str
    errors: str | None = None  # default: <output stem>.errors.jsonl beside the output
    resume: bool = False
    overwrite: bool = False
    quiet: bool = False
    max_tokens: int | None = None  # for lines that set none
    sampling: dict = field(default_factory=dict)  # temperature, top_p, ... for lines that set none
    engine: dict = field(default_factory=dict)  # EngineConfig keywords, model included
    strict: bool = False  # a failed line makes the exit status 1
    tool_parser: str | None = None  # flock.api.tools.TOOL_PARSERS; None: chat lines cannot call tools
    reasoning_parser: str | None = None  # flock.api.reasoning.REASONING_PARSERS; None: thinking is content
    chat: ChatOptions = field(default_factory=ChatOptions)  # how chats render besides the template (vLLM's flags)
    served_model_name: str | None = None  # the model the outputs name (default: the engine's)

    @property
    def output_path(self) -> Path:
        return Path(self.output)

    @property
    def errors_path(self) -> Path:
        out = self.output_path
        return Path(self.errors) if self.errors else out.with_name(f"{out.stem}.errors.jsonl")


@dataclass
class JobCounts:
    succeeded: int = 0  # written by this run
    failed: int = 0  # bad lines, reported now or by an earlier run
    skipped: int = 0  # already in the output
    new_errors: int = 0


def run_job(cfg: JobConfig, engine: JobEngine | None = None, build_engine: Callable[[], JobEngine] | None = None,
            summary_rows: SummaryRows | None = None) -> int:
    """Run (or resume) the job. 0 when it ran to the end, as OpenAI's Batch API completes a batch with failed
    lines (they are counted in the summary and written to the error file), 1 instead when some failed and
    `cfg.strict`, 2 when it could not start. `engine` (idle) is built by `build_engine` once the files are
    checked, by default an LLMEngine from `cfg.engine` (see `flock.api.job_engine`); `summary_rows` adds the
    engine's own rows to the summary."""
    try:
        _check_paths(cfg)
        _check_defaults(cfg)
        done, reported = _read_files(cfg)
        if engine is None:
            engine = build_engine() if build_engine else LLMEngine(EngineConfig.from_kwargs(**cfg.engine))
        if cfg.overwrite:  # only now: a job that cannot start keeps the old results
            _empty(cfg.output_path, cfg.errors_path)
        engine.tokenizer.chat_options = cfg.chat
    except (CorruptFileError, OSError, ValueError, TypeError, EngineError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    job = BatchJob(cfg, engine, done, reported, summary_rows or list)
    try:
        job.submit_all()
        job.generate()
    except KeyboardInterrupt:
        print(f"\ninterrupted: {job.counts.succeeded} results saved in {cfg.output}; "
              "run the same command with --resume to finish", file=sys.stderr)
        return 130
    except (OSError, EOFError, EngineError) as e:  # unreadable input (a truncated .gz), a full disk, workers lost
        print(f"error: {e}; the results so far are saved, fix it and run again with --resume", file=sys.stderr)
        return 2
    finally:
        job.close()
    job.report()
    return 1 if cfg.strict and job.counts.failed else 0


def _check_paths(cfg: JobConfig) -> None:
    inp, out, err = Path(cfg.input), cfg.output_path, cfg.errors_path
    if not inp.is_file():
        raise FileNotFoundError(f"cannot read {inp}: no such file")
    for path in (out, err):
        if not path.parent.is_dir():
            raise FileNotFoundError(f"cannot write {path}: no such directory {path.parent}")
    if len({inp.resolve(), out.resolve(), err.resolve()}) < 3:
        raise ValueError("the input, output and error files must be three different files")
    existing = [str(p) for p in (out, err) if p.exists()]
    if existing and not (cfg.resume or cfg.overwrite):
        raise ValueError(f"{' and '.join(existing)} already exist{'s' if len(existing) == 1 else ''}: "
                         "pass --resume to finish that job, or --overwrite to start again")


def _check_defaults(cfg: JobConfig) -> None:
    try:
        parse_request("completion", cfg.sampling | {"prompt": [0]}, None, cfg.max_tokens)
    except APIError as e:
        raise ValueError(f"bad default for --{(e.param or '').replace('_', '-')}: {e.message}") from None


def _read_files(cfg: JobConfig) -> tuple[set[str], set[tuple[int, str | None]]]:
    """(custom_ids already in the output, (line, custom_id) of the bad lines already in the error file); nothing
    when the job starts again."""
    out, err = cfg.output_path, cfg.errors_path
    if cfg.overwrite:
        return set(), set()
    done = {r["custom_id"] for r in load_records(out)} if out.exists() else set()
    errors = load_records(err) if err.exists() else []
    return done, {(r["error"]["line"], r.get("custom_id")) for r in errors
                  if isinstance(r.get("error"), dict) and "line" in r["error"]}


def _empty(*paths: Path) -> None:
    """The old output and error files gone: a file deleted, a link to one emptied (not replaced), anything else
    (a device, /dev/stdout) left as it is."""
    for path in paths:
        if path.is_symlink() and path.is_file():
            with open(path, "r+b") as f:
                f.truncate(0)
        elif path.is_file():
            path.unlink()


def progress_bar(iterable, quiet: bool, **kwargs) -> tqdm:
    """A progress bar on stderr; where stderr is no terminal (a log file, nohup, a cluster job), a line every 5
    seconds, as vLLM's run-batch writes it."""
    if quiet or sys.stderr.isatty():
        return tqdm(iterable, disable=quiet, **kwargs)
    line = "{desc}: {n_fmt}/{total_fmt} {unit} [{elapsed}<{remaining}, {rate_fmt}{postfix}]\n"
    return tqdm(iterable, mininterval=5, bar_format=line, **kwargs)


LineRequest = GenerationRequest | PoolingRequest | ResponsesRequest | MessagesRequest | LabelScoreRequest


@dataclass
class PendingLine:
    """A submitted line: its choices' finished requests and texts, filled in as they finish."""

    number: int  # in the input
    custom_id: str
    request: LineRequest
    finished: list[FinishedRequest | None]
    texts: list[str]
    searches: list[BeamSearch] | None = None  # a use_beam_search line's, one per prompt


class BatchJob:
    def __init__(self, cfg: JobConfig, engine: JobEngine, done: set[str], reported: set[tuple[int, str | None]],
                 summary_rows: SummaryRows = list):
        self.cfg, self.engine, self.summary_rows = cfg, engine, summary_rows
        self.done, self.reported = done, reported
        self.output = JsonlAppender(cfg.output_path)
        self.errors = JsonlAppender(cfg.errors_path)
        self.pending: dict[str, PendingLine] = {}  # custom_id -> line, in input order
        self.running: dict[int, tuple[PendingLine, int]] = {}  # engine request id -> (line, choice index)
        self.counts = JobCounts()
        self.answers: dict[str, str | None] = {}  # custom_id -> answer, for the summary
        self.fixed: set[tuple[int, str]] = set()  # (line, custom_id) of reported lines that succeeded now
        self.token_text = TokenText(engine.tokenizer)
        self.flags = cfg.sampling | ({"max_tokens": cfg.max_tokens} if cfg.max_tokens is not None else {})
        self.loras = lora_requests(engine.config.lora_modules or [])  # a line's model may name one
        engine.reset_stats()

    def submit_all(self) -> None:
        first_line: dict[str, int] = {}
        for line in progress_bar(read_lines(self.cfg.input), self.cfg.quiet, desc="flock run: reading", unit="line",
                                 leave=False):
            try:
                first = first_line.setdefault(line.custom_id, line.number)  # a bad line claims its id too
                if isinstance(line, LineError):
                    raise line
                if first != line.number:
                    why = f"duplicate custom_id {line.custom_id!r} (first on line {first})"
                    raise LineError(line.number, why, line.custom_id, "duplicate_custom_id", "custom_id")
                if line.custom_id in self.done:
                    self.counts.skipped += 1
                else:
                    self._submit(line)
            except LineError as e:
                self._fail(e)
        self.errors.sync()

    def _submit(self, line: BatchLine) -> None:
        if line.kind == "generative_score" or (line.kind == "score" and "label_token_ids" in line.body):
            return self._submit_prompts(line, self._parse_label_scores)
        if line.kind in POOLING_KINDS:
            return self._submit_prompts(line, self._parse_pooling)
        rename = {"response": renamed, "message": messages_renamed}.get(line.kind, lambda e: e)
        try:  # a line's fields, else the CLI flags, else the model's generation config, else the API's defaults
            parsed = gen = self._parse(line)
            if isinstance(parsed, (ResponsesRequest, MessagesRequest)):
                gen = parsed.gen
            if gen.stream:
                raise APIError("stream is not supported in a batch job", param="stream")
            gen.use_lora(self.loras.get(gen.model))
            gen.fit(self.engine.max_model_len, max_tokens_cap(self.engine.config, self.engine.sampling_defaults))
            for ids in gen.prompts:
                self.engine.check_request(ids, gen.params)
            if gen.beam is not None:
                return self._add_beams(line, gen)
        except APIError as e:
            e = rename(e)
            raise LineError(line.number, e.message, line.custom_id, param=e.param) from None
        except ValueError as e:
            error = rename(engine_error(e, gen))
            raise LineError(line.number, error.message, line.custom_id, param=error.param) from None
        self._add(line, parsed, gen.engine_requests())

    def _parse(self, line: BatchLine) -> GenerationRequest | ResponsesRequest | MessagesRequest:
        defaults, cfg = self.engine.sampling_defaults, self.cfg
        if line.kind == "message":
            return parse_messages(line.body, self.engine.tokenizer, cfg.tool_parser, cfg.reasoning_parser,
                                  defaults | self.flags)
        if line.kind == "response":
            if line.body.get("previous_response_id") is not None:
                raise APIError("previous_response_id needs a stored response; a batch job stores none",
                               param="previous_response_id")
            parsed = parse_responses(line.body, self.engine.tokenizer, cfg.tool_parser, cfg.reasoning_parser,
                                     defaults=defaults | self.flags)
            parsed.storable = False  # a job keeps no responses
            return parsed
        default_max = COMPLETION_MAX_TOKENS if line.kind == "completion" else None
        return parse_request(line.kind, with_defaults(line.body, model_defaults(defaults, line.kind) | self.flags),
                             self.engine.tokenizer,
                             default_max, cfg.tool_parser, cfg.reasoning_parser)

    def _parse_pooling(self, line: BatchLine) -> PoolingRequest:
        refuse_adapter_embeddings(line.body, self.loras)
        return pooling_request(line.kind, line.body, self.engine.tokenizer, self.engine.tasks)

    def _parse_label_scores(self, line: BatchLine) -> LabelScoreRequest:
        kind = "vllm" if line.kind == "generative_score" else "sglang"
        parsed = parse_label_scores(kind, line.body, self.engine.tokenizer, self.engine.vocab_size,
                                    self.engine.max_model_len)
        parsed.params.lora_request = self.loras.get(line.body.get("model"))
        return parsed

    def _submit_prompts(self, line: BatchLine, parse: Callable[[BatchLine], PoolingRequest | LabelScoreRequest]
                        ) -> None:
        """A line whose prompts all run with the same params (pooling, label scores)."""
        try:
            parsed = parse(line)
            for ids in parsed.prompts:
                self.engine.check_request(ids, parsed.params)
        except APIError as e:
            raise LineError(line.number, e.message, line.custom_id, param=e.param) from None
        except ValueError as e:
            error = parsed.rejected(e)
            raise LineError(line.number, error.message, line.custom_id, param=error.param) from None
        self._add(line, parsed, [(ids, parsed.params) for ids in parsed.prompts])

    def _add(self, line: BatchLine, parsed: LineRequest, requests: list) -> None:
        pending = PendingLine(line.number, line.custom_id, parsed, [None] * len(requests), [""] * len(requests))
        self.pending[line.custom_id] = pending
        for i, (ids, params) in enumerate(requests):
            self.running[self.engine.add_request(ids, params).request_id] = (pending, i)

    def _add_beams(self, line: BatchLine, gen: GenerationRequest) -> None:
        """A use_beam_search line: its searches' first steps (the later ones follow as each step finishes)."""
        searches = gen.beam_searches(self.engine.max_model_len, sorted(self.engine.eos_token_ids))
        pending = PendingLine(line.number, line.custom_id, gen, [], [], searches)
        self.pending[line.custom_id] = pending
        for s in range(len(searches)):
            self._beam_step(pending, s)

    def _beam_step(self, line: PendingLine, s: int) -> None:
        for b, (ids, params) in enumerate(line.searches[s].requests()):
            self.running[self.engine.add_request(ids, params).request_id] = (line, (s, b))

    def _beams_done(self, line: PendingLine, s: int, b: int, req: FinishedRequest) -> bool:
        """Note beam b of search s's step; True when every search of the line is done."""
        search = line.searches[s]
        if not search.record(b, req.logprobs[0]):
            return False
        if not search.done:
            self._beam_step(line, s)
            return False
        return all(x.done for x in line.searches)

    def _fail(self, e: LineError) -> None:
        self.counts.failed += 1
        if (e.number, e.custom_id) in self.reported:  # an edited input's line of that number is another line
            return
        self.errors.write(error_record(e.custom_id, e.number, e.message, e.code, e.param))
        self.counts.new_errors += 1
        if not self.cfg.quiet and self.counts.new_errors <= SHOWN_ERRORS:
            print(f"error: {self.cfg.input}:{e.number}: {e.message}", file=sys.stderr)

    def generate(self) -> None:
        ids = list(self.pending)  # in input order
        count = min(SHOWN_ANSWERS, len(ids))
        self.answers = {ids[i * len(ids) // count]: None for i in range(count)}
        stats, skipped = self.engine.stats, self.counts.skipped
        self.output.open()  # even with nothing to run: the file marks the job as started
        bar = progress_bar(None, self.cfg.quiet, total=len(self.pending) + skipped, initial=skipped, desc="flock run",
                           unit="req")
        shown = 0.0
        try:
            for step in run(self.engine):
                written = sum(self._finish(req) for req in step.finished)
                self.output.tick()
                if written:
                    bar.update(written)
                if stats.elapsed - shown > 0.5:
                    bar.set_postfix_str(self._progress(), refresh=False)
                    shown = stats.elapsed
        finally:
            bar.set_postfix_str(self._progress(), refresh=False)
            bar.close()

    def _progress(self) -> str:
        s = self.engine.stats
        return f"{s.generated_tokens / max(s.elapsed, 1e-9):.0f} tok/s out, saving {s.saving_rate:.0%}"

    def _finish(self, req: FinishedRequest) -> bool:
        """Note a finished engine request; True when it was its line's last, whose record is then written."""
        line, i = self.running.pop(req.request_id)
        if self.pending.get(line.custom_id) is not line:  # its line failed
            return False
        error = getattr(req, "error", None)  # a worker's engine refused it (flock run --workers)
        if error is not None:
            del self.pending[line.custom_id]
            self._fail(LineError(line.number, error, line.custom_id))
            return True
        if line.searches is not None:
            if not self._beams_done(line, *i, req):
                return False
        else:
            line.finished[i], line.texts[i] = req, self.engine.decode(req)
            if None in line.finished:
                return False
        del self.pending[line.custom_id]
        request_id, body = self._response(line)
        if line.custom_id in self.answers:
            self.answers[line.custom_id] = self._answer(line, body)
        self.output.write(result_record(line.custom_id, request_id, body))
        self.counts.succeeded += 1
        if (line.number, line.custom_id) in self.reported:  # failed before, fixed since: its error goes
            self.fixed.add((line.number, line.custom_id))
        return True

    @staticmethod
    def _answer(line: PendingLine, body: dict) -> str:
        """What the summary shows of a line's answer."""
        if isinstance(line.request, ScoreRequest) or (isinstance(line.request, LabelScoreRequest)
                                                      and "data" in body):
            return "scores " + ", ".join(f"{x.get('score', x.get('relevance_score')):.3f}"
                                         for x in body.get("data", body.get("results")))
        if isinstance(line.request, LabelScoreRequest):
            return "scores " + "; ".join(", ".join(f"{p:.3f}" for p in item) for item in body["scores"])
        if line.searches is not None:
            first = body["choices"][0]
            return first["text"] if "text" in first else first["message"]["content"]
        if isinstance(line.request, ClassifyRequest):
            return "labels " + ", ".join(x["label"] for x in body["data"])
        first = line.finished[0].embedding
        return line.texts[0] if first is None else f"[an embedding of {len(first)} values]"

    def _response(self, line: PendingLine) -> tuple[str, dict]:
        """(request id, response body) of a line whose requests have all finished."""
        gen, model = line.request, self.cfg.served_model_name or self.engine.config.model
        if isinstance(gen, (GenerationRequest, ResponsesRequest, MessagesRequest)):
            model = self._model_of(gen if isinstance(gen, GenerationRequest) else gen.gen)
        if isinstance(gen, PoolingRequest):
            tokens = sum(r.num_prompt_tokens for r in line.finished)
            body = gen.body(model, [r.embedding for r in line.finished], tokens)
            return body["id"], body
        if isinstance(gen, LabelScoreRequest):
            tokens = sum(r.num_prompt_tokens for r in line.finished)
            body = gen.body(model, [r.logprobs[0].top for r in line.finished], tokens)
            return gen.id, body
        if line.searches is not None:
            request_id = new_id(gen.kind)
            choices, usage_ = gen.beam_choices(line.searches, self.token_text)
            return request_id, response_body(gen.kind, request_id, model, choices, usage_)
        wrapper = gen if isinstance(gen, (ResponsesRequest, MessagesRequest)) else None
        gen = wrapper.gen if wrapper else gen
        choices = [make_choice(gen, i, text, r.finish_reason, r.output_token_ids, r.logprobs, r.prompt_logprobs,
                               self.token_text, r.stop_text)
                   for i, (text, r) in enumerate(zip(line.texts, line.finished))]
        final = line.finished[0]
        if isinstance(wrapper, ResponsesRequest):
            body = wrapper.whole(model, choices[0], final, final.output_token_ids, self.engine.tokenizer)
            return wrapper.id, body
        if isinstance(wrapper, MessagesRequest):
            return wrapper.id, wrapper.message(model, choices[0], final)
        request_id = new_id(gen.kind)
        return request_id, response_body(gen.kind, request_id, model, choices,
                                         choices_usage(line.finished, gen.n, reasoning_usage(gen, choices)),
                                         role=gen.role)

    def _model_of(self, gen: GenerationRequest) -> str:
        """The model a line's output names: its LoRA adapter's (as vLLM), else the engine's."""
        return gen.model if gen.model in self.loras else self.cfg.served_model_name or self.engine.config.model

    def close(self) -> None:
        self.output.close()
        self.errors.close()
        if self.fixed:  # one record per line: those now in the output leave the error file
            fixed = self.fixed
            drop_records(self.cfg.errors_path,
                         lambda r: ((r.get("error") or {}).get("line"), r.get("custom_id")) in fixed)

    def report(self) -> None:
        c, cfg = self.counts, self.cfg
        if c.failed:
            print(f"{c.failed} line(s) failed ({c.new_errors} newly reported); see {cfg.errors_path}", file=sys.stderr)
        line = f"{c.succeeded} succeeded, {c.failed} failed, {c.skipped} skipped (done before); results in {cfg.output}"
        print(line if cfg.quiet else self._table() + self._answers())

    def _table(self) -> str:
        c, s = self.counts, self.engine.stats.as_dict()
        rows = [
            ("requests: succeeded / failed / skipped", f"{c.succeeded} / {c.failed} / {c.skipped} (done before)"),
            ("prefill tokens (logical / computed)", f"{s['logical_prefill_tokens']} / {s['computed_prefill_tokens']}"),
            ("saving rate", f"{s['saving_rate']:.1%}"),
            ("generated tokens", f"{s['generated_tokens']}"),
            ("steps (mean / max tokens per step)",
             f"{s['steps']} ({s['mean_tokens_per_step']:.1f} / {s['max_tokens_per_step']})"),
            ("preemptions", f"{s['preemptions']}"),
            *([("KV blocks read from / written to disk", f"{s['disk_read_blocks']} / {s['disk_saved_blocks']}")]
              if s["disk_read_blocks"] or s["disk_saved_blocks"] else []),
            *([("drafts: confirmed / verified (tokens a drafting step)",
                f"{s['accepted_draft_tokens']} / {s['draft_tokens']} ({s['mean_acceptance_length']:.2f})")]
              if s["draft_tokens"] else []),
            ("tok/s (prompt / generated / total)",
             f"{s['prompt_tokens_per_s']:.0f} / {s['generated_tokens_per_s']:.0f} / {s['total_tokens_per_s']:.0f}"),
            ("time: wall / model / scheduling",
             f"{s['wall_seconds']:.2f} s / {s['model_seconds']:.2f} s / {s['schedule_seconds'] * 1e3:.1f} ms"),
            ("KV blocks (peak / total)", f"{s['peak_kv_blocks']} / {s['num_kv_blocks']}"),
            ("output", self.cfg.output),
        ]
        if c.failed:
            rows.append(("errors", str(self.cfg.errors_path)))
        rows += self.summary_rows()
        return key_value_table(rows)

    def _answers(self) -> str:
        shown = {custom_id: text for custom_id, text in self.answers.items() if text is not None}
        if not shown:
            return ""
        width = max(map(len, shown))
        lines = [f"\n\nanswers ({len(shown)} of {self.counts.succeeded}, all in {self.cfg.output}):"]
        for custom_id, text in shown.items():
            text = " ".join(text.split())
            text = text if len(text) <= ANSWER_WIDTH else text[: ANSWER_WIDTH - 3] + "..."
            lines.append(f"  {custom_id:<{width}}  {text}")
        return "\n".join(lines)
