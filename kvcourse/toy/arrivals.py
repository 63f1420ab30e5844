"""Requests that arrive while the engine runs, on a clock: what a server sees, and what TTFT and TPOT measure.

`serve(scheduler, arrivals, clock)` is the engine's own loop (`EngineCore`) with one addition: before
each step, every request whose arrival time has passed joins the scheduler (vLLM's engine does the same
between steps). `serve_engine(engine, arrivals, clock)` does the same for GPT-2's `LLMEngine`, through
its `add_request` and `step`. The clock is

* `SimulatedClock(step_cost)`: each step moves time on by `step_cost(tokens fed)` seconds (plus a swap's
  transfers), so a run on a CPU is deterministic and a notebook's outputs never change;
* `WallClock()`: the real time (a GPU run), where a step takes what it takes.

Each request's `RequestTimes` records its arrival and the time of every token it got, from which come
vLLM's serving metrics: TTFT, TPOT, ITL and end-to-end latency.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvcourse.core.contract import SchedulerProtocol
from kvcourse.core.request import Request
from kvcourse.core.sched_output import SchedulerOutput
from kvcourse.engine.llm_engine import EngineCore, StepRecord, Trace
from kvcourse.toy.executor import ToyExecutor


@dataclass
class RequestTimes:
    """When one request arrived, got each token, and finished (seconds on the run's clock)."""

    request_id: int
    arrival: float
    prompt_len: int
    token_times: list[float] = field(default_factory=list)
    priority: int = 0

    @property
    def ttft(self) -> float:
        """Time to first token: queueing plus the whole prefill."""
        return self.token_times[0] - self.arrival

    @property
    def tpot(self) -> float:
        """Time per output token after the first (0 for a one-token request)."""
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else 0.0

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies: the gaps a streaming client sees."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def e2e(self) -> float:
        """End-to-end latency: arrival to last token."""
        return self.token_times[-1] - self.arrival


@dataclass(frozen=True)
class StepCost:
    """Seconds one engine step takes: a fixed part (launches, Python) plus a part per token fed."""

    fixed_s: float
    per_token_s: float

    def __call__(self, num_tokens: int) -> float:
        """The step's duration."""
        return self.fixed_s + self.per_token_s * num_tokens


class SimulatedClock:
    """Time that moves only when a step runs: by the step-cost model, plus any swap transfers."""

    def __init__(
        self, step_cost: Callable[[int], float], transfer_seconds: Callable[[int, int], float] | None = None
    ) -> None:
        """transfer_seconds(transfers, tokens) prices a step's swaps (out and in); None when nothing is swapped."""
        self.step_cost = step_cost
        self.transfer_seconds = transfer_seconds
        self.now = 0.0

    def wait_until(self, moment: float) -> None:
        """Idle: jump to the next arrival."""
        self.now = max(self.now, moment)

    def after_step(self, num_tokens: int, num_transfers: int = 0, transferred_tokens: int = 0) -> None:
        """The step's tokens, and the swap transfers it made, cost time."""
        self.now += self.step_cost(num_tokens)
        if self.transfer_seconds is not None and num_transfers:
            self.now += self.transfer_seconds(num_transfers, transferred_tokens)


class WallClock:
    """The real time since the run started (what a GPU run measures)."""

    def __init__(self) -> None:
        """Start counting now."""
        self.start = time.perf_counter()

    @property
    def now(self) -> float:
        """Seconds since the start."""
        return time.perf_counter() - self.start

    def wait_until(self, moment: float) -> None:
        """Idle until the next arrival (a server would block on its queue)."""
        time.sleep(max(0.0, moment - self.now))

    def after_step(self, num_tokens: int, num_transfers: int = 0, transferred_tokens: int = 0) -> None:
        """The step already took its real time."""


class UnpagedToyExecutor(ToyExecutor):
    """The toy model with a cache per request: a swapped-out request's K/V survives (as if in the CPU pool)."""

    def execute_batch(self, batch, block_tables=None) -> dict[int, int]:
        """Ignore block tables: each request reads its own list, checked position by position."""
        return super().execute_batch(batch, None)


@dataclass
class ServingRun:
    """What a run under arrivals produced: the step trace and every request's times."""

    trace: Trace
    times: list[RequestTimes]
    duration_s: float


def serve(
    scheduler: SchedulerProtocol,
    arrivals: Sequence[tuple[float, Request]],
    clock: SimulatedClock | WallClock,
    executor: ToyExecutor | None = None,
    max_iterations: int = 1_000_000,
) -> ServingRun:
    """Serve requests as they arrive: before each step, everyone whose arrival time has passed joins the queue."""
    _check_arrival_times(arrivals)
    executor = executor if executor is not None else UnpagedToyExecutor()
    core = EngineCore(scheduler, executor)

    def step() -> tuple[StepRecord, SchedulerOutput]:
        record = core.step()
        core.trace.steps.append(record)
        for request_id in record.finished:
            executor.release(request_id)
        return record, core.last_output

    def add(request: Request) -> Request:
        scheduler.add_request(request)
        return request

    times = _loop(scheduler, arrivals, add, step, clock, lambda: core.iteration, max_iterations)
    return ServingRun(core.trace, times, clock.now)


def serve_engine(
    engine,
    arrivals: Sequence[tuple[float, Sequence[int] | str, int]],
    clock: SimulatedClock | WallClock,
    max_iterations: int = 1_000_000,
) -> ServingRun:
    """GPT-2 under arrivals: (time, prompt, max_new_tokens) triples join `engine` (an LLMEngine) between its steps.

    With `WallClock()` this is what a GPU run measures; with a `SimulatedClock` a CPU run is deterministic.
    Preemption is recompute only here (the GPT-2 engine's scheduler keeps its defaults).
    """
    _check_arrival_times(arrivals)
    trace = engine.core.trace = engine.core.new_trace()
    pairs = [(t, (prompt, max_new_tokens)) for t, prompt, max_new_tokens in arrivals]

    def step() -> tuple[StepRecord, SchedulerOutput]:
        engine.step(trace=True)
        return trace.steps[-1], engine.core.last_output

    def add(item: tuple) -> Request:
        request = engine.add_request(*item)
        trace.requests[request.id] = request
        return request

    times = _loop(engine.scheduler, pairs, add, step, clock, lambda: len(trace.steps), max_iterations)
    return ServingRun(trace, times, clock.now)


def _check_arrival_times(arrivals: Sequence[tuple]) -> None:
    """Arrival times are offsets from the start of the run."""
    if any(item[0] < 0 for item in arrivals):
        raise ValueError("arrival times are seconds from the start of the run; they must be 0 or more.")


def _loop(scheduler, arrivals, add, step, clock, steps_done, max_iterations: int) -> list[RequestTimes]:
    """The serving loop: admit what has arrived, step (or idle until the next arrival), stamp each sampled token."""
    pending = deque(sorted(arrivals, key=lambda pair: pair[0]))
    times: dict[int, RequestTimes] = {}
    while pending or scheduler.has_unfinished_requests():
        while pending and pending[0][0] <= clock.now:
            arrival, item = pending.popleft()
            if isinstance(item, Request):
                item.arrival_time = arrival
            request = add(item)
            request.arrival_time = arrival
            times[request.id] = RequestTimes(request.id, arrival, request.num_prompt_tokens, priority=request.priority)
        if not scheduler.has_unfinished_requests():
            if pending:
                clock.wait_until(pending[0][0])
            continue
        if steps_done() >= max_iterations:
            raise RuntimeError(f"the run did not finish within {max_iterations} steps; is the scheduler stuck?")
        record, plan = step()  # the step's record and its plan (the plan says what was swapped)
        transfers = len(plan.swapped_out) + len(plan.swapped_in)
        clock.after_step(record.num_tokens, transfers, sum(plan.swapped_out.values()) + sum(plan.swapped_in.values()))
        for (request_id, _, _), samples in zip(record.scheduled, record.samples):
            if samples:
                times[request_id].token_times.append(clock.now)
    return [times[rid] for rid in sorted(times)]
