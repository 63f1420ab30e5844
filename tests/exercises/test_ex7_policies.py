"""Graded tests for notebook 07: the scheduling policy under load (exercises 7.1-7.5).

Each exercise is checked on its own method first (so a learner sees which part is off), then in a
whole run through the engine loop, where its contract must hold step after step.
"""

from __future__ import annotations

import warnings

import pytest

from kvcourse.core.contract import MockKVCacheManager
from kvcourse.core.request import Request, RequestStatus
from kvcourse.kv_cache import KVCacheManager
from kvcourse.scheduler import PreemptionCosts, StallFreeScheduler, recompute_seconds, swap_crossover, swap_seconds
from kvcourse.toy import run, toy_generate, toy_requests


def make(num_blocks: int = 64, block_size: int = 4, token_budget: int = 64, max_batch_size: int = 8, **knobs):
    """A scheduler over a fresh mock manager."""
    manager = MockKVCacheManager(num_blocks=num_blocks, block_size=block_size)
    return StallFreeScheduler(token_budget, max_batch_size, manager, **knobs), manager


def request(request_id: int, length: int = 4, priority: int = 0, arrival: float = 0.0, max_new_tokens: int = 4):
    """A request with readable prompt tokens."""
    tokens = list(range(10 * request_id + 1, 10 * request_id + 1 + length))
    return Request(
        id=request_id, prompt_tokens=tokens, max_new_tokens=max_new_tokens, priority=priority, arrival_time=arrival
    )


def running(scheduler: StallFreeScheduler, manager, req: Request) -> Request:
    """Make a request running past its prefill, holding its blocks (admission order = call order)."""
    req.output_tokens = [1]
    assert manager.allocate_slots(req, req.num_tokens - 1) is not None, "setup: the test's request did not fit"
    req.num_computed_tokens = req.num_tokens - 1
    req.status = RequestStatus.RUNNING
    scheduler.active_pool[req.id] = req
    scheduler._known_ids.add(req.id)
    return req


# ---------------------------------------------------------------------------------------------- 7.1
@pytest.mark.ex7_1
def test_queue_is_ordered_by_priority_then_arrival() -> None:
    scheduler, _ = make(policy="priority")
    for req in (
        request(0, priority=1, arrival=0.0),
        request(1, priority=0, arrival=2.0),
        request(2, priority=1, arrival=1.0),
    ):
        scheduler._insert_by_priority(req)
    scheduler._insert_by_priority(request(3, priority=0, arrival=0.5))
    order = [r.id for r in scheduler.waiting_queue]
    assert order == [3, 1, 0, 2], f"the queue should be by (priority, arrival_time), smallest first; got ids {order}"


@pytest.mark.ex7_1
def test_equal_keys_stay_first_come_first_served() -> None:
    scheduler, _ = make(policy="priority")
    for i in range(4):
        scheduler._insert_by_priority(request(i, priority=2, arrival=1.0))
    order = [r.id for r in scheduler.waiting_queue]
    assert order == [0, 1, 2, 3], f"requests with equal (priority, arrival_time) must keep their order; got {order}"


@pytest.mark.ex7_1
def test_victim_is_least_urgent_then_latest_arrival() -> None:
    scheduler, manager = make(policy="priority")
    a = running(scheduler, manager, request(0, priority=5, arrival=3.0))
    running(scheduler, manager, request(1, priority=9, arrival=1.0))
    c = running(scheduler, manager, request(2, priority=9, arrival=2.0))
    running(scheduler, manager, request(3, priority=0, arrival=9.0))
    free_before, held = manager.get_num_free_blocks(), len(manager.get_block_ids(c))
    victim = scheduler._preempt_lowest_priority()
    assert victim is c, f"the victim must have the largest (priority, arrival_time): request 2, not {victim.id}"
    assert c.id not in scheduler.active_pool and c.status is RequestStatus.PREEMPTED, (
        "the victim must leave the running requests and be PREEMPTED (self._preempt does both)"
    )
    assert manager.get_num_free_blocks() == free_before + held, "the victim's blocks must go back to the manager"
    assert c.num_computed_tokens == 0 and c.output_tokens == [1], "recompute: nothing cached, outputs kept"
    assert c.num_preemptions == 1 and scheduler.num_preemptions == 1, (
        "a preemption is counted on the victim and on the scheduler (self._preempt counts both)"
    )
    assert a.status is RequestStatus.RUNNING, "only the victim steps back: the others keep running"


