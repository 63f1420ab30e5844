"""The engine loop: schedule -> execute -> update, one step at a time, recorded, timed and fault-safe.

Each step (vLLM v1's EngineCore.step, in miniature):
    scheduler_output = scheduler.schedule_next_batch()         # the plan, memory allocated before anything runs
    sampled = executor.execute(scheduler_output)               # one forward over every scheduled token
    scheduler.update_from_output(scheduler_output, sampled)    # append samples, finish and free requests

`EngineCore` is that loop over any scheduler and any executor, and every step yields the same
`StepRecord`: notebooks 01-04 drive it with the toy model (`kvcourse.toy.run`), and `LLMEngine` with
the model's `ModelRunner`. The three calls themselves are the learner's `engine_step` (kvcourse/step.py,
Exercise 1.1); `EngineCore` keeps the books around them: `core.phase(name, scheduler_output)` times
each phase, checks and records the plan as the execute phase begins, and isolates faults.

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
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tqdm import tqdm

from kvcourse import step as step_module  # looked up at each step: a learner's edit (autoreload) is seen
from kvcourse.core.contract import ExecutorProtocol, SchedulerProtocol, blocks_needed
from kvcourse.core.records import (
    PHASE_LABELS,
    PHASES,
    BatchContractError,
    Deadlock,
    StepRecord,
    Trace,
    describe_stall,
    format_step,
)
from kvcourse.core.request import Request, RequestStatus, validate_max_new_tokens, validate_prompt_tokens
from kvcourse.core.sched_output import SchedulerOutput

if TYPE_CHECKING:
    import torch

    from kvcourse.kv_cache import KVCacheManager
    from kvcourse.worker.sampler import SamplingParams

Prompt = str | Sequence[int]
PROGRESS_MIN_TOKENS = 256  # show a progress bar by default when a run generates at least this many tokens
# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------


class EngineCore:
    """One scheduler and one executor, stepped together: each step recorded, timed, and safe to fail."""

    def __init__(self, scheduler: SchedulerProtocol, executor: ExecutorProtocol) -> None:
        """Any scheduler (the memory-aware one, notebook 01's blind one) with any executor (toy or a real model)."""
        self.scheduler = scheduler
        self.executor = executor
        self.on_schedule: Callable[[StepRecord], None] | None = None  # sees each step's plan before it runs
        self.last_output: SchedulerOutput | None = None  # the latest step's plan
        self.iteration = 0
        self.num_failed = 0  # requests ended by a fault, over the core's life
        self.trace = self.new_trace()
        self._seconds: dict[str, float] = {}  # this step's wall time per phase
        self._plan: StepRecord | None = None  # this step's record, made when the execute phase begins
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
        self.iteration += 1
        self._seconds, self._plan, self._handled = {}, None, None
        with self._fail_unless_handled():
            return self._finish_record(step_module.engine_step(self))

    @contextlib.contextmanager
    def phase(self, name: str, scheduler_output: SchedulerOutput | None = None) -> Iterator[None]:
        """Time one phase of the step; if it raises, fail whom it touched (for "schedule": whom planning reached).

        "execute" and "update" take the step's SchedulerOutput: entering "execute" checks the plan
        against the scheduler's contract and records it; a fault in either costs only its requests.
        """
        if name not in PHASE_LABELS:
            raise ValueError(f"unknown phase {name!r}: the phases are {', '.join(PHASE_LABELS)}.")
        affected = self._touched_by_planning
        if name != "schedule":
            affected = self._plan_requests(name, scheduler_output)
        with self._timed(name), self._fail_on_error(PHASE_LABELS[name], affected):
            yield

    def finish_requests(self, requests: Sequence[Request], status: RequestStatus, reason: str) -> list[Request]:
        """End requests through the scheduler's finish_requests, the one way out; after a fault, drop what never ran.

        If the scheduler's finish_requests itself fails (Exercise 7.4 unwritten or broken), the core
        settles them directly: recovering from a fault must not depend on the learner's abort.
        """
        try:
            ended = self.scheduler.finish_requests([r.id for r in requests], status, reason)
        except Exception:
            ended = self._settle_here(requests, status, reason)
        if status is RequestStatus.FAILED:
            self.num_failed += len(ended)
            manager = self.scheduler.kv_cache_manager
            if manager is not None:
                manager.forget_unwritten_blocks()  # blocks published for a step that never ran hold no K/V
            if getattr(self.scheduler, "kv_connector", None) is not None:
                self.scheduler.abandon_loads()  # a second tier's copies of that step may never have run either
        return ended

    # ---- helpers ----
    def _plan_requests(self, name: str, scheduler_output: object) -> Callable[[], list[Request]]:
        """Who a fault in this phase costs: the plan's running requests; entering "execute" checks and records the plan."""
        if not isinstance(scheduler_output, SchedulerOutput):
            raise TypeError(
                f"core.phase({name!r}, scheduler_output) takes the SchedulerOutput that schedule_next_batch() "
                f"returned, not {type(scheduler_output).__name__}."
            )
        if name == "execute":
            with self._fail_on_error("scheduling", self._touched_by_planning):
                self._check_output(scheduler_output)
            self.last_output = scheduler_output
            self._plan = self._record(scheduler_output)
            if self.on_schedule is not None:
                self.on_schedule(self._plan)
        pool = self.scheduler.active_pool
        return lambda: [pool[seq.request_id] for seq in scheduler_output if seq.request_id in pool]

    def _finish_record(self, finished: object) -> StepRecord:
        """Complete this step's record once engine_step returned (with a clear error when it broke its contract)."""
        if self._plan is None:
            raise BatchContractError(
                "engine_step returned without running the plan inside core.phase('execute', scheduler_output): "
                "the step's plan was never checked or recorded (Exercise 1.1)."
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

    def _settle_here(self, requests: Sequence[Request], status: RequestStatus, reason: str) -> list[Request]:
        """Only when the scheduler's finish_requests fails: out of the running set and the queue, blocks back."""
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

    def _touched_by_planning(self) -> list[Request]:
        """After a fault while planning: the running requests and any waiting one the plan reached."""
        manager = self.scheduler.kv_cache_manager
        return list(self.scheduler.active_pool.values()) + [
            r
            for r in self.scheduler.waiting_queue
            if r.num_computed_tokens or (manager is not None and manager.get_block_ids(r))
        ]

    def _check_output(self, scheduler_output: SchedulerOutput) -> None:
        """The scheduler's contract: a plan holds only RUNNING requests (never one preempted while planning)."""
        for seq in scheduler_output:
            if seq.request_id not in self.scheduler.active_pool:
                raise BatchContractError(
                    f"the scheduler's plan contains request {seq.request_id}, which is not running (preempted "
                    "while planning the same step?): its blocks are gone, so it cannot run. A plan may only "
                    "hold running requests: a request preempted after being scheduled must leave the plan."
                )

    def _record(self, scheduler_output: SchedulerOutput) -> StepRecord:
        """The step as planned (what ran; finished and free blocks are filled in after the update)."""
        running = list(self.scheduler.active_pool.values())
        self.remember(running)
        return StepRecord(
            iteration=self.iteration,
            scheduled=[(s.request_id, "decode" if s.is_decode else "prefill", len(s.tokens)) for s in scheduler_output],
            positions=[(s.position_ids_start, s.position_ids_start + len(s.tokens) - 1) for s in scheduler_output],
            samples=[bool(s.samples_token) for s in scheduler_output],
            resident_tokens=sum(r.num_computed_tokens for r in running),
            num_free_blocks=None,
            preempted=list(scheduler_output.preempted_req_ids),
            num_preemptions=self.scheduler.num_preemptions,
            finished=[],
            seconds=self._seconds,
        )

    @contextlib.contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        """Add the wall time of a phase to this step's record."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[phase] = time.perf_counter() - start

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
                self.finish_requests(victims, RequestStatus.FAILED, reason)
                outcome = "were marked FAILED and their blocks given back; the engine can take new work"
            except Exception as cleanup_error:  # report both; the first error is the one to fix
                outcome = f"could not be cleaned up ({type(cleanup_error).__name__}: {cleanup_error})"
            error.add_note(
                f"kvcourse: step {self.iteration} failed in {phase}; requests {[r.id for r in victims]} {outcome}."
            )
            self._handled = error
            raise


# ----------------------------------------------------------------------------------------------
# A model (GPT-2, Llama/SmolLM2) through the loop
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
    """Greedy generation for a causal LM (GPT-2, Llama/SmolLM2) through our scheduler, paged KV cache and attention."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_blocks: int,
        block_size: int = 16,
        token_budget: int = 512,
        max_batch_size: int = 16,
        enable_prefix_caching: bool = False,
        attention: str | None = None,  # None: the runner's default, "fast"; "reference" runs exercises 5.2-5.3
        tokenizer=None,
        pack_weights: bool | None = None,  # None: oneDNN-packed linear layers where they pay (CPU, float32)
        num_cpu_tier_blocks: int = 0,  # a second KV tier in CPU memory (lesson 10); 0: off, as before
    ) -> None:
        # Imported here, not at the top: the toy world uses EngineCore without torch or transformers.
        from kvcourse.kv_cache import KVCacheManager
        from kvcourse.models.spec import kv_cache_spec
        from kvcourse.offload import check_tier_blocks, make_tier
        from kvcourse.scheduler import StallFreeScheduler
        from kvcourse.worker.model_runner import ModelRunner

        self.model = model
        self.tokenizer = tokenizer
        self.kv_cache_manager: KVCacheManager = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        self.tier = (
            make_tier(self.kv_cache_manager, num_cpu_tier_blocks)
            if check_tier_blocks("num_cpu_tier_blocks", num_cpu_tier_blocks)
            else None
        )
        self.scheduler = StallFreeScheduler(token_budget, max_batch_size, self.kv_cache_manager, kv_connector=self.tier)
        self.runner = ModelRunner(
            model, num_blocks, block_size, attention, pack_weights=pack_weights, num_cpu_tier_blocks=num_cpu_tier_blocks
        )
        self.core = EngineCore(self.scheduler, self.runner)
        self.max_positions = kv_cache_spec(model.config).max_positions
        self.vocab_size = int(model.config.vocab_size)
        self.stats = EngineStats()
        self.last_record: StepRecord | None = None  # what the latest step() did (None after a failed one)
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
        sampling_params: kvcourse.worker.sampler.SamplingParams for every prompt (None: greedy, equal to hf_greedy).
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
            disable=not show or os.environ.get("KVCOURSE_PROGRESS") == "0",  # 0: no bar (stored notebook outputs)
            leave=False,
        )
        try:
            while self.scheduler.has_unfinished_requests():
                bar.update(self.step(trace=trace))
        except BaseException as error:  # the step already failed its own requests: end the rest of this call
            unsettled = [r for r in requests if not r.status.is_finished()]
            self.core.finish_requests(
                unsettled, RequestStatus.ABORTED, f"generate() stopped: {type(error).__name__} in a step"
            )
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
        hits_before = self.kv_cache_manager.prefix_cache_stats.hits
        failed_before = self.core.num_failed
        self.last_record = None
        try:
            record = self.core.step()
        except Deadlock as stall:  # a scheduler bug: end what is stuck, so the engine can serve again
            stuck = list(self.scheduler.active_pool.values()) + list(self.scheduler.waiting_queue)
            self.core.finish_requests(stuck, RequestStatus.FAILED, f"deadlock: {stall}")
            stall.add_note(f"kvcourse: requests {[r.id for r in stuck]} were marked FAILED and their blocks freed.")
            raise
        finally:
            self.stats.failed_requests += self.core.num_failed - failed_before
        self.last_record = record
        self.stats.iterations += 1
        self.stats.preemptions += len(record.preempted)
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
                from kvcourse.models.gpt2 import load_tokenizer

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
                f"context holds {self.max_positions} positions (its config's max_position_embeddings): shorten the prompt "
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


def _check_sampling_params(params: object) -> SamplingParams | None:
    """The request's SamplingParams (None: greedy), or a ValueError saying what to pass."""
    from kvcourse.worker.sampler import SamplingParams

    if params is not None and not isinstance(params, SamplingParams):
        raise ValueError(
            f"sampling_params is {type(params).__name__}; pass kvcourse.worker.sampler.SamplingParams(temperature=..., "
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


__all__ = [  # the records and the stall error live in kvcourse/core/records.py; re-exported for the engine's readers
    "PHASES",
    "BatchContractError",
    "Deadlock",
    "EngineCore",
    "EngineStats",
    "LLMEngine",
    "StepRecord",
    "Trace",
    "describe_stall",
    "format_step",
    "hf_greedy",
]
