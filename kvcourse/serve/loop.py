"""The engine loop: one thread owns the LLMEngine and steps it while any request is unfinished.

vLLM splits its server the same way (AsyncLLM in the API process, EngineCore stepping in a busy
loop): HTTP handlers never touch the engine. They post commands (add a request, abort one) to an
inbox; the loop thread runs them between steps, steps once, and hands every request's newly
sampled tokens to that request's stream, which its handler reads in the event loop.

A request with n > 1 completions (or several prompts) is a group of child requests added in one
command, as vLLM v1's ParentRequest fans out: the children of a prompt are scheduled in the same step,
so with prefix caching on the first computes the prompt's full blocks and the others hit them. They
share one stream; each output says which child (`index`) it is for.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvcourse.core.request import Request
from kvcourse.serve.metrics import ServerMetrics
from kvcourse.worker.sampler import SamplingParams, TokenLogprobs

if TYPE_CHECKING:
    from kvcourse.engine.llm_engine import LLMEngine

log = logging.getLogger("kvcourse.serve")
IDLE_WAIT_S = 0.5  # how long an idle loop sleeps before it looks at its inbox again (it is also woken)


@dataclass
class RequestOutput:
    """What one step did for one request: its new tokens, and how it ended if it did."""

    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "length", "stop" (end of text or a stop string), "abort" or "error"
    error: str | None = None
    index: int = 0  # which completion of the request (the choice's index)
    logprobs: list[TokenLogprobs | None] | None = None  # one per new token, when the request asked for them


class RequestStream:
    """The server's side of one request (all its completions): a queue in the event loop, fed from the engine thread."""

    def __init__(self, event_loop: asyncio.AbstractEventLoop, num_children: int = 1) -> None:
        self._event_loop = event_loop
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._unfinished = num_children
        self.finished = False

    def put(self, output: RequestOutput) -> None:
        """Called by the engine thread: asyncio queues are not thread-safe, so hop onto their loop."""
        self._event_loop.call_soon_threadsafe(self._queue.put_nowait, output)

    async def get(self) -> RequestOutput:
        """The next update; the last one has finished=True."""
        output = await self._queue.get()
        self._unfinished -= output.finished
        self.finished = self._unfinished <= 0
        return output


@dataclass
class _Tracked:
    """A request in flight, as the loop follows it: how many tokens its stream has had, and when."""

    request: Request
    stream: RequestStream
    arrival: float
    eos_token_id: int | None  # stop here unless ignore_eos (None: never stop early)
    index: int = 0  # the choice this request answers
    wants_logprobs: bool = False
    sent: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    aborted: bool = False


