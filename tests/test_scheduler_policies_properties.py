"""Hypothesis workloads for the serving knobs of the reference scheduler: priority, watermark, swap, abort.

Random requests (prompts, output lengths, priorities, arrival times) are served through the engine loop
under arrivals (`kvcourse.toy.arrivals.serve`) with random knobs, over the mock manager and the paged
KVCacheManager. Whatever the knobs:
  * every request that fits finishes with the outputs of an unconstrained run, and one that never fits
    is rejected (preemption by recompute or by swap loses nothing);
  * no step goes over the token budget or the batch size, or holds a request twice;
  * at the end every GPU block is free and the CPU pool is empty;
  * aborting random requests mid-run gives back all their memory, and the others still finish exactly.
"""

from __future__ import annotations

import math

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from reference import load_reference

from kvcourse.core.contract import MockKVCacheManager
from kvcourse.core.request import Request, RequestStatus
from kvcourse.toy import toy_generate
from kvcourse.toy.arrivals import SimulatedClock, StepCost, UnpagedToyExecutor, serve

VOCAB = 7
EXAMPLES = 300
COST = StepCost(0.01, 0.001)


@st.composite
def served_workloads(draw):
    """Requests with priorities and arrival times, the engine's sizes, and the knobs."""
    block_size = draw(st.integers(1, 6))
    requests = [
        (
            draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20)),
            draw(st.integers(0, 16)),
            draw(st.integers(0, 3)),  # priority
            draw(st.sampled_from([0.0, 0.0, 0.01, 0.05, 0.2])),  # arrival time (s)
        )
        for _ in range(draw(st.integers(1, 6)))
    ]
    largest = max(math.ceil((len(p) + m) / block_size) for p, m, _, _ in requests)
    swap = draw(st.booleans())
    return {
        "requests": requests,
        "block_size": block_size,
        "num_blocks": draw(st.integers(max(1, largest - 1), largest + 3)),
        "token_budget": draw(st.integers(1, 32)),
        "max_batch_size": draw(st.integers(1, 6)),
        "knobs": {
            "policy": draw(st.sampled_from(["fcfs", "priority"])),
            "watermark": draw(st.sampled_from([0.0, 0.0, 0.1, 0.3])),
            "preemption_mode": "swap" if swap else "recompute",
            "num_cpu_blocks": draw(st.integers(1, 3 * largest)) if swap else 0,
        },
        "paged": draw(st.booleans()),
    }


def _scheduler(workload):
    """The reference scheduler with the workload's knobs, over the mock or the paged manager."""
    scheduler_module = load_reference("scheduler")
    if workload["paged"]:
        manager = load_reference("kv_cache").KVCacheManager(workload["num_blocks"], workload["block_size"])
    else:
        manager = MockKVCacheManager(workload["num_blocks"], workload["block_size"])
    sizes = (workload["token_budget"], workload["max_batch_size"], manager)
    return scheduler_module.StallFreeScheduler(*sizes, **workload["knobs"]), manager


def _requests(workload) -> list[tuple[float, Request]]:
    return [
        (t, Request(id=i, prompt_tokens=p, max_new_tokens=m, priority=prio))
        for i, (p, m, prio, t) in enumerate(workload["requests"])
    ]


def _check_steps(result, workload) -> None:
    for step in result.trace.steps:
        ids = [rid for rid, _, _ in step.scheduled]
        assert step.num_tokens <= workload["token_budget"], "a step went over the token budget"
        assert len(ids) <= workload["max_batch_size"], "a step went over the batch size"
        assert len(set(ids)) == len(ids), "a request appears twice in one step"


def _check_memory(scheduler, manager, workload) -> None:
    assert manager.get_num_free_blocks() == workload["num_blocks"], "GPU blocks are still held at the end"
    assert scheduler.num_free_cpu_blocks == scheduler.num_cpu_blocks, "the CPU pool still holds blocks"
    assert not scheduler.active_pool and not scheduler.waiting_queue, "requests are left over"


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=served_workloads())
def test_every_knob_setting_finishes_with_unconstrained_outputs(workload):
    scheduler, manager = _scheduler(workload)
    pairs = _requests(workload)
    result = serve(scheduler, pairs, SimulatedClock(COST), UnpagedToyExecutor(vocab_size=VOCAB))
    _check_steps(result, workload)
    for _, request in pairs:
        needed = math.ceil((request.num_prompt_tokens + request.max_new_tokens) / workload["block_size"])
        if needed > workload["num_blocks"]:
            assert request.status is RequestStatus.REJECTED
            continue
        assert request.status is RequestStatus.FINISHED, f"request {request.id} ended {request.status}"
        assert request.output_tokens == toy_generate(request.prompt_tokens, request.max_new_tokens, VOCAB)
    _check_memory(scheduler, manager, workload)
    assert scheduler.num_swapped_out_tokens == scheduler.num_swapped_in_tokens, "a swap-out never came back in"
    event(f"preempted: {scheduler.num_preemptions > 0}")
    event(f"swapped: {scheduler.num_swapped_out_tokens > 0}")


class AbortingClock(SimulatedClock):
    """After step `at`, abort every unfinished request whose id is marked (a client going away between steps)."""

    def __init__(self, scheduler, at: int, marked: list[bool]) -> None:
        super().__init__(COST)
        self.scheduler, self.at, self.marked, self.steps = scheduler, at, marked, 0

    def after_step(self, *args, **kwargs) -> None:
        super().after_step(*args, **kwargs)
        self.steps += 1
        if self.steps != self.at:
            return
        unfinished = [*self.scheduler.active_pool, *(r.id for r in self.scheduler.waiting_queue)]
        manager = self.scheduler.kv_cache_manager
        ended = self.scheduler.finish_requests(
            [rid for rid in unfinished if self.marked[rid]], RequestStatus.ABORTED, "client went away"
        )
        for request in ended:
            assert manager.get_block_ids(request) == [], "an aborted request still holds blocks"
            assert request.id not in self.scheduler.active_pool and request not in self.scheduler.waiting_queue


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=served_workloads(), abort_step=st.integers(1, 12), marked=st.lists(st.booleans(), min_size=6))
def test_aborts_mid_run_give_everything_back(workload, abort_step, marked):
    scheduler, manager = _scheduler(workload)
    pairs = _requests(workload)
    result = serve(scheduler, pairs, AbortingClock(scheduler, abort_step, marked), UnpagedToyExecutor(vocab_size=VOCAB))
    _check_steps(result, workload)
    for _, request in pairs:
        if request.status is RequestStatus.FINISHED:
            assert request.output_tokens == toy_generate(request.prompt_tokens, request.max_new_tokens, VOCAB)
        else:
            assert request.status in (RequestStatus.ABORTED, RequestStatus.REJECTED)
    _check_memory(scheduler, manager, workload)
    event(f"aborted: {any(r.status is RequestStatus.ABORTED for _, r in pairs)}")
