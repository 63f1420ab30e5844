"""Hypothesis workloads for the reference StallFreeScheduler: nothing lost, nothing over budget, nothing leaked.

Random prompt lengths, arrival steps, token budgets, batch sizes, block sizes and cache sizes (often
just large enough for the largest request, sometimes too small for some). Each workload runs to the
end with the toy executor, and then:
  * every request is FINISHED or REJECTED, and REJECTED exactly when it could never fit the cache;
  * every finished request's output equals an unconstrained run (preemption loses nothing);
  * every batch is within the token budget and the batch size, one sequence per request;
  * while it runs, block tables cover exactly the computed tokens and at most one prefill is in
    progress; at the end every block is free.
The same workloads run over the mock manager and, when solutions/kv_cache.py exists, over the paged
KVCacheManager with and without prefix caching.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from reference import load_reference

from kvcourse.core.contract import MockKVCacheManager
from kvcourse.core.request import Request, RequestStatus
from kvcourse.toy import ToyExecutor, toy_generate

VOCAB = 7  # small, so that end-of-sequence tokens and shared prefixes happen often
EXAMPLES = 200


def _manager_factory(kind: str):
    """A constructor (num_blocks, block_size) -> manager for the given kind."""
    if kind == "mock":
        return MockKVCacheManager
    kv_cache = load_reference("kv_cache")
    prefix = kind == "paged+prefix"
    return lambda num_blocks, block_size: kv_cache.KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix)


@st.composite
def workloads(draw):
    """Requests (prompt, max_new_tokens, eos, arrival step) plus the engine's sizes."""
    block_size = draw(st.integers(1, 8))
    shared = draw(st.lists(st.integers(0, VOCAB - 1), max_size=20))  # a common prefix, for prefix caching
    n = draw(st.integers(1, 6))
    requests = []
    for _ in range(n):
        keep = draw(st.integers(0, len(shared)))
        own = draw(st.lists(st.integers(0, VOCAB - 1), min_size=0 if keep else 1, max_size=24))
        requests.append(
            (
                shared[:keep] + own,
                draw(st.integers(0, 14)),
                draw(st.one_of(st.none(), st.none(), st.none(), st.integers(0, VOCAB - 1))),  # eos now and then
                draw(st.integers(0, 6)),
            )
        )
    largest = max(math.ceil((len(p) + m) / block_size) for p, m, _, _ in requests)
    num_blocks = draw(
        st.one_of(
            st.just(largest),  # barely large enough
            st.integers(largest, largest + 2),  # tight
            st.integers(largest, largest + 6),  # less tight
            st.integers(max(1, largest - 3), max(1, largest - 1)),  # too small for some: rejections
            st.integers(largest, 4 * largest + 8),  # roomy
        )
    )
    return {
        "requests": requests,
        "block_size": block_size,
        "num_blocks": num_blocks,
        "token_budget": draw(st.integers(1, 40)),
        "max_batch_size": draw(st.integers(1, 6)),
    }


def _check_running(scheduler, manager, block_size: int) -> None:
    """Mid-run invariants: tables cover exactly the computed tokens; one prefill at most; no leak."""
    running = list(scheduler.active_pool.values())
    held: set[int] = set()
    for request in running:
        ids = manager.get_block_ids(request)
        assert len(ids) == math.ceil(request.num_computed_tokens / block_size), f"request {request.id}'s table is off"
        held.update(ids)
    assert manager.get_num_free_blocks() + len(held) == manager.num_blocks, "blocks leaked or double-counted"
    prefilling = [r for r in running if not r.is_prefill_done() and r.num_uncomputed_tokens > 0]
    assert len(prefilling) <= 1, "more than one chunked prefill in progress"
    for request in scheduler.waiting_queue:
        assert request.num_computed_tokens == 0 and manager.get_block_ids(request) == [], (
            "a waiting request holds blocks"
        )


