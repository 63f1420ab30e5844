"""Graded tests for notebook 01: the engine's step (Exercise 1.1, kvcourse/step.py).

They drive `EngineCore.step`, which calls the learner's `engine_step`, with the given memory-blind
scheduler of notebook 01 (or a small paged variant of it over the given MockKVCacheManager) and the toy
executor, so that they depend on no other exercise.
"""

from __future__ import annotations

import pytest

from kvcourse.engine import BatchContractError, Deadlock, EngineCore, describe_stall
from kvcourse.kv_cache_interface import MockKVCacheManager
from kvcourse.request import Request, RequestStatus
from kvcourse.toy import BlindStallFreeScheduler, ToyExecutor, run, toy_generate, toy_requests

pytestmark = pytest.mark.ex1_1


class ModelCrash(Exception):
    """What a test's broken model raises (not a RuntimeError, so it is never confused with a stub's)."""


class PagedBlind(BlindStallFreeScheduler):
    """The blind planner, but every sequence it schedules gets its blocks from a mock manager while planning."""

    def __init__(self, token_budget: int = 24, max_batch_size: int = 3, block_size: int = 4) -> None:
        super().__init__(token_budget, max_batch_size)
        self.kv_cache_manager = MockKVCacheManager(num_blocks=10_000, block_size=block_size)

    def schedule_next_batch(self) -> list:
        batch = super().schedule_next_batch()  # has already advanced num_computed_tokens past each chunk
        for sequence in batch:
            assert self.kv_cache_manager.allocate_slots(self.active_pool[sequence.request_id], 0) is not None
        return batch

    def update_from_output(self, batch, sampled):
        return self._freed(super().update_from_output(batch, sampled))

    def finish_requests(self, request_ids, status, reason=None):
        return self._freed(super().finish_requests(request_ids, status, reason))

    def _freed(self, requests: list) -> list:
        for request in requests:
            self.kv_cache_manager.free(request)
        return requests


class TableChecker(ToyExecutor):
    """A toy executor that checks, when it runs, that it got the block tables the manager holds right then."""

    def __init__(self, manager: MockKVCacheManager) -> None:
        super().__init__(block_size=manager.block_size)
        self.manager, self.runs = manager, 0

    def execute(self, batch, block_tables=None):
        assert isinstance(block_tables, dict), "with a kv_cache_manager, the executor needs block tables"
        assert set(block_tables) == {s.request_id for s in batch}, "one table per request in the batch, no more"
        for s in batch:
            assert list(block_tables[s.request_id]) == self.manager.req_to_blocks[s.request_id], (
                "each table as the manager holds it after planning"
            )
        self.runs += 1
        return super().execute(batch, block_tables)


class Recording:
    """Wraps a scheduler and an executor and writes down, in order, every call the step makes."""

    def __init__(self, scheduler, executor) -> None:
        self.events: list[tuple] = []
        self.scheduler, self.executor = scheduler, executor
        inner_schedule, inner_update, inner_execute = (
            scheduler.schedule_next_batch,
            scheduler.update_from_output,
            executor.execute,
        )

        def schedule():
            batch = inner_schedule()
            self.events.append(("schedule", batch))
            return batch

        def execute(batch, block_tables=None):
            sampled = inner_execute(batch, block_tables)
            self.events.append(("execute", batch, block_tables, sampled))
            return sampled

        def update(batch, sampled):
            finished = inner_update(batch, sampled)
            self.events.append(("update", batch, sampled, list(finished)))
            return finished

        scheduler.schedule_next_batch, scheduler.update_from_output, executor.execute = schedule, update, execute

    def names(self) -> list[str]:
        return [event[0] for event in self.events]


def blind(lengths=(9, 5, 14), new_tokens=(4, 6, 3), budget: int = 16, batch: int = 3, scheduler=None):
    scheduler = scheduler or BlindStallFreeScheduler(budget, batch)
    requests = toy_requests(list(lengths), max_new_tokens=list(new_tokens), seed=1)
    for request in requests:
        scheduler.add_request(request)
    return scheduler, requests


