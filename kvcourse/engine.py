"""The engine loop: schedule -> execute -> update, one step at a time, recorded, timed and fault-safe.

Each step (vLLM v1's EngineCore.step, in miniature):
    batch = scheduler.schedule_next_batch()          # memory is allocated before anything runs
    tokens = executor.execute(batch, block tables)   # one forward over every scheduled token
    scheduler.update_from_output(batch, tokens)      # append samples, finish and free requests

`EngineCore` is that loop over any scheduler and any executor, and every step yields the same
`StepRecord`: notebooks 01-04 drive it with the toy model (`kvcourse.toy.run`), and `LLMEngine` with
GPT-2's `ModelRunner`. The three calls themselves are the learner's `engine_step` (kvcourse/step.py,
Exercise 1.1); `EngineCore.step` keeps the books around it and gives it `phase`, `begin_batch` and
`before_execute`.

A fault never poisons the engine. If scheduling, the executor or the update raises (a bug in an
exercise, a device error, Ctrl-C), the requests the step touched end as FAILED with a reason, every
one of their blocks goes back, and the error is re-raised with their ids in a note: the next call is
served normally. Bad input never gets that far: it is refused in words before anything is queued.

Decoding is greedy and ignores end-of-sequence (vLLM's `ignore_eos=True`, what benchmarks use):
every request gets exactly `max_new_tokens` tokens, so its output compares one to one with
Hugging Face's `model.generate(ids, do_sample=False, max_new_tokens=n, eos_token_id=None)` for that
prompt alone (`hf_greedy` below).
"""

from __future__ import annotations

import contextlib
import numbers
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tqdm import tqdm

from kvcourse.kv_cache_interface import ExecutorProtocol, SchedulerProtocol, blocks_needed
from kvcourse.request import Request, RequestStatus, validate_max_new_tokens, validate_prompt_tokens

if TYPE_CHECKING:
    import torch

    from kvcourse.kv_cache import KVCacheManager
    from kvcourse.sampler import SamplingParams

Prompt = str | Sequence[int]
PROGRESS_MIN_TOKENS = 256  # show a progress bar by default when a run generates at least this many tokens
# The parts of a step, timed (EngineStats.step_seconds), and how a fault report names each (EngineCore.phase).
PHASE_LABELS = {"schedule": "scheduling", "execute": "the executor (the model)", "update": "update_from_output"}
PHASES = tuple(PHASE_LABELS)


# ----------------------------------------------------------------------------------------------
# What a step did: one record type for the toy world and the GPT-2 engine
# ----------------------------------------------------------------------------------------------


@dataclass
class StepRecord:
    """What one iteration did, for printing and plotting."""

    iteration: int
    scheduled: list[tuple[int, str, int]]  # (request id, "prefill" or "decode", tokens fed)
    positions: list[tuple[int, int]]  # (first, last) position of each scheduled sequence
    samples: list[bool]  # whether each scheduled sequence sampled a token
    resident_tokens: int  # tokens whose K/V the running requests hold during this step
    num_free_blocks: int | None  # after the step (None for a scheduler without a KV manager)
    preempted: list[int]  # request ids preempted while planning this step
    num_preemptions: int  # total so far
    finished: list[int]  # request ids finished by this step
    seconds: dict[str, float] = field(default_factory=dict)  # wall time of each phase (see PHASES)

    @property
    def num_tokens(self) -> int:
        """Tokens fed in this step (at most the token budget)."""
        return sum(n for _, _, n in self.scheduled)

    def __str__(self) -> str:
        """One readable line (see format_step)."""
        return format_step(self)


