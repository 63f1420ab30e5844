"""Bad input to the reference scheduler and the toy run loop: clear errors, never a hang or a silent drop."""

from __future__ import annotations

from types import ModuleType

import pytest
from reference import load_reference

from kvcourse.core.contract import MockKVCacheManager
from kvcourse.core.request import Request, RequestStatus
from kvcourse.toy import BlindStallFreeScheduler, Deadlock, run, toy_requests


@pytest.fixture()
def scheduler_module() -> ModuleType:
    return load_reference("scheduler")


def make(scheduler_module, **sizes):
    """A reference scheduler over a mock manager of 8 blocks of 4 tokens."""
    manager = MockKVCacheManager(num_blocks=8, block_size=4)
    return scheduler_module.StallFreeScheduler(sizes.get("budget", 16), sizes.get("batch", 4), manager)


@pytest.mark.parametrize(
    "budget, batch, word",
    [
        (0, 4, "token_budget"),
        (-3, 4, "token_budget"),
        (16, 0, "max_batch_size"),
        (16, -1, "max_batch_size"),
        (2.5, 4, "token_budget"),
        (True, 4, "token_budget"),
    ],
)
def test_non_positive_sizes_are_refused(scheduler_module, budget, batch, word):
    with pytest.raises(ValueError, match=word):
        make(scheduler_module, budget=budget, batch=batch)


def test_something_that_is_not_a_manager_is_refused(scheduler_module):
    with pytest.raises(TypeError, match="allocate_slots"):
        scheduler_module.StallFreeScheduler(16, 4, object())


def test_the_same_request_id_twice_is_refused(scheduler_module):
    scheduler = make(scheduler_module)
    scheduler.add_request(Request(id=7, prompt_tokens=[1, 2], max_new_tokens=2))
    with pytest.raises(ValueError, match="already added"):
        scheduler.add_request(Request(id=7, prompt_tokens=[3], max_new_tokens=1))
    assert len(scheduler.waiting_queue) == 1


def test_a_rejected_id_cannot_be_reused_either(scheduler_module):
    scheduler = make(scheduler_module)
    scheduler.add_request(Request(id=1, prompt_tokens=list(range(40)), max_new_tokens=1))
    assert scheduler.rejected and scheduler.rejected[0].reason
    with pytest.raises(ValueError, match="already added"):
        scheduler.add_request(Request(id=1, prompt_tokens=[1], max_new_tokens=1))


def test_negative_max_new_tokens_and_empty_prompts_are_refused():
    with pytest.raises(ValueError, match="max_new_tokens"):
        Request(id=0, prompt_tokens=[1], max_new_tokens=-1)
    with pytest.raises(ValueError, match="empty"):
        Request(id=0, prompt_tokens=[], max_new_tokens=1)


def test_a_request_with_computed_tokens_is_refused(scheduler_module):
    scheduler = make(scheduler_module)
    with pytest.raises(ValueError, match="computed"):
        scheduler.add_request(Request(id=0, prompt_tokens=[1, 2], max_new_tokens=1, num_computed_tokens=1))


def test_zero_new_tokens_finishes_at_once_without_running(scheduler_module):
    scheduler = make(scheduler_module)
    request = Request(id=0, prompt_tokens=[1, 2, 3], max_new_tokens=0)
    scheduler.add_request(request)
    assert request.status is RequestStatus.FINISHED and scheduler.finished == [request]
    assert not scheduler.has_unfinished_requests()
    trace = run(scheduler)
    assert trace.steps == [] and request.output_tokens == []


def test_zero_new_tokens_among_others(scheduler_module):
    scheduler = make(scheduler_module)
    requests = toy_requests([5, 3, 6], max_new_tokens=[3, 0, 2], seed=1)
    for request in requests:
        scheduler.add_request(request)
    run(scheduler)
    assert all(r.status is RequestStatus.FINISHED for r in requests)
    assert [len(r.output_tokens) for r in requests] == [3, 0, 2]
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 8


def test_a_missing_sampled_token_is_reported(scheduler_module):
    scheduler = make(scheduler_module)
    scheduler.add_request(Request(id=0, prompt_tokens=[1, 2], max_new_tokens=2))
    batch = scheduler.schedule_next_batch()
    with pytest.raises(ValueError, match="No sampled token"):
        scheduler.update_from_output(batch, {})


def test_a_stale_batch_is_reported(scheduler_module):
    scheduler = make(scheduler_module)
    scheduler.add_request(Request(id=0, prompt_tokens=[1, 2], max_new_tokens=1))
    batch = scheduler.schedule_next_batch()
    scheduler.update_from_output(batch, {0: 5})
    with pytest.raises(ValueError, match="not running"):
        scheduler.update_from_output(batch, {0: 5})


def test_plain_skipping_deadlocks_with_a_readable_error(scheduler_module):
    class SkippingScheduler(scheduler_module.StallFreeScheduler):
        def _schedule_running(self, request, num_new_tokens, output):
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            if new_blocks is not None:
                output.add(self._new_sequence(request, num_new_tokens), new_blocks.get_block_ids())
            return new_blocks is not None

    scheduler = SkippingScheduler(16, 4, MockKVCacheManager(num_blocks=6, block_size=4))
    for request in toy_requests([8, 8, 8], max_new_tokens=8, seed=2):
        scheduler.add_request(request)
    with pytest.raises(Deadlock, match="empty batch") as stall:
        run(scheduler)
    assert stall.value.trace is not None and stall.value.trace.steps


def test_run_stops_a_livelock():
    class Forever(BlindStallFreeScheduler):
        def has_unfinished_requests(self):
            return True

        def schedule_next_batch(self):
            from kvcourse.scheduler import ScheduledSequence, SchedulerOutput

            return SchedulerOutput([ScheduledSequence(0, [1], False, 0)], {0: 1})

        def update_from_output(self, batch, sampled):
            return []

    with pytest.raises(RuntimeError, match="did not finish within 5 iterations"):
        forever = Forever(8, 4)
        forever.active_pool[0] = Request(id=0, prompt_tokens=[1], max_new_tokens=1)  # a batch holds running requests
        run(forever, max_iterations=5)


def test_blind_scheduler_refuses_bad_sizes():
    with pytest.raises(ValueError, match="positive"):
        BlindStallFreeScheduler(0, 4)