def test_a_run_gives_the_outputs_of_generating_each_request_alone():
    scheduler, requests = blind((40, 12, 70, 25, 9), (12, 30, 5, 17, 8), budget=32, batch=3)
    trace = run(scheduler)
    assert all(r.status is RequestStatus.FINISHED for r in requests)
    for request in requests:
        assert request.output_tokens == toy_generate(request.prompt_tokens, request.max_new_tokens)
    assert len(trace.steps) == trace.steps[-1].iteration


def test_each_step_plans_once_runs_that_batch_and_hands_back_its_tokens():
    scheduler, _ = blind()
    recording = Recording(scheduler, ToyExecutor())
    core = EngineCore(scheduler, recording.executor)
    for step in range(1, 6):
        recording.events.clear()
        core.step()
        assert recording.names() == ["schedule", "execute", "update"], (
            f"step {step}: expected one plan, one run, one update in that order; the step made {recording.names()}"
        )
        (_, planned), (_, ran, _, sampled), (_, updated, given, _) = recording.events
        assert ran is planned, "the executor must run the batch the scheduler planned"
        assert updated is planned, "update_from_output must get the batch that ran"
        assert given == sampled, "update_from_output must get exactly the tokens the executor sampled"


def test_the_step_returns_what_the_update_finished():
    scheduler, requests = blind((3, 3), (1, 4), budget=16, batch=2)
    recording = Recording(scheduler, ToyExecutor())
    core = EngineCore(scheduler, recording.executor)
    finished_ids = []
    while scheduler.has_unfinished_requests():
        recording.events.clear()
        record = core.step()
        update = recording.events[-1]
        assert record.finished == [r.id for r in update[3]]
        finished_ids += record.finished
    assert sorted(finished_ids) == sorted(r.id for r in requests)


def test_each_phase_is_timed_in_the_record():
    scheduler, _ = blind()
    record = EngineCore(scheduler, ToyExecutor()).step()
    assert set(record.seconds) == {"schedule", "execute", "update"}, (
        f"each of the three calls should run inside its own core.phase(...); phases timed: {sorted(record.seconds)}"
    )
    assert all(seconds >= 0 for seconds in record.seconds.values())
    assert record.scheduled, "the step's plan must be recorded (core.begin_batch)"


def test_an_empty_plan_raises_deadlock_and_runs_nothing():
    class Stuck(BlindStallFreeScheduler):
        def schedule_next_batch(self):
            return []

    scheduler, _ = blind(scheduler=Stuck(16, 3))
    recording = Recording(scheduler, ToyExecutor())
    with pytest.raises(Deadlock) as stall:
        EngineCore(scheduler, recording.executor).step()
    assert str(stall.value) == describe_stall(scheduler, 1), (
        "the Deadlock should carry describe_stall(scheduler, core.iteration)'s explanation, so the reader learns why"
    )
    assert recording.names() == ["schedule"], "nothing may run or update after an empty plan"


def test_block_tables_are_those_the_manager_holds_after_planning():
    scheduler, requests = blind((9, 5, 14), (4, 6, 3), scheduler=PagedBlind(block_size=4))
    executor = TableChecker(scheduler.kv_cache_manager)
    trace = run(scheduler, executor)
    assert executor.runs == len(trace.steps) > 3
    for request in requests:
        assert request.output_tokens == toy_generate(request.prompt_tokens, request.max_new_tokens)


def test_without_a_manager_the_executor_gets_no_block_tables():
    scheduler, _ = blind()
    recording = Recording(scheduler, ToyExecutor())
    EngineCore(scheduler, recording.executor).step()
    assert recording.events[1][2] is None


def test_before_execute_runs_after_planning_and_before_the_executor():
    scheduler, _ = blind()
    recording = Recording(scheduler, ToyExecutor())
    core = EngineCore(scheduler, recording.executor, before_execute=lambda: recording.events.append(("copies",)))
    for _ in range(3):
        recording.events.clear()
        core.step()
        assert recording.names() == ["schedule", "copies", "execute", "update"], (
            "core.before_execute() must run once per step, after planning and before the executor; the step made "
            f"{recording.names()} ('copies' is before_execute)"
        )