@dataclass(frozen=True)
class EngineState:
    """The engine's counters after the latest step, safe to read from any thread."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    block_size: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    steps: int = 0
    loop_alive: bool = True
    last_error: str | None = None
    running_ids: tuple[int, ...] = field(default_factory=tuple)


class EngineLoop:
    """Owns one engine; steps it in a background thread; everything else talks to it by command."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics or ServerMetrics()
        self.state = EngineState()
        self._inbox: list[Any] = []  # commands: functions with a .future
        self._wakeup = threading.Condition()
        self._tracked: dict[int, _Tracked] = {}
        self._stopping = False
        self._refusal = "the server is shutting down: retry against a running server."  # what call() says then
        self._steps = 0
        self._last_error: str | None = None
        self.on_step: Callable[[Any], None] | None = None  # called in the engine thread after each step
        self._thread = threading.Thread(target=self._run, name="kvcourse-engine-loop", daemon=True)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start stepping (idle until a request arrives)."""
        self._publish()
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Finish the current step, then end the thread; requests still in flight end as aborted."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Whether the loop thread is running."""
        return self._thread.is_alive()

    # ------------------------------------------------------------------ commands (any thread)
    def call(self, fn: Callable[[], Any]) -> Future:
        """Run fn in the loop thread between two steps; its result (or error) comes back in a Future."""
        future: Future = Future()

        def command() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:
                    future.set_exception(exc)

        command.future = future  # so a loop that dies can fail what it never ran

        with self._wakeup:
            if self._stopping:
                future.set_exception(RuntimeError(self._refusal))
                return future
            self._inbox.append(command)
            self._wakeup.notify()
        return future

    def add(
        self,
        prompt_tokens: list[int],
        max_tokens: int,
        stream: RequestStream,
        eos_token_id: int | None,
        sampling_params: SamplingParams | None = None,
    ) -> Future:
        """Queue a request; the Future gives the engine's Request, or the engine's ValueError in words."""
        future: Future = Future()
        group = self.add_group([(prompt_tokens, sampling_params)], max_tokens, stream, eos_token_id)
        group.add_done_callback(lambda f: _copy_outcome(f, future, lambda requests: requests[0]))
        return future

    def add_group(
        self,
        children: list[tuple[list[int], SamplingParams | None]],
        max_tokens: int,
        stream: RequestStream,
        eos_token_id: int | None,
    ) -> Future:
        """Queue the completions of one HTTP request together (child i answers choice i); the Future gives them."""
        arrival = time.monotonic()

        def add_requests() -> list[Request]:
            requests = []
            try:
                for index, (tokens, params) in enumerate(children):
                    request = self.engine.add_request(tokens, max_tokens, params)
                    if eos_token_id is not None:
                        request.eos_token_id = eos_token_id  # the scheduler finishes a request at its end-of-text
                    wants = params is not None and params.logprobs is not None
                    self._tracked[request.id] = _Tracked(request, stream, arrival, eos_token_id, index, wants)
                    requests.append(request)
            except BaseException:
                for request in requests:  # all or nothing: no orphan child keeps running
                    self._tracked.pop(request.id, None)
                    _abort_in_engine(self.engine, request)
                raise
            return requests

        return self.call(add_requests)

    def abort(self, request_id: int) -> None:
        """Stop a request (its client went away): its blocks go back before the next step runs."""
        self.call(lambda: self._abort(request_id, "abort"))

    def finish(self, request_id: int, reason: str) -> None:
        """End a request the server has seen enough of (a stop string, finish_reason "stop"): its blocks go back."""
        self.call(lambda: self._abort(request_id, reason))

    # ------------------------------------------------------------------ the loop (engine thread only)
    def _run(self) -> None:
        """Run commands, step while work remains, deliver tokens; sleep when idle."""
        try:
            while True:
                with self._wakeup:
                    while not (self._inbox or self._stopping or self._has_work()):
                        self._wakeup.wait(IDLE_WAIT_S)
                    commands, self._inbox = self._inbox, []
                    stopping = self._stopping
                for command in commands:
                    command()
                if stopping:
                    break
                if self._has_work():
                    self._step()
                    self._call_on_step()
                self._publish()  # before delivering: a client that got its last token sees the cache as it is
                self._deliver()
                self._publish()
        except Exception as exc:  # a bug in the loop itself: say so (503) rather than hang every client
            log.exception("the engine loop crashed; the server answers 503 from now on")
            self._refusal = f"the engine loop stopped after an error ({type(exc).__name__}: {exc}): restart the server."
        finally:
            with self._wakeup:
                self._stopping = True  # from now on call() refuses at once instead of waiting forever
                orphans, self._inbox = self._inbox, []
            for command in orphans:
                command.future.set_exception(RuntimeError(self._refusal))
            self._close_all("the server stopped before this request finished.")

    def _close_all(self, why: str) -> None:
        """The loop is ending: every request in flight ends (aborted), best effort, then the state says so."""
        for rid in list(self._tracked):
            try:
                self._abort(rid, "abort", why)
            except Exception:
                log.exception("could not abort request %s while stopping", rid)
        try:
            self._publish(alive=False)
        except Exception:
            self.state = dataclasses.replace(self.state, loop_alive=False)

    def _call_on_step(self) -> None:
        """The observer hook (a notebook recording snapshots); its errors are logged, never fatal."""
        if self.on_step is not None:
            try:
                self.on_step(self.engine)
            except Exception:
                log.exception("on_step raised; the engine loop goes on")

    def _has_work(self) -> bool:
        return bool(self.engine.scheduler.has_unfinished_requests())

    def _step(self) -> None:
        """One engine step; a fault fails the requests it touched, and the loop keeps serving."""
        try:
            self.engine.step()
        except Exception as exc:
            self._last_error = f"{type(exc).__name__}: {exc}"
            log.error("engine step failed:\n%s", traceback.format_exc())
            self._fail_after_fault(self._last_error)
        self._steps += 1
        if self.engine.last_record is not None:  # the step's own record says whom it preempted
            self.metrics.preemptions.inc(len(self.engine.last_record.preempted))

    def _fail_after_fault(self, error: str) -> None:
        """A failed step: LLMEngine already ended the requests it touched (FAILED, with a reason)."""
        log.info("requests touched by the failed step end as errors; the others carry on (%s)", error)

    def _deliver(self) -> None:
        """Hand each request its new tokens; close the streams of requests that finished."""
        now = time.monotonic()
        for rid, tracked in list(self._tracked.items()):
            request = tracked.request
            new = list(request.output_tokens[tracked.sent :])
            if tracked.eos_token_id is not None and tracked.eos_token_id in new:
                new = new[: new.index(tracked.eos_token_id) + 1]  # nothing after end-of-text reaches the client
                if not _settled(request):
                    _abort_in_engine(self.engine, request)  # an engine that ignores EOS stops here
            if new and tracked.first_token_at is None:
                tracked.first_token_at = now
                self.metrics.ttft.observe(now - tracked.arrival)
                self.metrics.prompt_tokens.inc(request.num_prompt_tokens)  # counted at the first token, as vLLM
            elif new and tracked.last_token_at is not None:
                self.metrics.itl.observe(now - tracked.last_token_at)
            if new:
                tracked.last_token_at = now
            logprobs = self._logprobs(tracked, len(new))
            tracked.sent += len(new)
            self.metrics.generation_tokens.inc(len(new))
            if _settled(request):
                reason, error = self._finish_reason(tracked)
                self._close(rid, RequestOutput(new, True, reason, error, tracked.index, logprobs), now)
            elif new:
                tracked.stream.put(RequestOutput(new, index=tracked.index, logprobs=logprobs))

    def _logprobs(self, tracked: _Tracked, count: int) -> list[TokenLogprobs | None] | None:
        """The sampler's logprobs of a request's next `count` tokens (None unless it asked for them)."""
        if not tracked.wants_logprobs:
            return None
        recorded = self.engine.runner.sampler.logprobs(tracked.request.id)
        return [recorded.get(position) for position in range(tracked.sent, tracked.sent + count)]

    def _finish_reason(self, tracked: _Tracked) -> tuple[str, str | None]:
        """Why a finished request ended: its length, its end-of-text, or an error (with words)."""
        request = tracked.request
        tokens = request.output_tokens[: tracked.sent]
        if tracked.eos_token_id is not None and tokens and tokens[-1] == tracked.eos_token_id:
            return "stop", None
        if len(tokens) >= request.max_new_tokens:
            return "length", None
        return "error", request.reason or self._last_error or f"request ended as {request.status.name}"

    def _abort(self, request_id: int, reason: str, error: str | None = None) -> None:
        """Take a request out of the engine (blocks back now) and close its stream."""
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return  # finished already: nothing to give back
        _abort_in_engine(self.engine, tracked.request)
        tracked.aborted = True
        new = list(tracked.request.output_tokens[tracked.sent :]) if reason != "error" else []
        logprobs = self._logprobs(tracked, len(new))
        tracked.sent += len(new)
        self._publish()
        self._close(request_id, RequestOutput(new, True, reason, error, tracked.index, logprobs), time.monotonic())

    def _close(self, request_id: int, output: RequestOutput, now: float) -> None:
        """Record the request's latencies, send its last update, forget it."""
        tracked = self._tracked.pop(request_id)
        self.metrics.finished(output.finish_reason)
        if output.finish_reason in ("length", "stop"):
            self.metrics.e2e.observe(now - tracked.arrival)
            if tracked.first_token_at is not None and tracked.sent > 1:
                self.metrics.tpot.observe((now - tracked.first_token_at) / (tracked.sent - 1))
        tracked.stream.put(output)  # last: the client sees its answer only once the metrics count it

    def _publish(self, alive: bool = True) -> None:
        """Refresh the thread-safe state and the gauges from the engine."""
        engine = self.engine
        manager = engine.kv_cache_manager
        scheduler = engine.scheduler
        running = tuple(scheduler.active_pool)
        self.state = EngineState(
            num_running=len(running),
            num_waiting=len(scheduler.waiting_queue),
            num_free_blocks=int(manager.get_num_free_blocks()),
            num_blocks=int(manager.num_blocks),
            block_size=int(manager.block_size),
            kv_cache_usage=float(manager.usage),
            num_preemptions=_num_preemptions(engine),
            steps=self._steps,
            loop_alive=alive,
            last_error=self._last_error,
            running_ids=running,
        )
        self.metrics.update(self.state, manager.prefix_cache_stats)


def _copy_outcome(source: Future, target: Future, transform: Callable[[Any], Any]) -> None:
    """Resolve `target` as `source` resolved (its result transformed, or its exception)."""
    if source.exception() is not None:
        target.set_exception(source.exception())
    else:
        target.set_result(transform(source.result()))


def _settled(request: Request) -> bool:
    """Whether the engine is done with a request (finished, rejected, aborted, failed)."""
    return request.status.is_finished()


def _num_preemptions(engine: LLMEngine) -> int:
    """Preemptions over the engine's life (the scheduler counts them)."""
    return int(engine.scheduler.num_preemptions)


def _abort_in_engine(engine: LLMEngine, request: Request) -> None:
    """Finish a request early: its blocks go back at once (LLMEngine.abort)."""
    if not _settled(request):
        engine.abort(request.id, "aborted: the client went away")