@pytest.mark.ex7_1
def test_exact_ties_preempt_the_newest_admission() -> None:
    scheduler, manager = make(policy="priority")
    for i in range(3):
        running(scheduler, manager, request(i, priority=1, arrival=0.0))
    assert scheduler._preempt_lowest_priority().id == 2, "among exact ties the most recently admitted steps back"


@pytest.mark.ex7_1
def test_victim_waits_at_its_priority_place_not_at_the_head() -> None:
    scheduler, manager = make(policy="priority")
    scheduler._insert_by_priority(request(5, priority=0, arrival=4.0))
    scheduler._insert_by_priority(request(6, priority=7, arrival=4.0))
    running(scheduler, manager, request(1, priority=3, arrival=1.0))
    scheduler._preempt_lowest_priority()
    order = [r.id for r in scheduler.waiting_queue]
    assert order == [5, 1, 6], f"a preempted request rejoins the queue by priority; got {order}"


@pytest.mark.ex7_1
def test_urgent_late_arrival_is_admitted_first_and_outputs_are_exact() -> None:
    scheduler, _ = make(num_blocks=7, block_size=4, token_budget=16, max_batch_size=2, policy="priority")
    reqs = toy_requests([6, 6, 6, 6], max_new_tokens=10, seed=3)
    for i, req in enumerate(reqs):
        req.priority, req.arrival_time = (0 if i == 3 else 1), float(i)
        scheduler.add_request(req)
    assert scheduler.waiting_queue[0].id == 3, "the urgent request must be at the head of the queue"
    trace = run(scheduler)
    first_step = {rid: next(s.iteration for s in trace.steps if rid in [x[0] for x in s.scheduled]) for rid in range(4)}
    assert first_step[3] == min(first_step.values()), f"the urgent request ran first? first steps: {first_step}"
    for req in reqs:
        assert req.output_tokens == toy_generate(req.prompt_tokens, 10), f"request {req.id}: outputs changed"
    assert trace.num_preemptions > 0, "this cache is tight enough that someone must step back"
    for req in reqs:
        if req.priority == 0:
            assert req.num_preemptions == 0, "the urgent request must never be the victim while others run"


@pytest.mark.ex7_1
def test_an_urgent_request_arriving_mid_run_takes_memory_from_the_least_urgent() -> None:
    scheduler, _ = make(num_blocks=8, block_size=4, token_budget=16, max_batch_size=3, policy="priority")
    early = toy_requests([7, 7], max_new_tokens=12, seed=4)
    for i, req in enumerate(early):
        req.priority, req.arrival_time = 2 + i, float(i)
        scheduler.add_request(req)
    [urgent] = toy_requests([7], max_new_tokens=12, seed=6, first_id=9)
    urgent.priority, urgent.arrival_time = 0, 5.0

    def arrive(iteration, batch, sched):
        if iteration == 2:
            sched.add_request(urgent)

    run(scheduler, on_step=arrive)
    assert urgent.num_preemptions == 0, "the most urgent request must never step back for less urgent ones"
    assert early[1].num_preemptions > 0, "the least urgent running request is the one to step back"
    for req in [*early, urgent]:
        assert req.output_tokens == toy_generate(req.prompt_tokens, 12), f"request {req.id}: outputs changed"


# ---------------------------------------------------------------------------------------------- 7.2
@pytest.mark.ex7_2
def test_watermark_counts_blocks_left_free() -> None:
    scheduler, manager = make(num_blocks=20, block_size=4, watermark=0.25)  # keep 5 blocks free
    running(scheduler, manager, request(0, length=23))  # 23 tokens cached -> 6 blocks, 14 free
    waiting = request(1, length=40)
    assert scheduler._keeps_watermark(waiting, 36) is True, "14 free - 9 blocks = 5: exactly the watermark"
    assert scheduler._keeps_watermark(waiting, 37) is False, "37 tokens need 10 blocks: only 4 would stay free"
    assert manager.get_num_free_blocks() == 14 and not scheduler.waiting_queue, "the check must change nothing"


@pytest.mark.ex7_2
def test_watermark_never_blocks_an_idle_cache() -> None:
    scheduler, _ = make(num_blocks=10, block_size=4, watermark=0.5)
    assert scheduler._keeps_watermark(request(0, length=36), 36) is True, (
        "with nothing running, there is nothing to protect"
    )


