"""The engine in its own thread, driven from asyncio: submit requests, stream their outputs, abort them.

The LLMEngine is built and stepped only in the engine thread. asyncio talks to it through a command queue
(closures run in the engine thread) and gets outputs back with `loop.call_soon_threadsafe`, batched per step.
torch releases the GIL inside model steps, so the event loop stays responsive while the engine works.
"""

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

from flock.engine.text_stream import TextStream
from flock.config import EngineConfig
from flock.engine.engine import LLMEngine
from flock.engine.loop import run
from flock.pooling_params import PoolingParams
from flock.request import Request, RequestStatus, RequestTimes
from flock.sample.logprobs import TokenLogprobs
from flock.sampling_params import SamplingParams
from flock.tokenizer import load_tokenizer

log = logging.getLogger("flock")

_STOP = object()


class QueueFull(RuntimeError):
    """More than `max_waiting` requests would wait for admission."""


class EngineDead(RuntimeError):
    """The engine thread is not running (shut down or crashed)."""


@dataclass
class StreamOutput:
    """One event of a request: the text produced since the previous event, and how it ended."""

    text: str
    num_prompt_tokens: int
    num_output_tokens: int  # so far
    num_cached_tokens: int = 0
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None
    token_ids: list[int] = field(default_factory=list)  # the output tokens since the previous event
    logprobs: list[TokenLogprobs] | None = None  # theirs, when the params asked
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # in the first event with tokens, when asked
    stop_reason: int | str | None = None  # the stop token or string that ended it, in the last event
    embedding: list[float] | None = None  # of an embedding request, in its last event
    times: RequestTimes | None = None  # in the last event: where its time went
    cache_lookup: bool = True  # its prompt was looked up in the prefix cache (not with it off, nor prompt logprobs)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineState:
    """A snapshot published by the engine thread after every step; read from any thread."""

    attention: str = ""  # the attention backend (and its ISA path, if it has one)
    scheduler: str = ""  # the policy the engine runs (an encoder's: fcfs or priority, whatever was asked)
    num_added: int = 0  # submissions the engine thread has taken so far
    num_waiting: int = 0
    num_running: int = 0
    num_active: int = 0  # requests with a live output stream
    kv_blocks_used: int = 0  # blocks held only by the prefix cache count as free
    kv_blocks_total: int = 0
    saving_rate: float = 0.0
    steps: int = 0
    step_tokens: int = 0  # tokens computed by all steps
    preemptions: int = 0
    num_drafts: int = 0  # speculative decoding: steps of requests that verified drafts, drafts, confirmed drafts
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    disk_read_blocks: int = 0  # KV blocks read from the prefix cache's disk tier, and computed ones handed to it
    disk_saved_blocks: int = 0
    model_seconds: float = 0.0  # forward passes and sampling
    busy_seconds: float = 0.0  # the engine thread's time in steps: scheduling, model, outputs


class RequestStream:
    """The asyncio side of one request: its outputs in order, the last one finished."""

    def __init__(self, key: int, engine: "AsyncEngine"):
        self.key = key
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[StreamOutput] = asyncio.Queue()
        self.created = time.monotonic()
        self.finished = False
        self.num_output_tokens = 0  # as of its last output read
        self.siblings: list[RequestStream] = [self]  # the streams of its prompt's n choices, itself included
        self.max_tokens: int | None = None  # what its params allow (None: not a generation)
        self._engine = engine
        self._aborted = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> StreamOutput:
        if self.finished:
            raise StopAsyncIteration
        out = await self.queue.get()
        self.finished, self.num_output_tokens = out.finished, out.num_output_tokens
        return out

    def abort(self) -> None:
        """Cancel the request and free its KV blocks; its stream then ends with finish_reason "abort"."""
        if not self.finished and not self._aborted:
            self._aborted = True
            self._engine.abort(self.key)


@dataclass
class _Tracked:
    req: Request
    stream: RequestStream
    text: TextStream
    cache_lookup: bool = True  # see StreamOutput
    num_sent: int = 0  # output tokens already reported

    def output(self, text: str, finish_reason: str | None, error: str | None = None, sent: int | None = None
               ) -> StreamOutput:
        """The event after `sent` output tokens were reported (None: no tokens in it)."""
        r = self.req
        out = StreamOutput(text, r.num_prompt_tokens, r.num_output_tokens, r.num_cached_tokens, finish_reason, error)
        out.stop_reason = r.stop_text if finish_reason in ("stop", "repetition") else None
        out.embedding, out.cache_lookup = r.embedding, self.cache_lookup
        out.times = r.times() if finish_reason else None
        if sent is not None:
            out.token_ids = r.output_token_ids[sent:]
            out.logprobs = None if r.logprobs is None else r.logprobs[sent:]
            out.prompt_logprobs = r.prompt_logprobs if sent == 0 else None
        return out