@dataclass
class Trace:
    """Everything a run did, step by step, plus the requests it saw."""

    steps: list[StepRecord] = field(default_factory=list)
    requests: dict[int, Request] = field(default_factory=dict)
    capacity_blocks: int | None = None
    block_size: int | None = None

    @property
    def num_preemptions(self) -> int:
        """Preemptions over the whole run."""
        return self.steps[-1].num_preemptions if self.steps else 0

    @property
    def peak_resident_tokens(self) -> int:
        """The most KV the running requests held at once."""
        return max((s.resident_tokens for s in self.steps), default=0)

    def outputs(self) -> dict[int, list[int]]:
        """Every seen request's generated tokens, by id."""
        return {rid: list(r.output_tokens) for rid, r in sorted(self.requests.items())}

    def format(self, limit: int | None = None) -> str:
        """One readable line per iteration (the first `limit` ones when given)."""
        steps = self.steps if limit is None else self.steps[:limit]
        lines = [format_step(step) for step in steps]
        if limit is not None and len(self.steps) > limit:
            lines.append(f"... {len(self.steps) - limit} more iterations")
        return "\n".join(lines)

    def __iter__(self) -> Iterator[StepRecord]:
        """The steps, so `print(*engine.trace, sep="\\n")` prints one line each."""
        return iter(self.steps)

    def __len__(self) -> int:
        """Number of steps recorded."""
        return len(self.steps)


def format_step(step: StepRecord) -> str:
    """`it  3 | R0 decode @15 | R1 prefill 16 @0-15 | free 93` (* = samples a token)."""
    parts = []
    for (rid, kind, n), (first, last), samples in zip(step.scheduled, step.positions, step.samples):
        where = f"@{first}" if first == last else f"@{first}-{last}"
        size = "" if kind == "decode" else f" {n}"
        parts.append(f"R{rid} {kind}{size} {where}{'*' if samples and kind != 'decode' else ''}")
    line = f"it {step.iteration:>3} | " + (", ".join(parts) if parts else "nothing scheduled")
    if step.num_free_blocks is not None:
        line += f" | free {step.num_free_blocks}"
    if step.preempted:
        line += f" | preempted {', '.join(f'R{r}' for r in step.preempted)}"
    if step.finished:
        line += f" | finished {', '.join(f'R{r}' for r in step.finished)}"
    return line


class Deadlock(RuntimeError):
    """The scheduler planned an empty step while requests were unfinished: nothing can ever change."""

    trace: Trace | None = None  # the steps before the stall (set by `kvcourse.toy.run`)


class BatchContractError(RuntimeError):
    """The scheduler returned a batch entry for a request that is not running (a scheduler bug)."""


def describe_stall(scheduler: SchedulerProtocol, iteration: int) -> str:
    """Why the run cannot go on, in words a learner can act on."""
    running = list(scheduler.active_pool)
    waiting = [r.id for r in scheduler.waiting_queue]
    manager = scheduler.kv_cache_manager
    free = f"; {manager.get_num_free_blocks()} of {manager.num_blocks} blocks free" if manager is not None else ""
    head = (
        f"iteration {iteration}: the scheduler planned an empty batch with requests unfinished "
        f"(running {running}, waiting {waiting}{free})"
    )
    if running and manager is not None and manager.get_num_free_blocks() > 0:
        return (
            f"{head}: blocks are free, yet no running request was given anything to do. Does every "
            "running request land in exactly one pass: a decode once its prompt is cached, else the "
            "prefill pass (a request recomputing after a preemption has output tokens to re-feed too: "
            "see request.is_prefill_done and num_uncomputed_tokens)? The next step would be the same."
        )
    if running:
        return (
            f"{head}: each running request needs one more block, only another running request could "
            "give one back, and none of them can run to the end to do so. The next step would be the "
            "same: a deadlock."
        )
    return (
        f"{head}: nothing is running and nothing was admitted. A correct scheduler moves its oldest "
        "request forward every step; is a request that can never fit the cache in the way?"
    )


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------