@pytest.mark.ex7_2
def test_watermark_cuts_preemptions_under_load() -> None:
    def preemptions(watermark: float) -> tuple[int, list[list[int]]]:
        scheduler, _ = make(num_blocks=24, block_size=4, token_budget=32, max_batch_size=8, watermark=watermark)
        reqs = toy_requests([10] * 8, max_new_tokens=14, seed=5)
        scheduler.waiting_queue.extend(reqs)
        trace = run(scheduler)
        return trace.num_preemptions, [r.output_tokens for r in reqs]

    without, outputs_without = preemptions(0.0)
    with_watermark, outputs_with = preemptions(0.3)
    assert without > 0, "the workload must preempt without a watermark"
    assert with_watermark < without, f"a watermark should cut preemptions: {with_watermark} vs {without} without"
    assert outputs_with == outputs_without, "a watermark changes who waits, never what is generated"


# ---------------------------------------------------------------------------------------------- 7.3
COSTS = PreemptionCosts(
    kv_bytes_per_token=1000, link_bytes_per_s=1e6, link_latency_s=0.01, flops_per_token=2e6, flops_per_s=1e9
)


@pytest.mark.ex7_3
def test_swap_pays_latency_and_bytes_both_ways() -> None:
    assert swap_seconds(100, COSTS) == pytest.approx(2 * (0.01 + 100 * 1000 / 1e6)), (
        "out AND in: latency + bytes/bw each"
    )
    assert swap_seconds(0, COSTS) == 0.0, "no tokens, no transfer"


@pytest.mark.ex7_3
def test_recompute_pays_flops_once() -> None:
    assert recompute_seconds(100, COSTS) == pytest.approx(100 * 2e6 / 1e9), (
        "recompute costs each token's FLOPs at the device's FLOP rate, once"
    )
    assert recompute_seconds(0, COSTS) == 0.0, "no tokens, nothing to recompute"


@pytest.mark.ex7_3
def test_crossover_is_the_first_length_where_swap_is_cheaper() -> None:
    # swap 0.02 + 0.002 n, recompute 0.002 n + ... : make recompute 0.003 n -> crossover where 0.02 < 0.001 n
    costs = PreemptionCosts(1000, 1e6, 0.01, 3e6, 1e9)
    n = swap_crossover(costs, max_tokens=1000)
    assert n == 21, f"swap (0.02 + 0.002 n s) first beats recompute (0.003 n s) at n = 21; got {n}"
    assert swap_crossover(costs, max_tokens=20) is None, "no crossover within 20 tokens: None"
    cheap_link = PreemptionCosts(1, 1e12, 0.0, 3e6, 1e9)
    assert swap_crossover(cheap_link, max_tokens=10) == 1, (
        "when swap is cheaper from the first token, the crossover is 1"
    )


@pytest.mark.ex7_3
def test_swap_out_keeps_the_computed_tokens_when_the_cpu_pool_has_room() -> None:
    scheduler, manager = make(num_blocks=16, block_size=4, preemption_mode="swap", num_cpu_blocks=5)
    victim = running(scheduler, manager, request(0, length=10))  # 10 tokens cached -> 3 blocks
    scheduler._preempt_most_recent()
    assert scheduler._move_to_cpu(victim, 10) is True, "3 blocks fit a CPU pool of 5: the swap-out should succeed"
    assert scheduler._swapped == {0: 3} and scheduler.num_free_cpu_blocks == 2, "10 tokens take 3 CPU blocks"
    assert victim.num_computed_tokens == 10, "a swapped-out request keeps its computed tokens"
    assert manager.get_block_ids(victim) == [] and manager.get_num_free_blocks() == 16, "but no GPU block"


@pytest.mark.ex7_3
def test_swap_out_refuses_when_the_pool_is_full_or_there_is_nothing() -> None:
    scheduler, manager = make(num_blocks=16, block_size=4, preemption_mode="swap", num_cpu_blocks=2)
    victim = running(scheduler, manager, request(0, length=10))
    scheduler._preempt_most_recent()
    assert scheduler._move_to_cpu(victim, 10) is False, "3 blocks do not fit a pool of 2"
    assert scheduler._move_to_cpu(victim, 0) is False, "nothing computed, nothing to keep"
    assert scheduler._swapped == {} and victim.num_computed_tokens == 0, "a refused swap-out changes nothing"


