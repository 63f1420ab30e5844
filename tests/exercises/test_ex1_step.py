"""Graded tests for notebook 01: the engine's step (Exercise 1.1, kvcourse/step.py).

They drive `EngineCore.step`, which calls the learner's `engine_step`, with the given memory-blind
scheduler of notebook 01 and the toy executor, so that they depend on no other exercise.
"""

from __future__ import annotations

import pytest

from kvcourse.core.request import Request, RequestStatus
from kvcourse.core.sched_output import SchedulerOutput
from kvcourse.engine.llm_engine import BatchContractError, Deadlock, EngineCore, describe_stall
from kvcourse.toy import BlindStallFreeScheduler, ToyExecutor, run, toy_generate, toy_requests


class ModelCrash(Exception):
    """What a test's broken model raises (not a RuntimeError, so it is never confused with a stub's)."""


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
            scheduler_output = inner_schedule()
            self.events.append(("schedule", scheduler_output))
            return scheduler_output

        def execute(scheduler_output):
            sampled = inner_execute(scheduler_output)
            self.events.append(("execute", scheduler_output, sampled))
            return sampled

        def update(scheduler_output, sampled):
            finished = inner_update(scheduler_output, sampled)
            self.events.append(("update", scheduler_output, sampled, list(finished)))
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


@pytest.mark.ex1_1
def test_a_run_gives_the_outputs_of_generating_each_request_alone():
    scheduler, requests = blind((40, 12, 70, 25, 9), (12, 30, 5, 17, 8), budget=32, batch=3)
    trace = run(scheduler)
    assert all(r.status is RequestStatus.FINISHED for r in requests), "every request should finish, step after step"
    for request in requests:
        assert request.output_tokens == toy_generate(request.prompt_tokens, request.max_new_tokens), (
            "a request's outputs differ from generating it alone: the step must hand the update exactly the sampled tokens"
        )
    assert len(trace.steps) == trace.steps[-1].iteration, "each engine step should make exactly one step of the run"


@pytest.mark.ex1_1
def test_each_step_plans_once_runs_that_plan_and_hands_back_its_tokens():
    scheduler, _ = blind()
    recording = Recording(scheduler, ToyExecutor())
    core = EngineCore(scheduler, recording.executor)
    for step in range(1, 6):
        recording.events.clear()
        core.step()
        assert recording.names() == ["schedule", "execute", "update"], (
            f"step {step}: expected one plan, one run, one update in that order; the step made {recording.names()}"
        )
        (_, planned), (_, ran, sampled), (_, updated, given, _) = recording.events
        assert ran is planned, "the executor must run the SchedulerOutput the scheduler planned, whole"
        assert updated is planned, "update_from_output must get the SchedulerOutput that ran"
        assert given == sampled, "update_from_output must get exactly the tokens the executor sampled"


@pytest.mark.ex1_1
def test_the_step_returns_what_the_update_finished():
    scheduler, requests = blind((3, 3), (1, 4), budget=16, batch=2)
    recording = Recording(scheduler, ToyExecutor())
    core = EngineCore(scheduler, recording.executor)
    finished_ids = []
    while scheduler.has_unfinished_requests():
        recording.events.clear()
        record = core.step()
        update = recording.events[-1]
        assert record.finished == [r.id for r in update[3]], "the step must return what update_from_output returned"
        finished_ids += record.finished
    assert sorted(finished_ids) == sorted(r.id for r in requests), (
        "every request should be returned once, as it finishes"
    )


@pytest.mark.ex1_1
def test_each_phase_is_timed_in_the_record():
    scheduler, _ = blind()
    record = EngineCore(scheduler, ToyExecutor()).step()
    assert set(record.seconds) == {"schedule", "execute", "update"}, (
        f"each of the three calls should run inside its own core.phase(...); phases timed: {sorted(record.seconds)}"
    )
    assert all(seconds >= 0 for seconds in record.seconds.values()), "a phase's time cannot be negative"
    assert record.scheduled, "the step's plan must be recorded (core.phase('execute', scheduler_output))"


@pytest.mark.ex1_1
def test_an_empty_plan_raises_deadlock_and_runs_nothing():
    class Stuck(BlindStallFreeScheduler):
        def schedule_next_batch(self):
            return SchedulerOutput()

    scheduler, _ = blind(scheduler=Stuck(16, 3))
    recording = Recording(scheduler, ToyExecutor())
    with pytest.raises(Deadlock) as stall:
        EngineCore(scheduler, recording.executor).step()
    assert str(stall.value) == describe_stall(scheduler, 1), (
        "the Deadlock should carry describe_stall(scheduler, core.iteration)'s explanation, so the reader learns why"
    )
    assert recording.names() == ["schedule"], "nothing may run or update after an empty plan"