class EngineCore:
    """One scheduler and one executor, stepped together: each step recorded, timed, and safe to fail."""

    def __init__(
        self,
        scheduler: SchedulerProtocol,
        executor: ExecutorProtocol,
        before_execute: Callable[[], None] | None = None,
    ) -> None:
        """before_execute runs right before each batch (the GPT-2 engine applies copy-on-write copies there)."""
        self.scheduler = scheduler
        self.executor = executor
        self._before_execute_hook = before_execute
        self.on_schedule: Callable[[StepRecord], None] | None = None  # sees each step's plan before it runs
        self.last_batch: list = []  # the latest step's scheduled sequences
        self.iteration = 0
        self.num_failed = 0  # requests ended by a fault, over the core's life
        self.trace = self.new_trace()
        # This step's books, kept for engine_step's helpers: seconds per phase, preemptions so far, the plan.
        self._seconds: dict[str, float] = {}
        self._preemptions_before: dict[int, int] = {}
        self._plan: StepRecord | None = None
        self._handled: BaseException | None = None  # the fault a phase already cleaned up after

    def new_trace(self) -> Trace:
        """An empty trace that knows the cache's size (for plots)."""
        manager = self.scheduler.kv_cache_manager
        if manager is None:
            return Trace()
        return Trace(capacity_blocks=manager.num_blocks, block_size=manager.block_size)

    def remember(self, requests: Iterable[Request]) -> None:
        """List requests in the trace (so `trace.outputs()` covers them)."""
        for request in requests:
            self.trace.requests.setdefault(request.id, request)

    def step(self) -> StepRecord:
        """Schedule, execute and update once (engine_step, Exercise 1.1); raises Deadlock when nothing can be scheduled."""
        from kvcourse.step import engine_step  # imported here: kvcourse/step.py imports this module

        self.iteration += 1
        self._seconds, self._plan, self._handled = {}, None, None
        self._preemptions_before = {r.id: r.num_preemptions for r in self._unfinished()}
        with self._fail_unless_handled():
            finished = engine_step(self)
            record = self._finish_record(finished)
        return record

    # ---- what engine_step (Exercise 1.1) is given ----
    @contextlib.contextmanager
    def phase(self, name: str, requests: Iterable[Request] | None = None) -> Iterator[None]:
        """Time one phase of the step; if it raises, fail `requests` (for "schedule": whom planning touched)."""
        if name not in PHASE_LABELS:
            raise ValueError(f"unknown phase {name!r}: the phases are {', '.join(PHASE_LABELS)}.")
        if requests is None and name != "schedule":
            raise ValueError(f"phase {name!r} needs the batch's requests (core.begin_batch(batch) returns them).")
        if requests is not None:
            requests = list(requests)
            if not all(isinstance(r, Request) for r in requests):
                raise TypeError(
                    f"core.phase({name!r}, requests) takes the batch's Request objects (what core.begin_batch(batch) "
                    f"returns), not {type(next(r for r in requests if not isinstance(r, Request))).__name__} entries."
                )
        affected = self._touched_by_planning if requests is None else (lambda: requests)
        with self._timed(name, self._seconds), self._fail_on_error(PHASE_LABELS[name], affected):
            yield

    def begin_batch(self, batch: list) -> list[Request]:
        """Check the scheduler's contract on a planned batch, record the plan; the batch's requests, in order."""
        with self._fail_on_error("scheduling", self._touched_by_planning):
            self._check_batch(batch)
        self.last_batch = batch
        self._plan = self._record(batch, self._preemptions_before, self._seconds)
        return [self.scheduler.active_pool[seq.request_id] for seq in batch]

    def before_execute(self) -> None:
        """Between planning and the model: the live views see the plan, pending block copies are applied."""
        if self.on_schedule is not None and self._plan is not None:
            self.on_schedule(self._plan)
        if self._before_execute_hook is not None:
            self._before_execute_hook()

    def fail_requests(self, requests: Sequence[Request], reason: str) -> list[Request]:
        """End requests after a fault: FAILED, blocks back, and no later prefix hit reads a block never written."""
        failed = self.end_requests(requests, RequestStatus.FAILED, reason)
        _forget_free_cached_blocks(self.scheduler.kv_cache_manager)
        self.num_failed += len(failed)
        return failed

    def end_requests(self, requests: Sequence[Request], status: RequestStatus, reason: str) -> list[Request]:
        """End requests through the scheduler's finish_requests; if that cannot (Exercise 7.4 unwritten or
        faulty), the engine does it itself: recovering from a fault must not depend on the learner's abort."""
        try:
            return self.scheduler.finish_requests([r.id for r in requests], status, reason)
        except Exception:
            return self._end_requests_here(requests, status, reason)

    # ---- helpers ----
    def _finish_record(self, finished: object) -> StepRecord:
        """Complete this step's record once engine_step returned (with a clear error when it broke its contract)."""
        if self._plan is None:
            raise BatchContractError(
                "engine_step returned without calling core.begin_batch(batch): the step's plan was never checked "
                "or recorded. Call it on the planned batch before running it (Exercise 1.1)."
            )
        if not isinstance(finished, list) or not all(isinstance(r, Request) for r in finished):
            raise TypeError(
                f"engine_step returned {finished!r}; it must return the list of requests the scheduler's "
                "update_from_output returned (those finished this step), as Exercise 1.1 says."
            )
        record = self._plan
        record.finished = [r.id for r in finished]
        manager = self.scheduler.kv_cache_manager
        record.num_free_blocks = manager.get_num_free_blocks() if manager is not None else None
        return record

    @contextlib.contextmanager
    def _fail_unless_handled(self) -> Iterator[None]:
        """A fault outside every phase (a slip in engine_step) still fails whom the step touched, once."""
        try:
            yield
        except Deadlock:
            raise  # nothing was planned: the requests are as they were
        except BaseException as error:
            touched = [r for r in self._touched_by_planning() if not r.status.is_finished()]
            if error is self._handled or not touched:  # already cleaned up, or nothing to clean (an unwritten step)
                raise
            with self._fail_on_error("engine_step (Exercise 1.1), outside its phases", lambda: touched):
                raise

    def _end_requests_here(self, requests: Sequence[Request], status: RequestStatus, reason: str) -> list[Request]:
        """The engine's own clean-up: out of the running set and the queue, blocks back, settled with a reason."""
        scheduler, ended = self.scheduler, []
        for request in requests:
            if request.status.is_finished():
                continue
            scheduler.active_pool.pop(request.id, None)
            if request in scheduler.waiting_queue:
                scheduler.waiting_queue.remove(request)
            if scheduler.kv_cache_manager is not None:
                scheduler.kv_cache_manager.free(request)
            request.status, request.reason = status, reason
            scheduler.finished.append(request)
            ended.append(request)
        return ended

    def _unfinished(self) -> list[Request]:
        """Running then waiting requests."""
        return list(self.scheduler.active_pool.values()) + list(self.scheduler.waiting_queue)

    def _touched_by_planning(self) -> list[Request]:
        """After a fault while planning: the running requests and any waiting one the plan reached."""
        manager = self.scheduler.kv_cache_manager
        return list(self.scheduler.active_pool.values()) + [
            r
            for r in self.scheduler.waiting_queue
            if r.num_computed_tokens or (manager is not None and manager.get_block_ids(r))
        ]

    def _check_batch(self, batch: list) -> None:
        """The scheduler's contract: a batch holds only RUNNING requests (never one preempted while planning)."""
        for seq in batch:
            if seq.request_id not in self.scheduler.active_pool:
                raise BatchContractError(
                    f"the scheduler's batch contains request {seq.request_id}, which is not running (preempted "
                    "while planning the same step?): its blocks are gone, so it cannot run. A batch may only "
                    "hold running requests: a request preempted after being scheduled must leave the batch."
                )

    def _record(self, batch: list, preemptions_before: dict[int, int], seconds: dict[str, float]) -> StepRecord:
        """The step as planned (what ran; finished and free blocks are filled in after the update)."""
        running = list(self.scheduler.active_pool.values())
        self.remember(running)
        return StepRecord(
            iteration=self.iteration,
            scheduled=[(s.request_id, "decode" if s.is_decode else "prefill", len(s.tokens)) for s in batch],
            positions=[(s.position_ids_start, s.position_ids_start + len(s.tokens) - 1) for s in batch],
            samples=[bool(s.samples_token) for s in batch],
            resident_tokens=sum(r.num_computed_tokens for r in running),
            num_free_blocks=None,
            preempted=[
                r.id for r in self._unfinished() if r.num_preemptions > preemptions_before.get(r.id, r.num_preemptions)
            ],
            num_preemptions=self.scheduler.num_preemptions,
            finished=[],
            seconds=seconds,
        )

    @contextlib.contextmanager
    def _timed(self, phase: str, seconds: dict[str, float]) -> Iterator[None]:
        """Add the wall time of a phase to this step's record."""
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds[phase] = time.perf_counter() - start

    @contextlib.contextmanager
    def _fail_on_error(self, phase: str, affected: Callable[[], list[Request]]) -> Iterator[None]:
        """If the phase raises, end the requests it touched as FAILED (blocks back), then re-raise with their ids."""
        try:
            yield
        except Deadlock:
            raise  # a stall changed nothing: nobody to fail
        except BaseException as error:  # Ctrl-C mid-step leaves the same half-done state
            victims = [r for r in affected() if not r.status.is_finished()]
            reason = f"step {self.iteration} failed in {phase}: {type(error).__name__}: {error}"
            try:
                self.fail_requests(victims, reason)
                outcome = "were marked FAILED and their blocks given back; the engine can take new work"
            except Exception as cleanup_error:  # report both; the first error is the one to fix
                outcome = f"could not be cleaned up ({type(cleanup_error).__name__}: {cleanup_error})"
            error.add_note(
                f"kvcourse: step {self.iteration} failed in {phase}; requests {[r.id for r in victims]} {outcome}."
            )
            self._handled = error
            raise