@pytest.mark.ex7_3
def test_swap_in_allocates_kept_tokens_and_the_next_chunk_or_nothing() -> None:
    scheduler, manager = make(num_blocks=5, block_size=4, preemption_mode="swap", num_cpu_blocks=8)
    victim = running(scheduler, manager, request(0, length=10))  # 10 cached + 1 sampled token to feed
    scheduler._preempt_most_recent()
    assert scheduler._move_to_cpu(victim, 10), "the swap-out should succeed (8 CPU blocks free)"
    blocker = Request(id=9, prompt_tokens=list(range(1, 12)), max_new_tokens=1)
    manager.allocate_slots(blocker, 11)  # 3 of 5 blocks taken: kept 10 + 1 needs 3
    assert scheduler._move_to_gpu(victim, 8) is None, "no room: the swap-in waits"
    assert victim.num_computed_tokens == 10 and 0 in scheduler._swapped and victim in scheduler.waiting_queue, (
        "a refused swap-in changes nothing: the request keeps its computed tokens, its swap record and its place"
    )
    assert manager.get_block_ids(victim) == [], "a refused swap-in holds nothing"
    manager.free(blocker)
    sequence = scheduler._move_to_gpu(victim, 8)
    assert sequence is not None and sequence.is_decode and sequence.position_ids_start == 10, (
        "its prefill was done: the swap-in resumes with a decode of its newest token at position 10"
    )
    assert victim.status is RequestStatus.RUNNING and list(scheduler.active_pool)[-1] == 0, (
        "a swapped-in request is RUNNING again, the newest in the running pool"
    )
    assert 0 not in scheduler._swapped, "a swapped-in request's swap record must be cleared (its CPU blocks are free)"
    assert victim not in scheduler.waiting_queue, "a swapped-in request leaves the waiting queue"
    assert len(manager.get_block_ids(victim)) == 3, "blocks for the 10 kept tokens and the one fed"


@pytest.mark.ex7_3
def test_a_swapping_run_recomputes_nothing_and_keeps_outputs() -> None:
    from kvcourse.toy.arrivals import SimulatedClock, StepCost, UnpagedToyExecutor, serve

    scheduler, _ = make(num_blocks=8, block_size=4, token_budget=16, max_batch_size=4)
    swapper, _ = make(
        num_blocks=8, block_size=4, token_budget=16, max_batch_size=4, preemption_mode="swap", num_cpu_blocks=32
    )
    clock = StepCost(0.01, 0.001)
    runs = []
    for sched in (scheduler, swapper):
        reqs = toy_requests([7, 6, 8, 5], max_new_tokens=9, seed=11)
        runs.append(serve(sched, [(0.0, r) for r in reqs], SimulatedClock(clock), UnpagedToyExecutor()))
        for req in reqs:
            assert req.output_tokens == toy_generate(req.prompt_tokens, 9), f"request {req.id}: outputs changed"
    fed = [sum(step.num_tokens for step in run.trace.steps) for run in runs]
    assert scheduler.num_preemptions > 0 and swapper.num_preemptions > 0, "this cache must preempt"
    assert swapper.num_swapped_out_tokens > 0 and swapper.num_swapped_in_tokens == swapper.num_swapped_out_tokens, (
        "every token swapped out should be swapped back in"
    )
    once = (7 + 6 + 8 + 5) + 4 * (9 - 1)  # each prompt, and every output but the last, fed once
    assert fed[1] == once, "with swap every token is fed exactly once"
    assert fed[0] > fed[1], "recompute feeds the victims' tokens again"


# ---------------------------------------------------------------------------------------------- 7.4
def _busy_scheduler():
    scheduler, manager = make(num_blocks=32, block_size=4)
    a = running(scheduler, manager, request(0, length=7))
    b = running(scheduler, manager, request(1, length=9))
    c, d = request(2), request(3)
    for req in (c, d):
        scheduler._known_ids.add(req.id)
        scheduler.waiting_queue.append(req)
    return scheduler, manager, (a, b, c, d)


@pytest.mark.ex7_4
def test_abort_running_gives_every_block_back_and_nothing_else_changes() -> None:
    scheduler, manager, (a, b, c, d) = _busy_scheduler()
    free, b_blocks = manager.get_num_free_blocks(), manager.get_block_ids(b)
    ended = scheduler._end_request(a.id, RequestStatus.ABORTED, "client went away")
    assert ended is a, "_end_request should return the request it ended"
    assert a.status is RequestStatus.ABORTED and a.reason == "client went away", (
        "the ended request takes the given status and reason"
    )
    assert a.id not in scheduler.active_pool and manager.get_block_ids(a) == [], (
        "an aborted request is no longer running and holds no block"
    )
    assert manager.get_num_free_blocks() == free + 2, "all of the aborted request's blocks come back at once"
    assert manager.get_block_ids(b) == b_blocks and b.status is RequestStatus.RUNNING, "others keep their blocks"
    assert [r.id for r in scheduler.waiting_queue] == [2, 3], "the waiting queue is untouched"


