"""Graded tests for exercises 8.4-8.5: the scheduler's side of the CPU tier (wait for the load, then proceed).

The scheduler runs over a mock manager that reports device prefix hits and a fake tier that reports
how many more tokens it holds and how many will load, so these tests depend on no 3.x-4.x or 8.1-8.3
exercise; 8.5 uses _new_sequence (Exercise 2.1) to build its chunk, as swap-in (7.3) does.
"""

from __future__ import annotations

import pytest

from kvcourse.core.contract import KVCacheBlocks, MockKVCacheManager
from kvcourse.core.request import Request, RequestStatus
from kvcourse.scheduler import SchedulerOutput, StallFreeScheduler

SIZE = 4


class HitManager(MockKVCacheManager):
    """The mock, plus `hit_tokens` of device prefix hits at admission, and a record of its calls."""

    def __init__(self, num_blocks: int, hit_tokens: int = 0) -> None:
        super().__init__(num_blocks, SIZE)
        self.hit_tokens = hit_tokens
        self.calls: list[tuple] = []
        self.forgotten: list[tuple[int, int]] = []

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        return KVCacheBlocks(range(500, 500 + self.hit_tokens // SIZE)), self.hit_tokens

    def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None):
        self.calls.append((request.id, num_new_tokens, num_new_computed_tokens, len(new_computed_blocks or ())))
        hits = list(new_computed_blocks.blocks) if new_computed_blocks else []
        needed = self.num_blocks_to_allocate(request, num_new_tokens, num_new_computed_tokens) - len(hits)
        if needed > self._num_free:
            return None
        table = self.req_to_blocks.setdefault(request.id, [])
        new_ids = list(range(self._next_id, self._next_id + needed))
        self._next_id += needed
        table.extend(hits + new_ids)
        self._num_free -= needed
        return KVCacheBlocks(new_ids)

    def forget_unwritten_tail(self, request: Request, num_valid_tokens: int) -> None:
        self.forgotten.append((request.id, num_valid_tokens))


class FakeTier:
    """Holds `more` tokens past the device hits; `loads` of them will load (the rest were dropped meanwhile)."""

    def __init__(self, more: int, loads: int | None = None) -> None:
        self.more, self.loads = more, more if loads is None else loads
        self.asked: list[tuple[int, int]] = []
        self.told: list[tuple[int, list[int], int, int]] = []

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        self.asked.append((request.id, num_computed_tokens))
        return self.more

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> int:
        self.told.append((request.id, blocks.get_block_ids(), num_external_tokens, request.num_computed_tokens))
        return self.loads

    def take_transfers(self):
        return [], []


def make(hit_tokens: int = 0, more: int = 8, loads: int | None = None, num_blocks: int = 32):
    manager = HitManager(num_blocks, hit_tokens)
    tier = FakeTier(more, loads)
    scheduler = StallFreeScheduler(64, 8, manager, kv_connector=tier)
    return scheduler, manager, tier


def waiting(scheduler: StallFreeScheduler, request_id: int, length: int) -> Request:
    request = Request(request_id, list(range(1, length + 1)), max_new_tokens=4)
    scheduler.waiting_queue.append(request)
    return request


# ---- 8.4 start the load ------------------------------------------------------------------------


@pytest.mark.ex8_4
def test_a_request_with_tokens_in_the_tier_waits_for_its_load():
    scheduler, manager, tier = make(hit_tokens=4, more=8)
    other = waiting(scheduler, 2, 10)
    request = waiting(scheduler, 1, 21)
    scheduler.waiting_queue.rotate(1)  # request first, other behind it
    assert scheduler._start_load(request) is True, "a request with tier tokens and room for them starts its load"
    assert tier.asked == [(1, 4)], "the tier is asked once, after the device hits (4 tokens)"
    assert manager.calls == [(1, 8, 4, 1)], (
        "one allocation, for the device hits (4 tokens, 1 block) plus exactly the tier's 8 tokens as new tokens"
    )
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS, "it waits in WAITING_FOR_REMOTE_KVS"
    assert request.num_computed_tokens == 4, "while loading it counts only its device hits as computed"
    assert list(scheduler.waiting_queue) == [other], "it leaves the waiting queue; the others keep theirs"
    assert request.id not in scheduler.active_pool, "it is not running while its blocks load"
    assert scheduler.loading == {1: (request, 8)}, "loading maps its id to (the request, the tokens that will load)"
    assert tier.told == [(1, manager.get_block_ids(request)[1:], 8, 4)], (
        "the tier is told the blocks allocate_slots returned and the tier tokens, after num_computed_tokens is set"
    )


@pytest.mark.ex8_4
def test_nothing_more_in_the_tier_leaves_admission_to_2_2():
    scheduler, manager, tier = make(hit_tokens=4, more=0)
    request = waiting(scheduler, 1, 21)
    assert scheduler._start_load(request) is None, "with nothing more in the tier, return None (2.2 admits it)"
    assert manager.calls == [] and manager.get_num_free_blocks() == 32, "nothing is allocated"
    assert request.status is RequestStatus.WAITING and list(scheduler.waiting_queue) == [request], (
        "the request is left as it was, in the queue"
    )
    assert not scheduler.loading and tier.told == [], "nothing is loading"


@pytest.mark.ex8_4
def test_no_room_changes_nothing():
    scheduler, manager, tier = make(hit_tokens=0, more=16, num_blocks=3)
    request = waiting(scheduler, 1, 21)
    assert scheduler._start_load(request) is False, "allocate_slots refused: return False"
    assert request.status is RequestStatus.WAITING and list(scheduler.waiting_queue) == [request], (
        "a refused request keeps its status and its place"
    )
    assert request.num_computed_tokens == 0 and not scheduler.loading and tier.told == [], "nothing changed"


@pytest.mark.ex8_4
def test_a_short_load_unpublishes_what_did_not_come():
    scheduler, manager, tier = make(hit_tokens=4, more=12, loads=4)
    request = waiting(scheduler, 1, 21)
    assert scheduler._start_load(request) is True, "a load that will fall short still starts"
    assert scheduler.loading == {1: (request, 4)}, "loading records the tokens that WILL load (4), not those asked (12)"
    assert manager.forgotten == [(1, 8)], (
        "blocks past the device hits plus the loaded tokens (4 + 4) must be unpublished: forget_unwritten_tail(request, 8)"
    )


@pytest.mark.ex8_4
def test_a_loading_request_takes_no_budget_and_does_not_hold_up_the_batch():
    scheduler, manager, tier = make(hit_tokens=0, more=8)
    first = waiting(scheduler, 1, 21)
    second = waiting(scheduler, 2, 6)
    tier_only_for_first = tier.get_num_new_matched_tokens
    tier.get_num_new_matched_tokens = lambda r, n: tier_only_for_first(r, n) if r.id == 1 else 0
    output = scheduler.schedule_next_batch()
    assert first.status is RequestStatus.WAITING_FOR_REMOTE_KVS, "the first request waits for its load"
    assert [s.request_id for s in output] == [2], "the request behind it is admitted in the same step"
    assert output.total_num_scheduled_tokens == 6, "the loading request takes no token of the budget"
    assert output.loading_req_ids == [1], "the plan says who is loading"
    assert second.status is RequestStatus.RUNNING, "the second request runs"


# ---- 8.5 proceed as a prefix hit -----------------------------------------------------------------


def loaded(scheduler, manager, tier, length: int = 21):
    """A request whose load ran: through _start_load, then the given collect_finished_loads."""
    request = waiting(scheduler, 1, length)
    assert scheduler._start_load(request) is True, "(setup) 8.4 must start the load"
    scheduler.collect_finished_loads()
    return request


@pytest.mark.ex8_5
def test_a_loaded_request_runs_its_next_chunk_on_the_blocks_it_holds():
    scheduler, manager, tier = make(hit_tokens=4, more=8)
    request = loaded(scheduler, manager, tier)
    assert request.num_computed_tokens == 12, "(given) after the load it counts hits + loaded tokens"
    table = manager.get_block_ids(request)
    output = SchedulerOutput(block_ids={})
    assert scheduler._admit_loaded(request, 64, output) is True, "a loaded request with room proceeds"
    [sequence] = list(output)
    assert sequence.position_ids_start == 12 and len(sequence.tokens) == 9, (
        "its chunk starts after the computed tokens (12) and feeds the rest of the prompt (9)"
    )
    assert sequence.samples_token, "a chunk that reaches the end of the prompt samples"
    assert manager.calls[-1] == (1, 9, 0, 0), "allocate_slots(request, chunk): no hits again, the table counts"
    assert manager.get_block_ids(request)[: len(table)] == table, "it keeps the blocks it holds"
    assert output.new_block_ids.get(1, []) == manager.get_block_ids(request)[len(table) :], (
        "the plan carries the ids of the blocks allocate_slots returned"
    )
    assert request.status is RequestStatus.RUNNING and list(scheduler.active_pool) == [1], "it is running"
    assert 1 not in scheduler.loaded and not scheduler.waiting_queue, "it leaves loaded and the waiting queue"


@pytest.mark.ex8_5
def test_the_chunk_is_cut_to_the_budget_left():
    scheduler, manager, tier = make(hit_tokens=0, more=8)
    request = loaded(scheduler, manager, tier, length=30)
    output = SchedulerOutput(block_ids={})
    assert scheduler._admit_loaded(request, 5, output) is True, "a loaded request proceeds with what budget is left"
    assert output.total_num_scheduled_tokens == 5, "its chunk is cut to the budget left (5)"
    assert not output[0].samples_token, "a chunk that stops short of the end does not sample"


@pytest.mark.ex8_5
def test_a_loaded_request_without_room_keeps_its_blocks_and_place():
    scheduler, manager, tier = make(hit_tokens=0, more=8, num_blocks=3)
    request = loaded(scheduler, manager, tier)
    table = manager.get_block_ids(request)
    output = SchedulerOutput(block_ids={})
    assert scheduler._admit_loaded(request, 64, output) is False, "no room for its chunk: return False"
    assert manager.get_block_ids(request) == table, "it keeps the blocks it holds"
    assert list(scheduler.waiting_queue) == [request] and 1 in scheduler.loaded, "it keeps its place and stays loaded"
    assert request.status is RequestStatus.WAITING and not output, "nothing is planned"


@pytest.mark.ex8_5
def test_the_whole_step_loads_then_proceeds():
    scheduler, manager, tier = make(hit_tokens=4, more=8)
    request = waiting(scheduler, 1, 21)
    first = scheduler.schedule_next_batch()
    assert not list(first) and first.loading_req_ids == [1], "step 1 only loads"
    second = scheduler.schedule_next_batch()
    assert [s.request_id for s in second] == [1], "step 2 runs it, as a prefix hit"
    assert second[0].position_ids_start == 12, "its chunk starts after its hits and its loaded tokens"
    assert request.status is RequestStatus.RUNNING, "it is running"


# ---- lockstep (issue 35): every call compared with the reference on seeded random and adversarial workloads ----
@pytest.mark.parametrize(
    "exercise_id", [pytest.param("8.4", marks=pytest.mark.ex8_4), pytest.param("8.5", marks=pytest.mark.ex8_5)]
)
def test_lockstep_with_the_reference(exercise_id):
    """The first call where this exercise's code differs from the reference fails, naming the rule it breaks."""
    from kvcourse.course.lockstep import assert_lockstep

    assert_lockstep(exercise_id)