def _forget_free_cached_blocks(manager: object) -> None:
    """After a fault: blocks published for a step that never ran hold no K/V; unpublish every block nobody holds.

    (A block a surviving request holds was written in an earlier step: a block published in the failed
    step is held only by requests of that step, which have just failed.)
    """
    from kvcourse.kv_cache import KVCacheManager  # here, not at the top: the toy world may not have it

    if not isinstance(manager, KVCacheManager):
        return  # the mock manager caches nothing
    for block in manager.block_pool.blocks:
        if block.ref_cnt == 0 and block.block_hash is not None:
            manager.block_pool._maybe_evict_cached_block(block)
    manager.take_pending_copies()  # copies planned for a step that never ran


# ----------------------------------------------------------------------------------------------
# GPT-2 through the loop
# ----------------------------------------------------------------------------------------------


@dataclass
class EngineStats:
    """What the engine did since the last generate() (or since it was built): steps, tokens, time."""

    iterations: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    scheduled_tokens: int = 0  # tokens fed to the model (prefill chunks, recomputes and decodes)
    preemptions: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache instead of the model
    failed_requests: int = 0  # ended by a fault inside a step (see Request.reason)
    step_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))  # summed per phase


class LLMEngine:
    """Greedy generation for GPT-2 through our scheduler, paged KV cache and paged attention."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_blocks: int,
        block_size: int = 16,
        token_budget: int = 512,
        max_batch_size: int = 16,
        enable_prefix_caching: bool = False,
        attention: str = "fast",  # the fastest backend; "reference" runs the learner's exercises 5.2-5.3
        tokenizer=None,
        pack_weights: bool | None = None,  # None: oneDNN-packed linear layers where they pay (CPU, float32)
    ) -> None:
        # Imported here, not at the top: the toy world uses EngineCore without torch or transformers.
        from kvcourse.kv_cache import KVCacheManager
        from kvcourse.model_runner import ModelRunner
        from kvcourse.scheduler import StallFreeScheduler

        self.model = model
        self.tokenizer = tokenizer
        self.kv_cache_manager: KVCacheManager = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = StallFreeScheduler(token_budget, max_batch_size, self.kv_cache_manager)
        # Passed only when set: a learner's model_runner.py from before packing existed still works.
        packing = {} if pack_weights is None else {"pack_weights": pack_weights}
        self.runner = ModelRunner(model, num_blocks, block_size, attention, **packing)
        self.core = EngineCore(self.scheduler, self.runner, before_execute=self._apply_block_copies)
        self.max_positions = int(model.config.n_positions)
        self.vocab_size = int(model.config.vocab_size)
        self.stats = EngineStats()
        self._next_request_id = 0
        self._requests: dict[int, Request] = {}  # every request this engine was given, by id

    @property
    def trace(self) -> Trace:
        """The steps of the last generate(trace=True) (print them with `print(*engine.trace, sep="\\n")`)."""
        return self.core.trace

    # ------------------------------------------------------------------ public
    def generate(
        self,
        prompts: Sequence[Prompt],
        max_new_tokens: int,
        *,
        sampling_params: SamplingParams | None = None,
        progress: bool | None = None,
        trace: bool = False,
    ) -> list[list[int]]:
        """The continuation of every prompt (token ids), in the order given: greedy unless sampling_params says otherwise.

        prompts: strings (encoded with the tokenizer, GPT-2's by default) or lists of token ids.
        sampling_params: kvcourse.sampler.SamplingParams for every prompt (None: greedy, equal to hf_greedy).
        Every prompt is checked before any is queued: a bad one raises ValueError and nothing runs.
        progress: a tqdm bar on stderr; None shows it for runs of PROGRESS_MIN_TOKENS tokens or more.
        trace: record every step in `self.trace` (print them with `print(*engine.trace, sep="\\n")`).
        """
        token_lists = self._validate(prompts, max_new_tokens)
        params = _check_sampling_params(sampling_params)
        requests = [self._add_request(tokens, max_new_tokens, params) for tokens in token_lists]
        self.stats = EngineStats(prompt_tokens=sum(map(len, token_lists)))
        self.core.trace, self.core.iteration = self.core.new_trace(), 0  # steps count from 1 in each call
        self.core.remember(requests)
        show = sum(r.max_new_tokens for r in requests) >= PROGRESS_MIN_TOKENS if progress is None else progress
        bar = tqdm(
            total=len(requests) * max_new_tokens,
            desc="generating",
            unit="tok",
            file=sys.stderr,
            disable=not show,
            leave=False,
        )
        try:
            while self.scheduler.has_unfinished_requests():
                bar.update(self.step(trace=trace))
        except BaseException as error:  # the step already failed its own requests: end the rest of this call
            self._abort_unsettled(requests, f"generate() stopped: {type(error).__name__} in a step")
            raise
        finally:
            bar.close()
        return [list(r.output_tokens) for r in requests]

    def add_request(
        self, prompt: Prompt, max_new_tokens: int, sampling_params: SamplingParams | None = None
    ) -> Request:
        """Queue one prompt without running it (drive the engine with step(), as a server or benchmark does)."""
        [tokens] = self._validate([prompt], max_new_tokens, where="the prompt")
        return self._add_request(tokens, max_new_tokens, _check_sampling_params(sampling_params))

    def step(self, trace: bool = False) -> int:
        """Schedule, run and update once; returns how many tokens were sampled (read them in request.output_tokens)."""
        preemptions_before = self.scheduler.num_preemptions
        hits_before = self.kv_cache_manager.prefix_cache_stats.hits
        failed_before = self.core.num_failed
        try:
            record = self.core.step()
        except Deadlock as stall:  # a scheduler bug: end what is stuck, so the engine can serve again
            stuck = list(self.scheduler.active_pool.values()) + list(self.scheduler.waiting_queue)
            self.core.fail_requests(stuck, f"deadlock: {stall}")
            stall.add_note(f"kvcourse: requests {[r.id for r in stuck]} were marked FAILED and their blocks freed.")
            raise
        finally:
            self.stats.failed_requests += self.core.num_failed - failed_before
        self.stats.iterations += 1
        self.stats.preemptions += self.scheduler.num_preemptions - preemptions_before
        self.stats.prefix_hit_tokens += self.kv_cache_manager.prefix_cache_stats.hits - hits_before
        self.stats.scheduled_tokens += record.num_tokens
        num_sampled = sum(record.samples)
        self.stats.generated_tokens += num_sampled
        for phase, seconds in record.seconds.items():
            self.stats.step_seconds[phase] = self.stats.step_seconds.get(phase, 0.0) + seconds
        if trace:
            self.core.trace.steps.append(record)
        return num_sampled

    def abort(self, request_id: int, reason: str = "aborted by the caller") -> Request:
        """Stop a request now (a client went away): status ABORTED with the reason, its blocks back at once.

        Aborting a request that has already finished, failed or been aborted changes nothing.
        """
        if request_id not in self._requests:
            raise ValueError(
                f"request {request_id!r} is unknown to this engine; abort an id that add_request returned."
            )
        self.scheduler.finish_requests([request_id], RequestStatus.ABORTED, reason)
        return self._requests[request_id]

    def has_unfinished_requests(self) -> bool:
        """Whether any request is still waiting or running (a server steps while this is true)."""
        return self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------------ helpers
    def _validate(self, prompts: Sequence[Prompt], max_new_tokens: int, where: str | None = None) -> list[list[int]]:
        """Every prompt as token ids, or a ValueError in words for the first bad one, before anything is queued."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise ValueError(
                f"prompts is {type(prompts).__name__}; give a list of prompts (strings or token-id lists), "
                "even for one prompt."
            )
        if prompts and isinstance(prompts[0], numbers.Integral) and not isinstance(prompts[0], bool):
            raise ValueError("prompts must be a list of prompts (strings or token-id lists), even for one prompt.")
        max_new_tokens = validate_max_new_tokens(max_new_tokens, minimum=1)
        token_lists = [self._encode(prompt, where or f"prompt {i}") for i, prompt in enumerate(prompts)]
        for i, tokens in enumerate(token_lists):
            self._check_fits(tokens, max_new_tokens, where or f"prompt {i}")
        return token_lists

    def _encode(self, prompt: Prompt, where: str) -> list[int]:
        """Token ids for one prompt; strings go through the tokenizer (GPT-2's unless another was given)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                from kvcourse.models import load_tokenizer

                self.tokenizer = load_tokenizer()
            prompt = self.tokenizer.encode(prompt)
        return validate_prompt_tokens(prompt, self.vocab_size, where=where)

    def _check_fits(self, tokens: list[int], max_new_tokens: int, where: str) -> None:
        """Refuse what could never be served (too long for the model or the cache), saying how to fix it."""
        manager = self.kv_cache_manager
        total = len(tokens) + max_new_tokens
        if total > self.max_positions:
            raise ValueError(
                f"{where} has {len(tokens)} tokens and asks for {max_new_tokens} more, but the model's "
                f"context holds {self.max_positions} positions (config.n_positions): shorten the prompt "
                "or lower max_new_tokens."
            )
        if blocks_needed(total, manager.block_size) > manager.num_blocks:
            raise ValueError(
                f"{where} needs {blocks_needed(total, manager.block_size)} blocks of {manager.block_size} "
                f"tokens at its longest, but the cache has {manager.num_blocks}: raise num_blocks, "
                "shorten the prompt or lower max_new_tokens."
            )

    def _add_request(
        self, tokens: list[int], max_new_tokens: int, sampling_params: SamplingParams | None = None
    ) -> Request:
        """Hand one prompt to the scheduler under a fresh id (ids never repeat across generate calls)."""
        request = Request(id=self._next_request_id, prompt_tokens=tokens, max_new_tokens=max_new_tokens)
        request.sampling_params = sampling_params
        self._next_request_id += 1
        self._requests[request.id] = request
        self.runner.sampler.add_request(request)
        self.scheduler.add_request(request)
        return request

    def _abort_unsettled(self, requests: list[Request], reason: str) -> None:
        """End the requests that are still waiting or running (what a failed generate() call leaves behind)."""
        self.core.end_requests([r for r in requests if not r.status.is_finished()], RequestStatus.ABORTED, reason)

    def _apply_block_copies(self) -> None:
        """Copy-on-write: the manager lists (src, dst) blocks whose contents must be duplicated first."""
        for src, dst in self.kv_cache_manager.take_pending_copies():
            for layer in self.runner.kv_cache.layers:
                layer.keys[dst] = layer.keys[src]
                layer.values[dst] = layer.values[src]


def _check_sampling_params(params: object) -> SamplingParams | None:
    """The request's SamplingParams (None: greedy), or a ValueError saying what to pass."""
    from kvcourse.sampler import SamplingParams

    if params is not None and not isinstance(params, SamplingParams):
        raise ValueError(
            f"sampling_params is {type(params).__name__}; pass kvcourse.sampler.SamplingParams(temperature=..., "
            "top_p=..., seed=...) or None for greedy."
        )
    return params


def hf_greedy(model: torch.nn.Module, prompt_tokens: Sequence[int], max_new_tokens: int) -> list[int]:
    """Hugging Face's own greedy generate for one prompt, EOS ignored like the engine: the reference to match."""
    import torch

    input_ids = torch.tensor([list(prompt_tokens)], device=next(model.parameters()).device)
    with torch.inference_mode():
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=model.config.eos_token_id or 0,
        )
    return output[0, input_ids.shape[1] :].tolist()