@pytest.mark.ex7_4
def test_abort_waiting_leaves_the_queue_order() -> None:
    scheduler, manager, (a, b, c, d) = _busy_scheduler()
    free = manager.get_num_free_blocks()
    assert scheduler._end_request(c.id, RequestStatus.ABORTED, "cancelled") is c, "a waiting request can be aborted too"
    assert [r.id for r in scheduler.waiting_queue] == [3], (
        "an aborted waiting request leaves the queue; the others keep their order"
    )
    assert c.status is RequestStatus.ABORTED, "the aborted request takes the given status"
    assert manager.get_num_free_blocks() == free and list(scheduler.active_pool) == [0, 1], (
        "aborting a waiting request changes no one else's blocks or place"
    )


@pytest.mark.ex7_4
@pytest.mark.parametrize("status", [RequestStatus.FAILED, RequestStatus.FINISHED])
def test_the_request_takes_the_status_it_is_given(status) -> None:
    scheduler, _, (a, b, c, d) = _busy_scheduler()
    for req in (a, c):  # one running, one waiting
        assert scheduler._end_request(req.id, status, "a fault") is req, "a running or waiting request is ended"
        assert req.status is status and req.reason == "a fault", (
            "an ended request has the status and reason it was given (the engine ends faulty requests as FAILED), "
            "not always ABORTED"
        )


@pytest.mark.ex7_4
def test_settled_requests_are_left_alone() -> None:
    scheduler, _, (a, *_rest) = _busy_scheduler()
    scheduler._end_request(a.id, RequestStatus.ABORTED, "first")
    assert scheduler._end_request(a.id, RequestStatus.FAILED, "second") is None, "an ended request is settled"
    assert a.status is RequestStatus.ABORTED and a.reason == "first", (
        "a settled request keeps its first status and reason"
    )


@pytest.mark.ex7_4
def test_abort_mid_run_frees_everything_and_the_rest_finish_exactly() -> None:
    scheduler, manager = make(num_blocks=16, block_size=4, token_budget=16, max_batch_size=4)
    reqs = toy_requests([6, 5, 7, 4], max_new_tokens=8, seed=9)
    scheduler.waiting_queue.extend(reqs)
    scheduler._known_ids.update(r.id for r in reqs)

    def abort_at_step_3(iteration, batch, sched):
        if iteration == 3:
            sched.finish_requests([1, 3], RequestStatus.ABORTED, "client went away")

    run(scheduler, on_step=abort_at_step_3)
    assert reqs[1].status is RequestStatus.ABORTED and reqs[3].status is RequestStatus.ABORTED, (
        "finish_requests should abort both requests"
    )
    for req in (reqs[0], reqs[2]):
        assert req.output_tokens == toy_generate(req.prompt_tokens, 8), f"request {req.id} must be unaffected"
    assert manager.get_num_free_blocks() == 16, "when everything has ended, every block is free"


# ---------------------------------------------------------------------------------------------- 7.5
def _cached_manager() -> tuple[KVCacheManager, Request]:
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    req = Request(id=0, prompt_tokens=list(range(1, 14)), max_new_tokens=2)
    assert manager.allocate_slots(req, req.num_tokens) is not None, "setup: the prompt did not fit"
    req.num_computed_tokens = req.num_tokens
    return manager, req


@pytest.mark.ex7_5
def test_reset_is_refused_while_a_block_is_held() -> None:
    manager, req = _cached_manager()
    cached = manager.block_pool.get_num_cached_blocks()
    assert cached == 3, "setup: the prompt's three full blocks are published"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert manager.reset_prefix_cache() is False, "a block is in use: the reset must be refused"
    assert manager.block_pool.get_num_cached_blocks() == cached, "a refused reset changes nothing"
    assert manager.reset_refusal and "held" in manager.reset_refusal, "a refused reset says why (reset_refusal)"