def _drive(scheduler_module, make_manager, workload) -> tuple[list[Request], object, object]:
    """Run the workload step by step (requests arrive at their step), checking every batch."""
    block_size, num_blocks = workload["block_size"], workload["num_blocks"]
    budget, max_batch = workload["token_budget"], workload["max_batch_size"]
    manager = make_manager(num_blocks, block_size)
    scheduler = scheduler_module.StallFreeScheduler(budget, max_batch, manager)
    executor = ToyExecutor(vocab_size=VOCAB, block_size=block_size)
    requests = [
        Request(id=i, prompt_tokens=p, max_new_tokens=m, eos_token_id=eos)
        for i, (p, m, eos, _) in enumerate(workload["requests"])
    ]
    arrivals = [a for _, _, _, a in workload["requests"]]
    limit = 40 * sum(len(r.prompt_tokens) + r.max_new_tokens for r in requests) + 50
    for step in range(limit):
        for request, arrival in zip(requests, arrivals):
            if arrival == step:
                scheduler.add_request(request)
        if step > max(arrivals) and not scheduler.has_unfinished_requests():
            return requests, scheduler, manager
        batch = scheduler.schedule_next_batch()
        assert sum(len(s.tokens) for s in batch) <= budget, "a batch went over the token budget"
        assert len(batch) <= max_batch, "a batch went over the batch size"
        assert len({s.request_id for s in batch}) == len(batch), "a request appears twice in one batch"
        if scheduler.has_unfinished_requests():
            assert batch, "an empty batch while requests are unfinished (deadlock)"
        for seq in batch:
            request = scheduler.active_pool[seq.request_id]
            assert seq.position_ids_start + len(seq.tokens) == request.num_computed_tokens, "positions are off"
        _check_running(scheduler, manager, block_size)
        finished = scheduler.update_from_output(batch, executor.execute(batch))
        for request in finished:
            executor.release(request.id)
        _check_running(scheduler, manager, block_size)
    raise AssertionError("the workload did not finish (livelock)")


def _check_outcome(requests, scheduler, manager, workload) -> None:
    """Every request settled correctly; outputs as if memory were unlimited; every block back."""
    block_size, num_blocks = workload["block_size"], workload["num_blocks"]
    for request in requests:
        never_fits = math.ceil((len(request.prompt_tokens) + request.max_new_tokens) / block_size) > num_blocks
        if never_fits:
            assert request.status is RequestStatus.REJECTED and request.reason, (
                "a request that never fits was not rejected"
            )
            assert request.output_tokens == [], "a rejected request produced tokens"
            continue
        assert request.status is RequestStatus.FINISHED, f"request {request.id} ended {request.status}"
        expected = toy_generate(request.prompt_tokens, request.max_new_tokens, VOCAB, request.eos_token_id)
        assert request.output_tokens == expected, f"request {request.id}'s outputs differ from an unconstrained run"
    assert sorted(r.id for r in scheduler.rejected) == sorted(
        r.id for r in requests if r.status is RequestStatus.REJECTED
    )
    assert sum(r.num_preemptions for r in requests) == scheduler.num_preemptions, "preemption counts disagree"
    assert manager.get_num_free_blocks() == num_blocks, "blocks are still held at the end"
    assert not scheduler.active_pool and not scheduler.waiting_queue, "requests are left over"


@pytest.mark.parametrize("kind", ["mock", "paged", "paged+prefix"])
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads())
def test_every_workload_finishes_with_unconstrained_outputs(kind, workload):
    scheduler_module = load_reference("scheduler")
    requests, scheduler, manager = _drive(scheduler_module, _manager_factory(kind), workload)
    _check_outcome(requests, scheduler, manager, workload)
    event(f"preempted: {scheduler.num_preemptions > 0}")
    event(f"rejected: {bool(scheduler.rejected)}")
    stats = getattr(manager, "prefix_cache_stats", None)
    if kind == "paged+prefix" and stats is not None:
        event(f"prefix hits: {stats.hits > 0}")


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 24), min_size=2, max_size=6),
    max_new_tokens=st.integers(4, 16),
    block_size=st.integers(1, 4),
    budget=st.integers(1, 32),
)
def test_the_tightest_cache_still_finishes_everything(lengths, max_new_tokens, block_size, budget):
    """A cache exactly as large as the largest request: heavy preemption, still exact outputs."""
    scheduler_module = load_reference("scheduler")
    num_blocks = max(math.ceil((n + max_new_tokens) / block_size) for n in lengths)
    workload = {
        "requests": [([(7 * i + j) % VOCAB for j in range(n)], max_new_tokens, None, 0) for i, n in enumerate(lengths)],
        "block_size": block_size,
        "num_blocks": num_blocks,
        "token_budget": budget,
        "max_batch_size": len(lengths),
    }
    requests, scheduler, manager = _drive(scheduler_module, MockKVCacheManager, workload)
    _check_outcome(requests, scheduler, manager, workload)
    event(f"preempted: {scheduler.num_preemptions > 0}")
    assert all(r.status is RequestStatus.FINISHED for r in requests), "a request that fits was not finished"