def test_before_execute_belongs_to_the_execute_phase():
    def broken_copies():
        raise ModelCrash("a block copy failed")

    scheduler, requests = blind()
    core = EngineCore(scheduler, ToyExecutor(), before_execute=broken_copies)
    with pytest.raises(ModelCrash) as error:
        core.step()
    notes = " ".join(getattr(error.value, "__notes__", []))
    assert "the executor" in notes, (
        "a fault in core.before_execute() should be reported as part of the execute phase (call it inside "
        f"core.phase('execute', requests)); the report said: {notes!r}"
    )
    assert any(r.status is RequestStatus.FAILED for r in requests), "the batch's requests fail with the step"


def test_a_fault_in_the_executor_fails_only_the_batch():
    class Broken(ToyExecutor):
        ran: tuple[int, ...] = ()

        def execute(self, batch, block_tables=None):
            self.ran = [s.request_id for s in batch]
            raise ModelCrash("the model crashed")

    scheduler, requests = blind((6, 6, 6), (3, 3, 3), scheduler=PagedBlind(token_budget=8, max_batch_size=2))
    executor = Broken(block_size=4)
    with pytest.raises(ModelCrash, match="the model crashed") as error:
        EngineCore(scheduler, executor).step()
    in_batch = [r for r in requests if r.id in executor.ran]
    outside = [r for r in requests if r.id not in executor.ran]
    assert in_batch and outside, "the workload leaves a request waiting outside the first batch"
    assert all(r.status is RequestStatus.FAILED for r in in_batch), "a fault while executing fails the batch"
    assert all(r.status is RequestStatus.WAITING for r in outside), "a request outside the batch must not pay"
    assert all(not scheduler.kv_cache_manager.get_block_ids(r) for r in in_batch), "failed requests give blocks back"
    assert any("FAILED" in note for note in getattr(error.value, "__notes__", []))


def test_a_fault_in_the_update_fails_the_batch_and_the_engine_goes_on():
    class FaultyOnce(BlindStallFreeScheduler):
        broke = False

        def update_from_output(self, batch, sampled):
            if not self.broke:
                self.broke = True
                raise ValueError("bad update")
            return super().update_from_output(batch, sampled)

    scheduler, requests = blind((4, 4, 4), (2, 2, 2), budget=8, batch=2, scheduler=FaultyOnce(8, 2))
    core = EngineCore(scheduler, ToyExecutor())
    with pytest.raises(ValueError, match="bad update"):
        core.step()
    failed = [r for r in requests if r.status is RequestStatus.FAILED]
    assert failed, "a fault in the update should fail the batch's requests (run it inside core.phase('update', ...))"
    assert len(failed) < len(requests), "a fault in the update should fail only the batch's requests"
    while scheduler.has_unfinished_requests():
        core.step()
    for request in requests:
        if request not in failed:
            assert request.output_tokens == toy_generate(request.prompt_tokens, request.max_new_tokens)


def test_a_batch_with_a_request_that_is_not_running_is_refused_before_it_runs():
    class Stale(BlindStallFreeScheduler):
        def schedule_next_batch(self):
            batch = super().schedule_next_batch()
            request = self.active_pool.pop(batch[0].request_id)
            request.status = RequestStatus.PREEMPTED
            self.waiting_queue.appendleft(request)
            return batch

    scheduler, _ = blind(scheduler=Stale(16, 3))
    recording = Recording(scheduler, ToyExecutor())
    with pytest.raises(BatchContractError, match="not running"):
        EngineCore(scheduler, recording.executor).step()
    assert recording.names() == ["schedule"]


def test_the_step_is_the_one_every_engine_uses():
    requests = [Request(id=i, prompt_tokens=[i + 1] * 3, max_new_tokens=2) for i in range(2)]
    scheduler = BlindStallFreeScheduler(8, 2)
    for request in requests:
        scheduler.add_request(request)
    recording = Recording(scheduler, ToyExecutor())
    run(scheduler, recording.executor)
    assert recording.names().count("schedule") == recording.names().count("update") > 0