@pytest.mark.ex1_1
def test_a_fault_while_planning_is_reported_as_scheduling():
    class BrokenPlanner(BlindStallFreeScheduler):
        def schedule_next_batch(self):
            super().schedule_next_batch()  # admits requests, then breaks
            raise ModelCrash("the planner crashed")

    scheduler, requests = blind(scheduler=BrokenPlanner(16, 3))
    with pytest.raises(ModelCrash) as error:
        EngineCore(scheduler, ToyExecutor()).step()
    notes = " ".join(getattr(error.value, "__notes__", []))
    assert "failed in scheduling" in notes, (
        f"plan inside core.phase('schedule'), so a fault there is reported as scheduling; the report said {notes!r}"
    )
    assert any(r.status is RequestStatus.FAILED for r in requests), "the requests planning touched fail"


@pytest.mark.ex1_1
def test_a_fault_in_the_executor_fails_only_the_plan():
    class Broken(ToyExecutor):
        ran: tuple[int, ...] = ()

        def execute(self, scheduler_output):
            self.ran = [s.request_id for s in scheduler_output]
            raise ModelCrash("the model crashed")

    scheduler, requests = blind((6, 6, 6), (3, 3, 3), budget=8, batch=2)
    executor = Broken()
    with pytest.raises(ModelCrash, match="the model crashed") as error:
        EngineCore(scheduler, executor).step()
    in_plan = [r for r in requests if r.id in executor.ran]
    outside = [r for r in requests if r.id not in executor.ran]
    assert in_plan and outside, "the workload leaves a request waiting outside the first plan"
    assert all(r.status is RequestStatus.FAILED for r in in_plan), "a fault while executing fails the plan's requests"
    assert all(r.status is RequestStatus.WAITING for r in outside), "a request outside the plan must not pay"
    notes = " ".join(getattr(error.value, "__notes__", []))
    assert "FAILED" in notes and "the executor" in notes, (
        f"run the plan inside core.phase('execute', scheduler_output); the report said {notes!r}"
    )


@pytest.mark.ex1_1
def test_a_fault_in_the_update_fails_the_plan_and_the_engine_goes_on():
    class FaultyOnce(BlindStallFreeScheduler):
        broke = False

        def update_from_output(self, scheduler_output, sampled):
            if not self.broke:
                self.broke = True
                raise ValueError("bad update")
            return super().update_from_output(scheduler_output, sampled)

    scheduler, requests = blind((4, 4, 4), (2, 2, 2), budget=8, batch=2, scheduler=FaultyOnce(8, 2))
    core = EngineCore(scheduler, ToyExecutor())
    with pytest.raises(ValueError, match="bad update") as error:
        core.step()
    failed = [r for r in requests if r.status is RequestStatus.FAILED]
    assert failed, "a fault in the update should fail the plan's requests (run it inside core.phase('update', ...))"
    assert len(failed) < len(requests), "a fault in the update should fail only the plan's requests"
    assert "update_from_output" in " ".join(getattr(error.value, "__notes__", [])), "reported as the update phase"
    while scheduler.has_unfinished_requests():
        core.step()
    for request in requests:
        if request not in failed:
            assert request.output_tokens == toy_generate(request.prompt_tokens, request.max_new_tokens), (
                "after a fault, the requests it did not touch should run on to the right outputs"
            )


@pytest.mark.ex1_1
def test_a_plan_with_a_request_that_is_not_running_is_refused_before_it_runs():
    class Stale(BlindStallFreeScheduler):
        def schedule_next_batch(self):
            scheduler_output = super().schedule_next_batch()
            request = self.active_pool.pop(scheduler_output[0].request_id)
            request.status = RequestStatus.PREEMPTED
            self.waiting_queue.appendleft(request)
            return scheduler_output

    scheduler, _ = blind(scheduler=Stale(16, 3))
    recording = Recording(scheduler, ToyExecutor())
    with pytest.raises(BatchContractError, match="not running"):
        EngineCore(scheduler, recording.executor).step()
    assert recording.names() == ["schedule"], "a plan the core refuses must not be run or updated"


@pytest.mark.ex1_1
def test_the_step_is_the_one_every_engine_uses():
    requests = [Request(id=i, prompt_tokens=[i + 1] * 3, max_new_tokens=2) for i in range(2)]
    scheduler = BlindStallFreeScheduler(8, 2)
    for request in requests:
        scheduler.add_request(request)
    recording = Recording(scheduler, ToyExecutor())
    run(scheduler, recording.executor)
    assert recording.names().count("schedule") == recording.names().count("update") > 0, (
        "every step should plan once and update once"
    )


# ---- lockstep (issue 35): every call compared with the reference on seeded random and adversarial workloads ----
@pytest.mark.parametrize(
    "exercise_id",
    [pytest.param(i, marks=getattr(pytest.mark, "ex" + i.replace(".", "_"))) for i in ("1.1",)],
)
def test_lockstep_with_the_reference(exercise_id):
    """The first call where this exercise's code differs from the reference fails, naming the rule it breaks."""
    from kvcourse.course.lockstep import assert_lockstep

    assert_lockstep(exercise_id)
