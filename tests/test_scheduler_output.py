"""The step's plan (SchedulerOutput): the lesson's loop reads it, and planning applies it once, after."""

from __future__ import annotations

import pytest

from kvcourse.core.contract import MockKVCacheManager
from kvcourse.core.request import Request, RequestStatus
from kvcourse.core.sched_output import ScheduledSequence, SchedulerOutput
from kvcourse.kv_cache import KVCacheManager
from kvcourse.scheduler import StallFreeScheduler
from kvcourse.toy import ToyExecutor, toy_requests


def running(scheduler: StallFreeScheduler, request: Request, computed: int) -> Request:
    """Put a request in the running set with `computed` tokens cached (admission order = call order)."""
    assert scheduler.kv_cache_manager.allocate_slots(request, computed) is not None
    request.num_computed_tokens = computed
    request.status = RequestStatus.RUNNING
    scheduler.active_pool[request.id] = request
    scheduler._known_ids.add(request.id)
    return request


def test_the_lesson_loop_reads_the_plan_as_a_batch():
    empty = SchedulerOutput()
    assert not empty and len(empty) == 0 and list(empty) == []
    plan = SchedulerOutput(block_ids={})
    plan.add(ScheduledSequence(3, [7, 8], False, 0), [5])
    plan.add(ScheduledSequence(4, [9], True, 6))
    assert plan and len(plan) == 2 and [s.request_id for s in plan] == [3, 4] and plan[1].is_decode
    assert plan.num_scheduled_tokens == {3: 2, 4: 1} and plan.total_num_scheduled_tokens == 3
    assert plan.new_block_ids == {3: [5]}
    with pytest.raises(ValueError, match="already in this step's plan"):
        plan.add(ScheduledSequence(3, [1], True, 2))
    plan.remove(3)
    assert [s.request_id for s in plan] == [4] and plan.total_num_scheduled_tokens == 1, "its budget comes back"


def test_a_request_preempted_later_in_the_step_leaves_the_plan_and_is_not_advanced():
    """Priority: the least urgent request's decode is planned first, then an urgent chunk preempts it."""
    scheduler = StallFreeScheduler(64, 4, MockKVCacheManager(num_blocks=3, block_size=4), policy="priority")
    lazy = running(scheduler, Request(id=0, prompt_tokens=[1] * 7, max_new_tokens=4, output_tokens=[1], priority=9), 7)
    urgent = running(scheduler, Request(id=1, prompt_tokens=[2] * 12, max_new_tokens=4, priority=0), 4)
    output = scheduler.schedule_next_batch()
    assert [s.request_id for s in output] == [urgent.id], "the preempted decode must leave the plan"
    assert output.preempted_req_ids == [lazy.id]
    assert output.num_scheduled_tokens == {urgent.id: 8} and output.total_num_scheduled_tokens == 8
    assert lazy.num_computed_tokens == 0 and lazy.status is RequestStatus.PREEMPTED, (
        "a victim counts nothing as computed: its planned decode was never applied"
    )
    assert urgent.num_computed_tokens == 12, "the urgent chunk is applied once, after planning"
    assert set(output.block_ids) == {urgent.id} and output.block_ids[
        urgent.id
    ] == scheduler.kv_cache_manager.get_block_ids(urgent)


def test_the_plan_carries_block_tables_new_blocks_and_copies_and_who_finished():
    manager = KVCacheManager(num_blocks=32, block_size=4)
    scheduler = StallFreeScheduler(64, 4, manager)
    requests = toy_requests([6, 9], max_new_tokens=[1, 3], seed=5)
    for request in requests:
        scheduler.add_request(request)
    executor = ToyExecutor(block_size=4)
    first = scheduler.schedule_next_batch()
    for request in requests:
        table = manager.get_block_ids(request)
        assert first.block_ids[request.id] == table and first.new_block_ids[request.id] == table
    scheduler.update_from_output(first, executor.execute(first))  # request 0 wanted one token: finished
    second = scheduler.schedule_next_batch()
    assert second.finished_req_ids == [requests[0].id], "settled since the previous step, reported once"
    assert second.blocks_to_copy == [] and requests[0].id not in second.num_scheduled_tokens
    scheduler.update_from_output(second, executor.execute(second))
    assert scheduler.schedule_next_batch().finished_req_ids == []


def test_the_skip_ahead_study_scheduler_really_skips_ahead():
    """The serving study compares FCFS with skip-ahead: its scheduler must admit past a head that does not fit."""
    from kvcourse.bench.serving import SkipAheadScheduler

    outputs = []
    for scheduler_class in (StallFreeScheduler, SkipAheadScheduler):
        manager = MockKVCacheManager(num_blocks=4, block_size=4)
        assert manager.allocate_slots(Request(id=99, prompt_tokens=[0] * 8, max_new_tokens=0), 8) is not None
        scheduler = scheduler_class(64, 4, manager)
        for request in (
            Request(id=0, prompt_tokens=[1] * 12, max_new_tokens=1),
            Request(id=1, prompt_tokens=[2] * 3, max_new_tokens=1),
        ):
            scheduler.add_request(request)
        outputs.append([s.request_id for s in scheduler.schedule_next_batch()])
    assert outputs == [[], [1]], f"FCFS waits for the head, skip-ahead admits request 1 behind it; got {outputs}"