class AsyncEngine:
    """`LLMEngine` behind a thread: `add_request` from asyncio, iterate the returned stream, abort it."""

    def __init__(self, config: EngineConfig, max_waiting: int = 1024, stream_interval: int = 1):
        if max_waiting < 1 or stream_interval < 1:
            raise ValueError(f"max_waiting and stream_interval must be positive, got {max_waiting}, {stream_interval}")
        self.config = config
        self.max_waiting = max_waiting
        self.stream_interval = stream_interval  # output tokens per stream event (the first and last sent at once)
        self.state = EngineState()
        self.tokenizer = None  # the asyncio side's own copy: tokenizers are not shared across threads
        self.max_model_len = 0
        self.vocab_size = 0  # the model's (its logits' width)
        self.sampling_defaults: dict = {}  # the model's generation config (LLMEngine.sampling_defaults)
        self.tasks = None  # what the model serves (LLMEngine.tasks)
        self.eos_token_ids: list[int] = []
        self.on_step: Callable[[int], None] | None = None  # called in the engine thread with each step's tokens
        self._engine: LLMEngine | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._keys = itertools.count()
        self._num_submitted = 0  # written by the asyncio side only
        self._num_added = 0  # written by the engine thread only
        self._tracked: dict[int, _Tracked] = {}  # engine thread only
        self._busy_seconds = 0.0  # engine thread only
        self._thread = threading.Thread(target=self._run, name="flock-engine", daemon=True)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._closed = False
        self._grammar_pool = ThreadPoolExecutor(1, thread_name_prefix="flock-grammar")

    # ---- any thread -------------------------------------------------------------------------------------

    def start(self) -> "AsyncEngine":
        """Build the engine in its thread (loads the model); raise what building it raised."""
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort what is left and stop the engine thread."""
        self._closed = True
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        if self._thread.is_alive():
            self._commands.put(_STOP)
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return not self._closed and self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission, submissions the engine thread has not taken yet included."""
        state = self.state
        return self._num_submitted - state.num_added + state.num_waiting

    # ---- asyncio side -----------------------------------------------------------------------------------

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams) -> RequestStream:
        """Submit a generation or an embedding request. Raises ValueError for a bad one, QueueFull, or EngineDead;
        never blocks."""
        if not self.is_running:
            raise EngineDead("the engine is not running")
        self._engine.check_request(prompt_token_ids, params)  # reads only immutable limits: safe here
        if self.num_waiting >= self.max_waiting:
            raise QueueFull(f"too many requests waiting (max_waiting={self.max_waiting}); retry later")
        stream = RequestStream(next(self._keys), self)
        self._num_submitted += 1
        self._commands.put(partial(self._add, stream, list(prompt_token_ids), params))
        return stream

    async def compile_grammar(self, spec) -> None:
        """Compile a structured-output spec into the engine's grammar cache on one worker thread (ValueError if
        rejected), so the event loop never compiles and compiling never takes more than one core from the engine;
        `add_request` then finds it compiled."""
        if not self.is_running:
            raise EngineDead("the engine is not running")
        await asyncio.get_running_loop().run_in_executor(self._grammar_pool, self._engine.grammars.compile, spec)

    def abort(self, key: int) -> None:
        self._commands.put(partial(self._abort, key))

    async def reset_prefix_cache(self) -> bool:
        """LLMEngine.reset_prefix_cache, run in the engine thread between steps."""
        return await self.call(lambda engine: engine.reset_prefix_cache())

    async def call(self, fn):
        """fn(the LLMEngine) in the engine thread between steps: its result, or its exception raised here."""
        if not self.is_running:
            raise EngineDead("the engine is not running")
        done: Future = Future()

        def run():
            try:
                done.set_result(fn(self._engine))
            except Exception as e:  # the caller's to handle; the engine goes on
                done.set_exception(e)

        self._commands.put(run)
        return await asyncio.wrap_future(done)

    # ---- engine thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._engine = LLMEngine(self.config)
            self._engine.stats.trace_steps = False  # a server runs for ever
            self.tokenizer = load_tokenizer(self._engine.tokenizer.name_or_path, self.config.chat_template)
            self.max_model_len = self._engine.max_model_len
            self.vocab_size = self._engine.vocab_size
            self.sampling_defaults = self._engine.sampling_defaults
            self.tasks = self._engine.tasks
            self.eos_token_ids = sorted(self._engine.eos_token_ids)
            self._publish()
        except BaseException as e:
            self._error = e
            return
        finally:
            self._ready.set()
        try:
            self._loop()
        except BaseException:
            log.critical("the engine thread crashed", exc_info=True)
        finally:
            self._closed = True
            self._serve_commands(block=False)  # late submissions get their abort below
            self._fail_all("abort")
            self._publish()

    def _loop(self) -> None:
        for step in run(self._engine, self._admit, self._on_step_error):
            t0 = time.perf_counter()
            self._publish()  # before the outputs: a client that has its tokens finds the step in /health
            if self.on_step is not None and step.tokens:
                self.on_step(step.tokens)
            self._emit()
            self._busy_seconds += step.seconds + time.perf_counter() - t0
            self._publish()

    def _admit(self, idle: bool) -> bool:
        """Between steps: run the queued commands, waiting for one when the engine is idle."""
        go_on = self._serve_commands(block=idle)
        if go_on and not self._engine.has_unfinished():
            self._publish()  # no step follows to publish what the commands changed
        return go_on

    def _serve_commands(self, block: bool) -> bool:
        """Run queued submissions and aborts; False once shutdown is asked for."""
        try:
            cmd = self._commands.get(block=block)
            while True:
                if cmd is _STOP:
                    return False
                cmd()
                cmd = self._commands.get_nowait()
        except queue.Empty:
            return True

    def _add(self, stream: RequestStream, prompt_token_ids: list[int], params: SamplingParams | PoolingParams) -> None:
        self._num_added += 1
        try:
            req = self._engine.add_request(prompt_token_ids, params)
        except Exception as e:  # checked on submission, so this is a bug: fail this request only
            log.exception("adding a request failed")
            self._send([(stream, StreamOutput("", len(prompt_token_ids), 0, finish_reason="error", error=str(e)))])
            return
        held = [] if req.params.include_stop_str_in_output else req.params.stop  # included: nothing to take back
        self._tracked[stream.key] = _Tracked(req, stream, TextStream(held),
                                             self._engine.kv.enable_prefix_caching and req.reads_prefix_cache)

    def _abort(self, key: int) -> None:
        self._fail(key, "abort")

    def _on_step_error(self, e: Exception) -> None:
        log.exception("engine step failed; failing the requests it was running", exc_info=e)
        self._fail_step(f"engine step failed: {e!r}")

    def _emit(self) -> None:
        outputs = []
        for key, t in list(self._tracked.items()):
            req = t.req
            if not req.is_finished and not self._due(req.num_output_tokens - t.num_sent, t.num_sent, req.params):
                continue
            sent, t.num_sent = t.num_sent, req.num_output_tokens
            text = t.text.delta(self._engine.running_text(req), req.is_finished)
            outputs.append((t.stream, t.output(text, req.finish_reason, sent=sent)))
            if req.is_finished:
                del self._tracked[key]
        self._send(outputs)

    def _due(self, new_tokens: int, sent: int, params) -> bool:
        """Whether a running request's new tokens make an event: the first at once, then every stream interval."""
        return new_tokens > 0 and (sent == 0 or new_tokens >= max(self.stream_interval, params.stream_interval or 1))

    def _fail_step(self, error: str) -> None:
        """After a failed step the requests it touched are in an unknown state: abort them all. If none was
        running (the scheduler itself failed), fail everything so the loop cannot fail forever."""
        touched = [k for k, t in self._tracked.items() if t.req.status is not RequestStatus.WAITING]
        for key in touched or list(self._tracked):
            self._fail(key, "error", error)

    def _fail_all(self, reason: str) -> None:
        for key in list(self._tracked):
            self._fail(key, reason)

    def _fail(self, key: int, reason: str, error: str | None = None) -> None:
        t = self._tracked.pop(key, None)
        if t is None:
            return
        try:
            self._engine.abort(t.req)
        except Exception:
            log.exception("aborting request %d failed", t.req.request_id)
        self._send([(t.stream, t.output("", reason, error))])

    def _publish(self) -> None:
        e = self._engine
        s = e.stats
        self.state = EngineState(
            attention=e.runner.attention_path,
            scheduler=e.scheduler.name,
            num_added=self._num_added,
            num_waiting=e.scheduler.num_waiting,
            num_running=len(e.scheduler.running),
            num_active=len(self._tracked),
            kv_blocks_used=e.kv.pool.num_used,
            kv_blocks_total=e.kv.pool.num_blocks,
            saving_rate=s.saving_rate,
            steps=s.steps,
            step_tokens=s.step_tokens,
            preemptions=s.preemptions,
            num_drafts=s.num_drafts,
            draft_tokens=s.draft_tokens,
            accepted_draft_tokens=s.accepted_draft_tokens,
            disk_read_blocks=s.disk_read_blocks,
            disk_saved_blocks=s.disk_saved_blocks,
            model_seconds=s.model_seconds,
            busy_seconds=self._busy_seconds,
        )

    @staticmethod
    def _send(outputs: list[tuple[RequestStream, StreamOutput]]) -> None:
        by_loop = defaultdict(list)
        for stream, out in outputs:
            by_loop[stream.loop].append((stream, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the loop is closed: nobody listens any more
                pass


def _deliver(items: list[tuple[RequestStream, StreamOutput]]) -> None:
    for stream, out in items:
        stream.queue.put_nowait(out)