@pytest.mark.ex7_5
def test_reset_forgets_every_prefix_and_keeps_the_free_queue() -> None:
    manager, req = _cached_manager()
    manager.free(req)
    order = [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]
    again = Request(id=1, prompt_tokens=list(range(1, 14)), max_new_tokens=2)
    assert manager.get_computed_blocks(again)[1] == 12, "setup: before the reset the prefix hits"
    assert manager.reset_prefix_cache() is True, "with every block free, the reset should succeed (True)"
    assert manager.get_computed_blocks(again)[1] == 0, "after a reset no prefix may hit"
    assert manager.block_pool.get_num_cached_blocks() == 0, "after a reset the hash map is empty"
    assert all(b.block_hash is None and b.token_ids is None for b in manager.block_pool.blocks), "no block keeps a hash"
    after = [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]
    assert after == order, "a reset allocates and frees nothing: the free queue keeps its order"


# ---------------------------------------------------------------------------------------------- more contract clauses
@pytest.mark.ex7_1
def test_the_victim_is_chosen_by_arrival_not_by_admission_order() -> None:
    scheduler, manager = make(policy="priority")
    late = running(scheduler, manager, request(0, priority=4, arrival=9.0))  # admitted first, arrived last
    running(scheduler, manager, request(1, priority=4, arrival=1.0))
    running(scheduler, manager, request(2, priority=1, arrival=0.0))
    assert scheduler._preempt_lowest_priority() is late, (
        "among the least urgent (largest priority value), the victim is the one that ARRIVED last "
        "(largest arrival_time), whenever it was admitted"
    )


@pytest.mark.ex7_3
def test_a_crossover_at_the_last_length_is_found() -> None:
    costs = PreemptionCosts(1000, 1e6, 0.01, 3e6, 1e9)  # swap first cheaper at 21 tokens
    assert swap_crossover(costs, max_tokens=21) == 21, "max_tokens itself is a length to try (1 to max_tokens)"


@pytest.mark.ex7_3
def test_swap_out_fits_a_cpu_pool_exactly() -> None:
    scheduler, manager = make(num_blocks=16, block_size=4, preemption_mode="swap", num_cpu_blocks=3)
    victim = running(scheduler, manager, request(0, length=10))  # 10 tokens cached -> 3 blocks
    scheduler._preempt_most_recent()
    assert scheduler._move_to_cpu(victim, 10) is True, "3 blocks fit a CPU pool of exactly 3 free blocks"
    assert scheduler.num_free_cpu_blocks == 0, "the swapped-out request takes every CPU block"


@pytest.mark.ex7_4
def test_a_finished_request_is_not_aborted_again() -> None:
    scheduler, manager, (a, *_rest) = _busy_scheduler()
    scheduler.active_pool.pop(a.id)
    manager.free(a)
    a.status = RequestStatus.FINISHED  # it finished just as its client went away
    scheduler.finished.append(a)
    assert scheduler._end_request(a.id, RequestStatus.ABORTED, "client went away") is None, (
        "a request that already FINISHED is settled: _end_request must return None and leave it alone"
    )
    assert scheduler.finish_requests([a.id], RequestStatus.ABORTED, "client went away") == [], (
        "aborting a finished request ends nothing"
    )
    assert a.status is RequestStatus.FINISHED, "a finished request must keep its FINISHED status"
    assert scheduler.finished.count(a) == 1, "a finished request must be listed once in scheduler.finished"


@pytest.mark.ex7_5
def test_reset_is_refused_while_an_unpublished_block_is_held() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    req = Request(id=0, prompt_tokens=[1, 2, 3], max_new_tokens=2)  # one partial block: nothing published
    assert manager.allocate_slots(req, 3) is not None, "setup: the prompt did not fit"
    assert manager.block_pool.get_num_cached_blocks() == 0, "setup: a partial block is not published"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert manager.reset_prefix_cache() is False, (
            "a block is held by a request (published or not): its K/V is in use, so the reset must be refused"
        )


# ---- lockstep (issue 35): every call compared with the reference on seeded random and adversarial workloads ----
@pytest.mark.parametrize(
    "exercise_id",
    [
        pytest.param(i, marks=getattr(pytest.mark, "ex" + i.replace(".", "_")))
        for i in (
            "7.1",
            "7.2",
            "7.3",
            "7.4",
            "7.5",
        )
    ],
)
def test_lockstep_with_the_reference(exercise_id):
    """The first call where this exercise's code differs from the reference fails, naming the rule it breaks."""
    from kvcourse.course.lockstep import assert_lockstep

    assert_lockstep(exercise_id)
