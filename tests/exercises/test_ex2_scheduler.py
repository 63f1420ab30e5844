"""Graded tests for notebook 02: the memory-aware StallFreeScheduler (exercises 2.1-2.9).

The warm-ups (2.1-2.3) call the method the learner writes directly, with a fresh `SchedulerOutput` to plan
into, so that each can be checked before the step that calls it (2.4) exists. Tests put requests straight into `waiting_queue` / `active_pool`
(the lesson's names) instead of calling `add_request`, so that they do not depend on Exercise 2.9.
"""

from __future__ import annotations

import itertools
import typing

import pytest

from kvcourse.core.contract import KVCacheBlocks, MockKVCacheManager
from kvcourse.core.request import Request, RequestStatus
from kvcourse.scheduler import ScheduledSequence, SchedulerOutput, StallFreeScheduler
from kvcourse.toy import run, toy_generate, toy_requests


def make(num_blocks: int = 64, block_size: int = 4, token_budget: int = 64, max_batch_size: int = 8):
    """A scheduler over a fresh mock manager."""
    manager = MockKVCacheManager(num_blocks=num_blocks, block_size=block_size)
    return StallFreeScheduler(token_budget, max_batch_size, manager), manager


def prompt(length: int, start: int = 1) -> list[int]:
    """Distinct, readable prompt tokens."""
    return list(range(start, start + length))


def queue(scheduler: StallFreeScheduler, *requests: Request) -> None:
    """Put requests in the waiting queue directly (add_request would need Exercise 2.9)."""
    scheduler.waiting_queue.extend(requests)


def decoding(
    scheduler: StallFreeScheduler,
    manager: MockKVCacheManager,
    request_id: int,
    prompt_len: int,
    outputs: list[int],
    max_new_tokens: int = 50,
) -> Request:
    """A running request past its prefill: everything but its newest token cached, blocks held."""
    request = Request(
        id=request_id,
        prompt_tokens=prompt(prompt_len, 100 * request_id + 1),
        max_new_tokens=max_new_tokens,
        output_tokens=list(outputs),
    )
    assert manager.allocate_slots(request, request.num_tokens - 1) is not None, "(setup) the mock is too small"
    request.num_computed_tokens = request.num_tokens - 1
    request.status = RequestStatus.RUNNING
    scheduler.active_pool[request.id] = request
    return request


def prefilling(
    scheduler: StallFreeScheduler, manager: MockKVCacheManager, request_id: int, prompt_len: int, computed: int
) -> Request:
    """A running request in the middle of its (chunked) prompt: `computed` tokens cached, blocks held."""
    request = Request(id=request_id, prompt_tokens=prompt(prompt_len, 100 * request_id + 1), max_new_tokens=4)
    assert manager.allocate_slots(request, computed) is not None, "(setup) the mock is too small"
    request.num_computed_tokens = computed
    request.status = RequestStatus.RUNNING
    scheduler.active_pool[request.id] = request
    return request


def hold_blocks(manager: MockKVCacheManager, num_tokens: int) -> Request:
    """Someone else's request holding blocks, so that memory is short."""
    other = Request(id=999, prompt_tokens=[0] * num_tokens, max_new_tokens=0)
    assert manager.allocate_slots(other, num_tokens) is not None, "(setup) the mock is too small"
    return other


def run_all(scheduler: StallFreeScheduler, requests: list[Request]):
    """Queue the requests and drive the scheduler with the toy executor to the end."""
    queue(scheduler, *requests)
    return run(scheduler, max_iterations=2_000)


def plan() -> SchedulerOutput:
    """An empty plan for one step, as schedule_next_batch starts it."""
    return SchedulerOutput(block_ids={})


def refuse_memory(scheduler: StallFreeScheduler, preempts: bool = False) -> list:
    """Make _schedule_running say no (as if the request had to step back); record its calls."""
    calls = []

    def no_room(request, num_new_tokens, output):
        calls.append((request.id, num_new_tokens))
        if preempts:
            output.preempted_req_ids.append(-1)  # as if someone had been preempted on the way
        return False

    scheduler._schedule_running = no_room
    return calls


def raised_by(call: typing.Callable[[], object]) -> Exception | None:
    """The exception a call raised, or None: so that a failure can say what came instead of a ValueError."""
    try:
        call()
    except Exception as error:  # any exception: the assertion reports it
        return error
    return None


# --------------------------------------------------------------------------------------- 2.1
@pytest.mark.ex2_1
def test_decode_feeds_the_newest_token_at_the_next_position():
    scheduler, manager = make()
    request = decoding(scheduler, manager, 0, prompt_len=10, outputs=[42])
    output = plan()
    assert scheduler._schedule_running(request, 1, output) is True, "a decode with room should be planned (True)"
    assert len(output) == 1 and isinstance(output[0], ScheduledSequence), "the plan should hold one sequence"
    seq = output[0]
    assert seq.request_id == request.id and seq.is_decode, "the planned sequence should be a decode of that request"
    assert seq.tokens == [42], "a decode should feed the newest sampled token (no placeholder)"
    assert seq.position_ids_start == 10, "a decode's position should be the number of tokens already cached"
    assert output.num_scheduled_tokens == {0: 1}, "the plan counts one token for the decode"
    assert request.num_computed_tokens == 10, (
        "planning does not advance num_computed_tokens: the plan's tokens are applied once, after planning"
    )


@pytest.mark.ex2_1
def test_a_chunk_is_described_from_the_tokens_already_cached():
    request = Request(id=7, prompt_tokens=prompt(10), max_new_tokens=3)
    first = StallFreeScheduler._new_sequence(request, 6)
    assert (first.request_id, first.tokens, first.position_ids_start) == (7, prompt(10)[:6], 0), (
        "the first chunk of a prompt should be its first tokens, from position 0"
    )
    assert not first.is_decode and not first.samples_token, "a chunk that stops inside the prompt samples nothing"
    assert request.num_computed_tokens == 0, "describing a chunk changes nothing (the plan is applied later)"
    request.num_computed_tokens = 6
    rest = StallFreeScheduler._new_sequence(request, 4)
    assert (rest.tokens, rest.position_ids_start) == (prompt(10)[6:], 6), "the next chunk starts where the cache ends"
    assert rest.samples_token and not rest.is_decode, "the chunk that completes the prompt must sample a token"
    request.num_computed_tokens = 10
    request.output_tokens.append(55)
    decode = StallFreeScheduler._new_sequence(request, 1)
    assert (decode.tokens, decode.position_ids_start, decode.is_decode) == ([55], 10, True), (
        "after the prompt, the next token to feed is the first output token, at the position after the prompt"
    )
    assert decode.samples_token, "a decode always samples"


@pytest.mark.ex2_1
def test_a_recomputing_request_refeeds_its_outputs_as_prefill():
    request = Request(id=3, prompt_tokens=prompt(5), max_new_tokens=6, output_tokens=[70, 71])
    seq = StallFreeScheduler._new_sequence(request, 7)  # preempted: nothing cached, 5 + 2 tokens to recompute
    assert seq.tokens == prompt(5) + [70, 71] and not seq.is_decode, (
        "a recompute feeds the prompt and the outputs kept, as a prefill (request.all_token_ids)"
    )
    assert seq.samples_token, "the recompute reaches the end of the request's tokens: it samples the next one"


@pytest.mark.ex2_1
def test_decode_takes_a_new_block_only_at_a_block_boundary_and_the_plan_says_which():
    scheduler, manager = make(num_blocks=20, block_size=4)
    at_boundary = decoding(scheduler, manager, 0, prompt_len=7, outputs=[5, 6])  # 8 cached: blocks full
    inside = decoding(scheduler, manager, 1, prompt_len=8, outputs=[5, 6])  # 9 cached: room left
    free_before = manager.get_num_free_blocks()
    output = plan()
    assert scheduler._schedule_running(at_boundary, 1, output) and scheduler._schedule_running(inside, 1, output), (
        "a decode with memory to spare should be planned (True)"
    )
    assert len(manager.get_block_ids(at_boundary)) == 3, "a decode past a full block must allocate one more block"
    assert len(manager.get_block_ids(inside)) == 3, "a decode that fits the last block must not allocate another"
    assert manager.get_num_free_blocks() == free_before - 1, "the decodes took the wrong number of blocks"
    assert output.new_block_ids.get(0) == manager.get_block_ids(at_boundary)[-1:], (
        "the plan should carry the ids of the blocks allocate_slots returned (output.add(sequence, block_ids))"
    )
    assert not output.new_block_ids.get(1), "a decode that took no block has no new block ids"


# --------------------------------------------------------------------------------------- 2.2
@pytest.mark.ex2_2
def test_admission_schedules_the_whole_prompt_when_the_budget_allows():
    scheduler, manager = make(block_size=16)
    request = Request(id=0, prompt_tokens=prompt(20), max_new_tokens=4)
    queue(scheduler, request)
    output = plan()
    assert scheduler._admit(request, 64, output) is True, "a new request that fits should be admitted (True)"
    [seq] = list(output)
    assert not seq.is_decode, "a new request that fits should get one prefill chunk"
    assert seq.tokens == request.prompt_tokens and seq.position_ids_start == 0, (
        "the first chunk should be the prompt from position 0"
    )
    assert seq.samples_token, "the chunk that completes the prompt must sample the first output token"
    assert request.status is RequestStatus.RUNNING, "an admitted request should be RUNNING"
    assert scheduler.active_pool.get(0) is request and not scheduler.waiting_queue, (
        "an admitted request moves from the waiting queue to active_pool"
    )
    assert len(manager.get_block_ids(request)) == 2, "the prompt's blocks were not allocated (or too many were)"
    assert output.new_block_ids[0] == manager.get_block_ids(request), "the plan lists the blocks allocate_slots added"


@pytest.mark.ex2_2
def test_admission_takes_out_the_admitted_request_not_the_head():
    scheduler, _ = make()
    first = Request(id=1, prompt_tokens=prompt(14), max_new_tokens=4)
    second = Request(id=2, prompt_tokens=prompt(6), max_new_tokens=4)
    queue(scheduler, first, second)
    assert scheduler._admit(second, 64, plan()) is True, "a request that fits should be admitted"
    assert list(scheduler.waiting_queue) == [first], (
        "admitting a request must remove THAT request from the waiting queue, not the head"
    )
    assert list(scheduler.active_pool) == [second.id], "the admitted request should be the one in active_pool"


@pytest.mark.ex2_2
def test_the_first_chunk_is_cut_to_the_budget_left():
    scheduler, manager = make(block_size=8)
    request = Request(id=0, prompt_tokens=prompt(40), max_new_tokens=3)
    queue(scheduler, request)
    output = plan()
    assert scheduler._admit(request, 16, output) is True, "a request whose first chunk fits should be admitted (True)"
    [seq] = list(output)
    assert seq.tokens == request.prompt_tokens[:16], "the first chunk should be 16 prompt tokens"
    assert not seq.samples_token, "a chunk that does not complete the prompt samples nothing"
    assert output.num_scheduled_tokens == {0: 16} and request.num_computed_tokens == 0, (
        "the chunk is in the plan; it counts as computed only once the plan is applied, after planning"
    )
    assert len(manager.get_block_ids(request)) == 2, "only the chunk's blocks should be allocated"


@pytest.mark.ex2_2
def test_failed_admission_changes_nothing():
    scheduler, manager = make(num_blocks=4, block_size=4)
    hold_blocks(manager, 12)
    request = Request(id=0, prompt_tokens=prompt(8), max_new_tokens=2)
    queue(scheduler, request)
    output = plan()
    assert scheduler._admit(request, 64, output) is False, "nothing fits, so the admission should fail (False)"
    assert not output, "a failed admission plans nothing"
    assert list(scheduler.waiting_queue) == [request] and not scheduler.active_pool, "the request should keep waiting"
    assert request.num_computed_tokens == 0, "a request that was not admitted has nothing computed"
    assert manager.get_num_free_blocks() == 1 and manager.get_block_ids(request) == [], (
        "a failed admission must not hold any block"
    )


@pytest.mark.ex2_2
def test_a_newcomer_preempts_nobody():
    scheduler, manager = make(num_blocks=4, block_size=4)
    running = decoding(scheduler, manager, 0, prompt_len=11, outputs=[5])  # 11 cached: 3 blocks
    newcomer = Request(id=1, prompt_tokens=prompt(8), max_new_tokens=2)
    queue(scheduler, newcomer)
    assert scheduler._admit(newcomer, 64, plan()) is False, "a newcomer that does not fit should not be admitted"
    assert running.status is RequestStatus.RUNNING and len(manager.get_block_ids(running)) == 3, (
        "admitting a newcomer must never preempt a running request"
    )
    assert scheduler.num_preemptions == 0, "nobody should be preempted for a newcomer"


@pytest.mark.ex2_2
def test_admission_uses_prefix_cache_hits():
    class HitManager(MockKVCacheManager):
        """A mock that reports the first 8 tokens as cached and records allocate_slots calls."""

        calls: typing.ClassVar[list] = []

        def get_computed_blocks(self, request):
            return KVCacheBlocks.empty(), 8

        def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None):
            self.calls.append((num_new_tokens, num_new_computed_tokens))
            return super().allocate_slots(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks)

    manager = HitManager(num_blocks=16, block_size=4)
    scheduler = StallFreeScheduler(64, 4, manager)
    request = Request(id=0, prompt_tokens=prompt(20), max_new_tokens=2)
    queue(scheduler, request)
    output = plan()
    assert scheduler._admit(request, 64, output) is True, "a request that fits should be admitted (True)"
    assert manager.calls and manager.calls[0] == (12, 8), (
        "allocate_slots should be asked for the 12 tokens after the 8 cache hits, and told about the hits"
    )
    [seq] = list(output)
    assert seq.position_ids_start == 8, "the first chunk should start after the cached prefix"
    assert seq.tokens == request.prompt_tokens[8:], "only the tokens after the cached prefix should be fed"
    assert request.num_computed_tokens == 8, "the cached prefix counts as computed at admission"
    assert output.num_scheduled_tokens == {0: 12}, "the plan holds the 12 tokens to feed"
    assert len(manager.get_block_ids(request)) == 5, (
        "allocate_slots made room for more tokens than the request has: were the cache hits counted twice "
        "(already in request.num_computed_tokens when allocate_slots was called, and passed to it too)?"
    )


# --------------------------------------------------------------------------------------- 2.3
@pytest.mark.ex2_3
def test_a_complete_request_gives_its_blocks_back_and_others_keep_theirs():
    scheduler, manager = make(num_blocks=16, block_size=4)
    done = decoding(scheduler, manager, 0, prompt_len=6, outputs=[3, 4], max_new_tokens=2)
    going = decoding(scheduler, manager, 1, prompt_len=6, outputs=[3], max_new_tokens=5)
    scheduler._finish(done)
    assert done.status is RequestStatus.FINISHED, "a finished request's status should be FINISHED"
    assert list(scheduler.active_pool) == [going.id], "a finished request should leave active_pool, and only it"
    assert manager.get_block_ids(done) == [], "a finished request's blocks should be freed"
    assert going.status is RequestStatus.RUNNING and len(manager.get_block_ids(going)) == 2, (
        "an unfinished request must keep its blocks"
    )
    assert manager.get_num_free_blocks() == 16 - 2, "the free-block count is off after freeing"
    assert scheduler.finished == [done], "the finished request should be listed once in scheduler.finished"


@pytest.mark.ex2_3
def test_freed_blocks_are_there_for_the_next_request_at_once():
    scheduler, manager = make(num_blocks=4, block_size=4)
    done = decoding(scheduler, manager, 0, prompt_len=14, outputs=[3], max_new_tokens=1)  # holds all 4 blocks
    newcomer = Request(id=1, prompt_tokens=prompt(10), max_new_tokens=2)
    assert manager.allocate_slots(newcomer, 10) is None, "(setup) the cache should be full"
    scheduler._finish(done)
    assert manager.get_num_free_blocks() == 4, "all of the finished request's blocks should be free at once"
    assert manager.allocate_slots(newcomer, 10) is not None, "the freed blocks should be usable right away"


# --------------------------------------------------------------------------------------- 2.4
@pytest.mark.ex2_4
def test_decodes_stay_within_the_token_budget_oldest_first():
    scheduler, manager = make(token_budget=2)
    requests = [decoding(scheduler, manager, i, prompt_len=5, outputs=[9]) for i in range(3)]
    batch = scheduler.schedule_next_batch()
    assert sum(len(s.tokens) for s in batch) <= 2, "the batch went over the token budget"
    assert [s.request_id for s in batch] == [requests[0].id, requests[1].id], (
        "decodes should go in admission order until the budget is spent"
    )
    assert requests[2].num_computed_tokens == requests[2].num_tokens - 1, "an unscheduled decode must not advance"


@pytest.mark.ex2_4
def test_a_step_is_decodes_then_one_prefill():
    scheduler, manager = make(block_size=8, token_budget=64)
    first = decoding(scheduler, manager, 0, prompt_len=6, outputs=[1])
    chunked = prefilling(scheduler, manager, 1, prompt_len=30, computed=8)
    other = prefilling(scheduler, manager, 2, prompt_len=30, computed=8)
    second = decoding(scheduler, manager, 3, prompt_len=6, outputs=[1])
    output = scheduler.schedule_next_batch()
    assert isinstance(output, SchedulerOutput), "schedule_next_batch returns the step's SchedulerOutput"
    kinds = [(s.request_id, s.is_decode) for s in output]
    assert kinds == [(first.id, True), (second.id, True), (chunked.id, False)], (
        f"expected the decodes (oldest first), then ONE prefill in progress (the oldest); "
        f"got (request id, is_decode) = {kinds}"
    )
    assert other.num_computed_tokens == 8, "only one prefill in progress may advance per step"
    assert len(output[2].tokens) == 22, "the prefill in progress should get all its remaining tokens (budget allows)"


@pytest.mark.ex2_4
def test_the_plan_is_applied_once_after_planning():
    scheduler, manager = make(block_size=4, token_budget=64)
    decoder = decoding(scheduler, manager, 0, prompt_len=6, outputs=[1])
    chunked = prefilling(scheduler, manager, 1, prompt_len=30, computed=8)
    output = scheduler.schedule_next_batch()
    assert output.num_scheduled_tokens == {0: 1, 1: 22}, "the plan counts each request's tokens"
    assert decoder.num_computed_tokens == 7 and chunked.num_computed_tokens == 30, (
        "once planned, each request's num_computed_tokens has moved on by its planned tokens, exactly once"
    )
    assert output.block_ids == {0: manager.get_block_ids(decoder), 1: manager.get_block_ids(chunked)}, (
        "the plan carries each planned request's block table for the executor"
    )


@pytest.mark.ex2_4
def test_a_running_request_that_gets_no_room_is_not_planned():
    scheduler, manager = make(block_size=8)
    decoder = decoding(scheduler, manager, 0, prompt_len=8, outputs=[5])
    chunked = prefilling(scheduler, manager, 1, prompt_len=40, computed=16)
    calls = refuse_memory(scheduler)
    output = scheduler.schedule_next_batch()
    assert calls == [(0, 1), (1, 24)], (
        "every running request's tokens go through self._schedule_running (decode: 1 token; the prefill in "
        f"progress: what is left, within the budget); the calls were {calls}"
    )
    assert not output and decoder.num_computed_tokens == 8 and chunked.num_computed_tokens == 16, (
        "a request that got no room is not planned and does not advance"
    )


@pytest.mark.ex2_4
def test_the_budget_and_the_batch_size_hold_across_the_passes():
    scheduler, manager = make(token_budget=10, max_batch_size=8)
    decoding(scheduler, manager, 0, prompt_len=5, outputs=[9])
    prefilling(scheduler, manager, 1, prompt_len=20, computed=0)
    batch = scheduler.schedule_next_batch()
    assert [len(s.tokens) for s in batch] == [1, 9], "a decode, then a prefill chunk that uses the 9 tokens left"
    scheduler, manager = make(max_batch_size=2)
    for i in range(3):
        decoding(scheduler, manager, i, prompt_len=5, outputs=[9])
    prefilling(scheduler, manager, 3, prompt_len=20, computed=0)
    batch = scheduler.schedule_next_batch()
    assert [s.request_id for s in batch] == [0, 1], "a batch holds at most max_batch_size sequences"


@pytest.mark.ex2_4
def test_a_long_prompt_is_chunked_and_continued_step_after_step():
    scheduler, manager = make(block_size=8, token_budget=16)
    request = prefilling(scheduler, manager, 0, prompt_len=40, computed=0)
    starts, samples = [], []
    for _ in range(3):
        batch = scheduler.schedule_next_batch()
        assert len(batch) == 1, "the request should get one prefill chunk per step"
        starts.append(batch[0].position_ids_start)
        samples.append(batch[0].samples_token)
    assert starts == [0, 16, 32], "each step's chunk should start where the cached tokens end, and fill the budget"
    assert samples == [False, False, True], "only the chunk that completes the prompt samples a token"
    assert len(manager.get_block_ids(request)) == 5, "the prompt's 40 tokens need 5 blocks of 8"


# --------------------------------------------------------------------------------------- 2.5
@pytest.mark.ex2_5
def test_update_appends_tokens_and_returns_what_it_finished():
    scheduler, manager = make(num_blocks=16, block_size=4)
    done = decoding(scheduler, manager, 0, prompt_len=6, outputs=[3], max_new_tokens=2)
    going = decoding(scheduler, manager, 1, prompt_len=6, outputs=[3], max_new_tokens=5)
    batch = scheduler.schedule_next_batch()
    finished = scheduler.update_from_output(batch, {0: 11, 1: 12})
    assert done.output_tokens == [3, 11] and going.output_tokens == [3, 12], "each sampled token should be appended"
    assert finished == [done], "update_from_output should return exactly the requests it finished"
    assert done.status is RequestStatus.FINISHED and done.id not in scheduler.active_pool, (
        "a request with all its tokens should be FINISHED and leave active_pool"
    )
    assert manager.get_block_ids(done) == [] and len(manager.get_block_ids(going)) == 2, (
        "the finished request's blocks should be freed, the other's kept"
    )


@pytest.mark.ex2_5
def test_end_of_sequence_token_finishes_and_frees():
    scheduler, manager = make()
    request = decoding(scheduler, manager, 0, prompt_len=5, outputs=[3], max_new_tokens=10)
    request.eos_token_id = 0
    batch = scheduler.schedule_next_batch()
    assert scheduler.update_from_output(batch, {0: 0}) == [request], (
        "sampling the request's end-of-sequence token (eos_token_id) should finish it, and update_from_output "
        "should return it: is your test for 'complete' the request's own is_complete()?"
    )
    assert request.status is RequestStatus.FINISHED, "sampling the end-of-sequence token should finish the request"
    assert manager.get_num_free_blocks() == manager.num_blocks, "the finished request's blocks should be freed"
    assert not scheduler.has_unfinished_requests(), "nothing should be left to run"


@pytest.mark.ex2_5
def test_a_chunk_that_does_not_reach_the_end_samples_nothing():
    scheduler, manager = make(block_size=8, token_budget=16)
    request = prefilling(scheduler, manager, 0, prompt_len=40, computed=0)
    batch = scheduler.schedule_next_batch()
    assert scheduler.update_from_output(batch, {}) == [], "a mid-prompt chunk finishes nothing"
    assert request.output_tokens == [] and request.status is RequestStatus.RUNNING, (
        "a chunk that does not complete the prompt must not append a token"
    )


@pytest.mark.ex2_5
def test_a_missing_token_or_a_stale_batch_is_a_clear_error():
    scheduler, manager = make()
    decoding(scheduler, manager, 0, prompt_len=5, outputs=[3], max_new_tokens=1)
    batch = scheduler.schedule_next_batch()
    error = raised_by(lambda: scheduler.update_from_output(batch, {}))  # the decode must sample: no token came
    assert isinstance(error, ValueError) and "0" in str(error), (
        f"a sequence that should have sampled but got no token should be a ValueError that names its request; "
        f"got {error!r}"
    )
    scheduler.update_from_output(batch, {0: 7})
    error = raised_by(lambda: scheduler.update_from_output(batch, {0: 7}))  # the same batch again: 0 has finished
    assert isinstance(error, ValueError) and "not running" in str(error), (
        f"a batch entry for a request that is no longer running should be a ValueError that says 'not running'; "
        f"got {error!r}"
    )


# --------------------------------------------------------------------------------------- 2.6
@pytest.mark.ex2_6
def test_admission_stops_at_a_head_that_does_not_fit():
    scheduler, manager = make(num_blocks=10, block_size=4)
    hold_blocks(manager, 28)  # 7 of 10 blocks taken by someone else
    big = Request(id=0, prompt_tokens=prompt(16), max_new_tokens=4)  # needs 4 blocks now
    small = Request(id=1, prompt_tokens=prompt(3), max_new_tokens=4)  # needs 1 block now
    queue(scheduler, big, small)
    batch = scheduler.schedule_next_batch()
    assert not batch, "first come, first served: when the head does not fit, nobody behind it is admitted"
    assert list(scheduler.waiting_queue) == [big, small], "both should keep waiting, in their order"
    assert big.status is RequestStatus.WAITING and small.status is RequestStatus.WAITING, "nobody was admitted"
    assert manager.get_num_free_blocks() == 3, "a step that admits nobody must not hold any new block"


@pytest.mark.ex2_6
def test_admission_follows_the_queue_and_the_batch_size():
    scheduler, _ = make(max_batch_size=2)
    requests = [Request(id=i, prompt_tokens=prompt(3), max_new_tokens=2) for i in range(3)]
    queue(scheduler, *requests)
    batch = scheduler.schedule_next_batch()
    assert [s.request_id for s in batch] == [0, 1], "admissions should follow the queue order, up to max_batch_size"
    assert len(scheduler.active_pool) == 2 and list(scheduler.waiting_queue) == [requests[2]], (
        "the third request should wait: max_batch_size requests are running"
    )


@pytest.mark.ex2_6
def test_running_requests_count_against_the_batch_size():
    scheduler, manager = make(max_batch_size=3, token_budget=64)
    decoding(scheduler, manager, 0, prompt_len=5, outputs=[9])
    prefilling(scheduler, manager, 1, prompt_len=30, computed=8)
    prefilling(scheduler, manager, 2, prompt_len=30, computed=8)  # running, but gets no chunk this step
    queue(scheduler, Request(id=3, prompt_tokens=prompt(3), max_new_tokens=2))
    scheduler.schedule_next_batch()
    assert len(scheduler.active_pool) <= 3, "admission must keep the running set within max_batch_size"


@pytest.mark.ex2_6
def test_admissions_come_after_the_running_requests():
    scheduler, manager = make(block_size=8, token_budget=64)
    decoding(scheduler, manager, 0, prompt_len=6, outputs=[1])
    prefilling(scheduler, manager, 1, prompt_len=30, computed=8)
    newcomer = Request(id=4, prompt_tokens=prompt(10), max_new_tokens=2)
    queue(scheduler, newcomer)
    output = scheduler.schedule_next_batch()
    assert [s.request_id for s in output] == [0, 1, 4], "admissions come last, after the decodes and the prefill"
    assert output[2].tokens == newcomer.prompt_tokens and newcomer.status is RequestStatus.RUNNING, (
        "the newcomer should be admitted with its whole prompt after the running requests"
    )


@pytest.mark.ex2_6
def test_a_step_that_preempted_admits_nobody():
    scheduler, manager = make()
    running = decoding(scheduler, manager, 0, prompt_len=8, outputs=[5])
    newcomer = Request(id=1, prompt_tokens=prompt(3), max_new_tokens=2)
    queue(scheduler, newcomer)
    refuse_memory(scheduler, preempts=True)  # the decode preempts someone and still gets no room
    output = scheduler.schedule_next_batch()
    assert not output, "the decode got no room, and a step that preempted must not admit anyone"
    assert list(scheduler.waiting_queue) == [newcomer] and newcomer.status is RequestStatus.WAITING, (
        "the memory freed by a preemption is for the running requests: the newcomer must keep waiting"
    )
    assert running.num_computed_tokens == 8, "the refused decode must not advance"


def steady_stream_run(scheduler: StallFreeScheduler, arrival_steps: int = 150):
    """Four small requests, then a 40-token one, then four new small ones after every step.

    No request ever needs a block beyond those of its first chunk (a small one holds 7 tokens at most, the
    large one wants a single token), so nobody is ever preempted: only admission decides who runs.
    """
    queue(scheduler, *toy_requests([6] * 4, max_new_tokens=2, seed=1, first_id=10))
    head = toy_requests([40], max_new_tokens=1, seed=2)[0]
    queue(scheduler, head)
    new_ids = itertools.count(100, 4)

    def arrive(iteration, batch, scheduler):
        if iteration < arrival_steps:
            queue(scheduler, *toy_requests([6] * 4, max_new_tokens=2, seed=1000 + iteration, first_id=next(new_ids)))

    return head, run(scheduler, on_step=arrive, max_iterations=2_000)


@pytest.mark.ex2_6
def test_a_large_request_is_not_starved_by_a_stream_of_small_ones():
    scheduler, manager = make(num_blocks=16, block_size=4, token_budget=64, max_batch_size=8)
    head, trace = steady_stream_run(scheduler)
    finished_at = next((step.iteration for step in trace.steps if head.id in step.finished), None)
    assert finished_at is not None and finished_at <= 20, (
        "a 40-token request near the head of the queue should finish within 20 steps while small requests keep "
        f"arriving (four per step); it finished at step {finished_at} of {len(trace.steps)}. Skipping past a "
        "head that does not fit lets the small ones take every freed block."
    )
    assert head.output_tokens == toy_generate(head.prompt_tokens, 1), "the large request's output is wrong"
    assert manager.get_num_free_blocks() == 16, "all blocks should be free at the end"


@pytest.mark.ex2_6
def test_one_token_request_finishes_after_its_prefill():
    scheduler, manager = make()
    request = Request(id=0, prompt_tokens=prompt(9), max_new_tokens=1)
    trace = run_all(scheduler, [request])
    assert len(trace.steps) == 1, "a request that wants one token should finish in the step that prefills it"
    assert request.status is RequestStatus.FINISHED and len(request.output_tokens) == 1, (
        "the prefill's sampled token should finish the request"
    )
    assert manager.get_num_free_blocks() == manager.num_blocks, "its blocks should be freed"


@pytest.mark.ex2_6
def test_freed_blocks_let_the_next_request_run():
    scheduler, manager = make(num_blocks=4, block_size=4)  # room for one request at a time
    requests = toy_requests([13, 13], max_new_tokens=3, seed=3)
    run_all(scheduler, requests)
    for request in requests:
        assert request.status is RequestStatus.FINISHED, "every request should finish once memory is freed"
        assert request.output_tokens == toy_generate(request.prompt_tokens, 3), "a request's outputs are wrong"
    assert manager.get_num_free_blocks() == 4, "all blocks should be free at the end"


# --------------------------------------------------------------------------------------- 2.7
def three_running(num_blocks: int = 32):
    """Scheduler with requests 0, 1, 2 running (admitted in that order) and request 3 waiting."""
    scheduler, manager = make(num_blocks=num_blocks, block_size=4)
    running = [decoding(scheduler, manager, i, prompt_len=6 + i, outputs=[1, 2]) for i in range(3)]
    waiting = Request(id=3, prompt_tokens=prompt(4), max_new_tokens=2)
    queue(scheduler, waiting)
    return scheduler, manager, running, waiting


@pytest.mark.ex2_7
def test_preemption_picks_the_most_recently_admitted_and_frees_it():
    scheduler, manager, running, _ = three_running()
    free_before = manager.get_num_free_blocks()
    held = len(manager.get_block_ids(running[2]))
    victim = scheduler._preempt_most_recent()
    assert victim is running[2], "the victim should be the most recently admitted running request"
    assert list(scheduler.active_pool) == [running[0].id, running[1].id], "the victim, and only it, leaves"
    assert manager.get_block_ids(victim) == [] and manager.get_num_free_blocks() == free_before + held, (
        "the victim's blocks should all be freed"
    )
    assert victim.num_computed_tokens == 0, "a preempted request keeps nothing in the cache"
    assert victim.status is RequestStatus.PREEMPTED, "the victim's status should say it was preempted"
    assert victim.output_tokens == [1, 2], "generated tokens must be kept (they are recomputed, not lost)"


@pytest.mark.ex2_7
def test_preempted_requests_go_to_the_head_of_the_queue_and_are_counted():
    scheduler, _, running, waiting = three_running()
    scheduler._preempt_most_recent()
    scheduler._preempt_most_recent()
    assert [r.id for r in scheduler.waiting_queue] == [running[1].id, running[2].id, waiting.id], (
        "preempted requests should wait at the head of the queue, ahead of new ones"
    )
    assert running[2].num_preemptions == 1 and running[1].num_preemptions == 1, (
        "each preempted request should count its preemption"
    )
    assert scheduler.num_preemptions == 2, "the scheduler should count every preemption"


# --------------------------------------------------------------------------------------- 2.8
@pytest.mark.ex2_8
def test_a_decode_at_a_block_boundary_with_no_free_block_preempts_the_newest():
    scheduler, manager = make(num_blocks=4, block_size=4)
    older = decoding(scheduler, manager, 0, prompt_len=8, outputs=[5])  # 8 cached: 2 full blocks
    newer = decoding(scheduler, manager, 1, prompt_len=8, outputs=[5])  # 8 cached: 2 full blocks
    output = plan()
    assert scheduler._schedule_running(older, 1, output) is True, (
        "the older request's decode should get room by preempting the newer one"
    )
    assert [s.request_id for s in output] == [older.id] and output.preempted_req_ids == [newer.id], (
        "the plan holds the older request's decode and says who was preempted for it"
    )
    assert newer.status is RequestStatus.PREEMPTED and scheduler.waiting_queue[0] is newer, (
        "the newer request should be preempted and wait at the head of the queue"
    )
    assert len(manager.get_block_ids(older)) == 3, "the older request should get the block it needed"


@pytest.mark.ex2_8
def test_the_newest_request_steps_back_itself():
    scheduler, manager = make(num_blocks=4, block_size=4)
    older = decoding(scheduler, manager, 0, prompt_len=3, outputs=[5])  # 4 cached: 1 full block
    newest = decoding(scheduler, manager, 1, prompt_len=8, outputs=[5])  # 8 cached: 2 full blocks
    hold_blocks(manager, 4)  # the last block
    output = plan()
    assert scheduler._schedule_running(newest, 1, output) is False, (
        "with no block free, the newest request must step back itself (return False)"
    )
    assert not output, "a request that stepped back is not planned"
    assert newest.status is RequestStatus.PREEMPTED and list(scheduler.waiting_queue) == [newest], (
        "it should be preempted and wait at the head of the queue"
    )
    assert older.status is RequestStatus.RUNNING and list(scheduler.active_pool) == [older.id], (
        "an older request must never be preempted for a newer one"
    )


@pytest.mark.ex2_8
def test_preemption_stops_as_soon_as_it_fits():
    scheduler, manager, running, _ = three_running(num_blocks=7)  # 2 + 2 + 3 blocks held: none free
    assert manager.get_num_free_blocks() == 0, "(setup) the cache should be full"
    assert scheduler._schedule_running(running[0], 2, plan()) is True, "the oldest request should get its block"
    assert scheduler.num_preemptions == 1 and list(scheduler.active_pool) == [running[0].id, running[1].id], (
        "one victim (the newest) freed enough: nobody else should be preempted"
    )


@pytest.mark.ex2_8
def test_preemption_goes_on_until_it_fits():
    scheduler, manager = make(num_blocks=7, block_size=4)
    oldest = prefilling(scheduler, manager, 0, prompt_len=24, computed=4)  # 1 block
    middle = decoding(scheduler, manager, 1, prompt_len=7, outputs=[5])  # 7 cached: 2 blocks
    newest = decoding(scheduler, manager, 2, prompt_len=7, outputs=[5])  # 7 cached: 2 blocks
    assert scheduler._schedule_running(oldest, 20, plan()) is True, (
        "the oldest request's chunk should get its blocks: when one victim frees too little, preempt the next "
        "newest, and so on, until allocate_slots succeeds"
    )
    assert list(scheduler.active_pool) == [oldest.id] and scheduler.num_preemptions == 2, (
        "both younger requests had to step back for the oldest one"
    )
    assert list(scheduler.waiting_queue) == [middle, newest], (
        "the preempted requests should wait at the head of the queue, the older one first"
    )


@pytest.mark.ex2_8
def test_a_step_without_memory_preempts_and_the_newest_steps_back():
    scheduler, manager = make(num_blocks=4, block_size=4)
    hold_blocks(manager, 8)
    request = decoding(scheduler, manager, 0, prompt_len=8, outputs=[5])  # 8 cached: 2 full blocks
    batch = scheduler.schedule_next_batch()
    assert not batch, "nothing can run while someone else holds the memory"
    assert request.status is RequestStatus.PREEMPTED and list(scheduler.waiting_queue) == [request], (
        "the request should preempt itself rather than run without memory"
    )
    assert manager.get_num_free_blocks() == 2, "its blocks should be freed"


@pytest.mark.ex2_8
def test_preemption_loses_nothing():
    scheduler, manager = make(num_blocks=12, block_size=4, token_budget=16, max_batch_size=4)
    requests = toy_requests([14, 9, 17, 6], max_new_tokens=[20, 25, 12, 30], seed=4)
    run_all(scheduler, requests)
    assert scheduler.num_preemptions > 0, "this workload should need preemption (memory is tight)"
    for request in requests:
        assert request.status is RequestStatus.FINISHED, "every request should finish despite preemptions"
        assert request.output_tokens == toy_generate(request.prompt_tokens, request.max_new_tokens), (
            "a preempted request's outputs differ from an unconstrained run"
        )
    assert sum(r.num_preemptions for r in requests) == scheduler.num_preemptions, "preemption counts disagree"
    assert manager.get_num_free_blocks() == 12, "all blocks should be free at the end"


# --------------------------------------------------------------------------------------- 2.9
@pytest.mark.ex2_9
def test_a_request_that_can_never_fit_is_rejected_with_a_reason():
    scheduler, _ = make(num_blocks=4, block_size=4)  # 16 tokens in all
    request = Request(id=0, prompt_tokens=prompt(10), max_new_tokens=7)
    scheduler.add_request(request)
    assert request.status is RequestStatus.REJECTED, (
        "a request whose prompt plus max_new_tokens needs more blocks than the whole cache has (a partial block "
        "counts as a whole one) should be REJECTED"
    )
    assert isinstance(request.reason, str) and request.reason.strip(), "a rejected request should say why"
    assert scheduler.rejected == [request], "the rejected request should be listed in scheduler.rejected"
    assert request not in scheduler.waiting_queue, "a rejected request should not wait"
    assert not scheduler.has_unfinished_requests(), "a rejected request is settled, not unfinished"


@pytest.mark.ex2_9
def test_a_request_that_fits_exactly_is_accepted():
    scheduler, manager = make(num_blocks=4, block_size=4)
    hold_blocks(manager, 4)  # someone else holds a block for now: they will give it back
    request = Request(id=0, prompt_tokens=prompt(10), max_new_tokens=6)
    assert scheduler._reject_if_never_fits(request) is False, (
        "a request that fits the whole cache is not rejected, even while other requests hold part of it"
    )
    scheduler.add_request(request)
    assert request.status is RequestStatus.WAITING, "a request that fits the whole cache should wait, not be rejected"
    assert list(scheduler.waiting_queue) == [request] and not scheduler.rejected, "it should be in the waiting queue"


@pytest.mark.ex2_9
def test_a_prompt_longer_than_the_cache_is_rejected():
    scheduler, _ = make(num_blocks=2, block_size=8)
    request = Request(id=0, prompt_tokens=prompt(17), max_new_tokens=1)
    scheduler.add_request(request)
    assert request.status is RequestStatus.REJECTED, "a prompt bigger than the cache should be REJECTED"


@pytest.mark.ex2_9
def test_a_rejected_request_does_not_stop_the_others():
    scheduler, manager = make(num_blocks=6, block_size=4)
    ok_a, too_big, ok_b = toy_requests([8, 30, 5], max_new_tokens=[4, 4, 6], seed=5)
    for request in (ok_a, too_big, ok_b):
        scheduler.add_request(request)
    run(scheduler, max_iterations=500)
    assert too_big.status is RequestStatus.REJECTED, "the request that can never fit should be REJECTED"
    for request in (ok_a, ok_b):
        assert request.status is RequestStatus.FINISHED, "requests that fit should still finish"
        assert request.output_tokens == toy_generate(request.prompt_tokens, request.max_new_tokens), (
            "a request's outputs are wrong"
        )
    assert manager.get_num_free_blocks() == 6, "all blocks should be free at the end"


# --------------------------------------------------------------------------------------- clause by clause
# Each test below breaks when one clause of its exercise's contract alone is broken. Request ids are not in
# arrival order on purpose (the newest admission is neither the highest nor the lowest id), chunks are several
# tokens long (a budget counted in sequences differs), and recomputes carry output tokens (the prefill then
# covers prompt + outputs, and only the chunk that reaches num_tokens samples).


def running(
    scheduler: StallFreeScheduler, manager: MockKVCacheManager, request_id: int, prompt_len: int, outputs, computed: int
) -> Request:
    """A running request with `computed` of its tokens cached (a recompute in progress when outputs exist)."""
    request = Request(
        id=request_id, prompt_tokens=prompt(prompt_len, 100 * request_id + 1), max_new_tokens=50, output_tokens=outputs
    )
    assert manager.allocate_slots(request, computed) is not None, "(setup) the mock is too small"
    request.num_computed_tokens = computed
    request.status = RequestStatus.RUNNING
    scheduler.active_pool[request.id] = request
    return request


class SpyManager(MockKVCacheManager):
    """A mock that writes down every free(request) call, by request id."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self.freed: list[int] = []

    def free(self, request: Request) -> None:
        self.freed.append(request.id)
        super().free(request)


@pytest.mark.ex2_1
def test_a_recompute_chunk_that_stops_inside_the_outputs_samples_nothing():
    request = Request(id=4, prompt_tokens=prompt(5), max_new_tokens=9, output_tokens=[70, 71, 72])
    first = StallFreeScheduler._new_sequence(request, 6)  # the prompt and one kept output: 2 still to feed
    assert type(first) is ScheduledSequence, "_new_sequence returns a ScheduledSequence"
    assert first.tokens == prompt(5) + [70], "a recompute's chunk follows request.all_token_ids (prompt, then outputs)"
    assert not first.samples_token, (
        "a recompute chunk that covers the prompt but not all the kept outputs does not reach the end of the "
        "request's tokens (request.num_tokens): it samples nothing"
    )
    assert not first.is_decode, "a request that is recomputing is not past its prefill: no decode"
    request.num_computed_tokens = 6
    rest = StallFreeScheduler._new_sequence(request, 2)
    assert (rest.tokens, rest.position_ids_start) == ([71, 72], 6), (
        "the rest of a recompute feeds the remaining outputs, from the position where the cache ends"
    )
    assert rest.samples_token and not rest.is_decode, (
        "the recompute chunk that reaches num_tokens samples, as a prefill"
    )


@pytest.mark.ex2_1
def test_a_one_token_chunk_inside_the_prompt_is_not_a_decode():
    request = Request(id=2, prompt_tokens=prompt(10), max_new_tokens=3)
    request.num_computed_tokens = 3
    seq = StallFreeScheduler._new_sequence(request, 1)  # a budget of one token left
    assert seq.tokens == [4] and seq.position_ids_start == 3, "the chunk is the next prompt token, at its position"
    assert not seq.is_decode and not seq.samples_token, (
        "is_decode says the request is past its prefill (request.is_prefill_done()), not that the chunk is one token"
    )


@pytest.mark.ex2_1
def test_a_planned_decode_is_a_scheduled_sequence_and_the_call_says_true():
    scheduler, manager = make()
    request = decoding(scheduler, manager, 6, prompt_len=4, outputs=[8, 9])
    output = plan()
    result = scheduler._schedule_running(request, 1, output)
    assert result is True, "_schedule_running returns True when it planned the request"
    assert [type(s) for s in output] == [ScheduledSequence], "the plan holds the request's ScheduledSequence"
    assert output[0].tokens == [9] and output[0].positions == range(5, 6), (
        "a decode feeds the newest output token at the position after the cached ones"
    )


@pytest.mark.ex2_2
def test_a_failed_admission_leaves_the_status_as_it_was():
    scheduler, manager = make(num_blocks=4, block_size=4)
    hold_blocks(manager, 13)  # all 4 blocks held by someone else
    newcomer = Request(id=5, prompt_tokens=prompt(3), max_new_tokens=2)
    newcomer.status = RequestStatus.WAITING
    back = Request(id=2, prompt_tokens=prompt(6), max_new_tokens=5, output_tokens=[61, 62])
    back.status = RequestStatus.PREEMPTED
    queue(scheduler, back, newcomer)
    for request, status in ((back, RequestStatus.PREEMPTED), (newcomer, RequestStatus.WAITING)):
        output = plan()
        assert scheduler._admit(request, 64, output) is False, "nothing fits, so the admission should fail (False)"
        assert request.status is status, (
            "a failed admission changes nothing: the request keeps the status it had (set RUNNING only on success)"
        )
        assert not output and request.num_computed_tokens == 0, "a failed admission plans nothing, computes nothing"
    assert list(scheduler.waiting_queue) == [back, newcomer] and not scheduler.active_pool, (
        "after a failed admission every request keeps its place in the queue"
    )
    assert back.output_tokens == [61, 62], "a failed admission must not touch the request's outputs"


@pytest.mark.ex2_2
def test_a_preempted_request_is_readmitted_with_its_outputs_as_prefill():
    scheduler, manager = make(num_blocks=16, block_size=4)
    older = decoding(scheduler, manager, 9, prompt_len=3, outputs=[1])
    back = Request(id=3, prompt_tokens=prompt(6), max_new_tokens=5, output_tokens=[61, 62])
    back.status = RequestStatus.PREEMPTED
    queue(scheduler, back)
    output = plan()
    assert scheduler._admit(back, 64, output) is True, "a preempted request that fits should be admitted again (True)"
    [seq] = list(output)
    assert seq.tokens == prompt(6) + [61, 62] and seq.position_ids_start == 0, (
        "nothing of a preempted request is cached: its first chunk is its prompt AND its kept outputs, from 0"
    )
    assert seq.samples_token and not seq.is_decode, "the recompute reaches num_tokens: it samples, as a prefill"
    assert list(scheduler.active_pool) == [older.id, back.id], "the admitted request is the newest entry of active_pool"
    assert len(manager.get_block_ids(back)) == 2, "the recompute's blocks cover the prompt and the outputs"
    cut, cut_manager = make(num_blocks=16, block_size=4)
    again = Request(id=3, prompt_tokens=prompt(6), max_new_tokens=5, output_tokens=[61, 62])
    queue(cut, again)
    output = plan()
    assert cut._admit(again, 7, output) is True, "a request whose first chunk fits the budget should be admitted"
    assert output[0].tokens == prompt(6) + [61] and not output[0].samples_token, (
        "a recompute's first chunk is cut to the budget left; one that stops before num_tokens samples nothing"
    )


@pytest.mark.ex2_3
def test_a_finished_request_gives_its_blocks_back_once():
    manager = SpyManager(num_blocks=16, block_size=4)
    scheduler = StallFreeScheduler(64, 8, manager)
    done = decoding(scheduler, manager, 7, prompt_len=6, outputs=[3, 4], max_new_tokens=2)
    going = decoding(scheduler, manager, 2, prompt_len=6, outputs=[3], max_new_tokens=5)
    scheduler._finish(done)
    assert manager.freed == [done.id], (
        "a finished request's blocks go back to the manager once (one free(request) call), and only its own"
    )
    assert list(scheduler.active_pool) == [going.id], "only the finished request leaves active_pool"


@pytest.mark.ex2_4
def test_the_budget_left_counts_tokens_not_sequences():
    scheduler, _ = make(token_budget=20, max_batch_size=4)
    output = plan()
    output.add(ScheduledSequence(request_id=1, tokens=prompt(6), is_decode=False, position_ids_start=0))
    output.add(ScheduledSequence(request_id=8, tokens=[5], is_decode=True, position_ids_start=9))
    left = scheduler._budget_left(output)
    assert type(left) is int and left == 20 - 7, "the budget left is the token budget minus the tokens planned"
    assert scheduler._has_room(output, 13) and not scheduler._has_room(output, 14), (
        "_has_room(output, n) is True exactly when n more tokens fit the budget left"
    )
    output.remove(1)  # preempted later in the step: its tokens are out of the plan again
    assert scheduler._budget_left(output) == 20 - 1, "a request taken out of the plan gives its tokens back"
    for i in (2, 3, 4):
        output.add(ScheduledSequence(request_id=10 + i, tokens=[i], is_decode=True, position_ids_start=5))
    assert not scheduler._has_room(output), "a plan that holds max_batch_size sequences has no room, budget or not"


@pytest.mark.ex2_4
def test_is_prefilling_follows_the_tokens_still_to_feed():
    def state(prompt_len: int, outputs: list[int], computed: int) -> Request:
        request = Request(id=1, prompt_tokens=prompt(prompt_len), max_new_tokens=9, output_tokens=outputs)
        request.num_computed_tokens = computed
        return request

    is_prefilling = StallFreeScheduler._is_prefilling
    assert is_prefilling(state(10, [], 0)) and is_prefilling(state(10, [], 4)), "a prompt not yet fed is prefilling"
    assert is_prefilling(state(10, [7, 8, 9], 10)), (
        "a recompute that has fed its prompt but not its kept outputs is still prefilling (tokens are uncomputed)"
    )
    assert is_prefilling(state(10, [7, 8, 9], 0)), "a recompute with nothing cached is prefilling"
    assert not is_prefilling(state(10, [7, 8], 11)), "a request past its prefill is decoding, not prefilling"
    assert not is_prefilling(state(10, [], 10)), (
        "a request whose tokens are all computed (waiting for its first sampled token) has nothing left to feed"
    )


@pytest.mark.ex2_4
def test_a_recompute_with_outputs_is_continued_to_its_end():
    scheduler, manager = make(block_size=4, token_budget=64)
    request = running(scheduler, manager, 5, prompt_len=10, outputs=[7, 8, 9], computed=10)  # prompt recomputed
    output = scheduler.schedule_next_batch()
    assert type(output) is SchedulerOutput, "schedule_next_batch returns the step's SchedulerOutput"
    assert [(s.request_id, s.is_decode) for s in output] == [(5, False)], (
        "a recompute whose prompt is cached but whose kept outputs are not is still prefilling: it gets a chunk"
    )
    assert output[0].tokens == [7, 8, 9] and output[0].position_ids_start == 10, (
        "the chunk feeds the kept outputs, from where the cache ends"
    )
    assert output[0].samples_token, "the chunk that reaches num_tokens samples the next token"
    assert request.num_computed_tokens == 13, "once planned, the chunk's tokens count as computed"


@pytest.mark.ex2_4
def test_decodes_and_the_prefill_follow_admission_order_not_ids():
    scheduler, manager = make(block_size=8, token_budget=64)
    decoding(scheduler, manager, 5, prompt_len=6, outputs=[1])
    prefilling(scheduler, manager, 6, prompt_len=30, computed=8)
    decoding(scheduler, manager, 2, prompt_len=6, outputs=[1])
    prefilling(scheduler, manager, 1, prompt_len=20, computed=8)
    decoding(scheduler, manager, 8, prompt_len=6, outputs=[1])
    output = scheduler.schedule_next_batch()
    assert [s.request_id for s in output] == [5, 2, 8, 6], (
        "decodes go in admission order (active_pool's order, not by id), then the OLDEST admitted request "
        "that is still prefilling"
    )


def preempting_newest(scheduler: StallFreeScheduler, keep_tokens: bool = False) -> list[int]:
    """Stand in for _schedule_running (2.1, 2.7, 2.8): the first call preempts the newest admission, as a short memory
    would (it leaves active_pool; with keep_tokens, as a swap-out, it keeps its cached tokens), then every call is
    planned. Returns the ids it was called for. The victim is kept out of the queue so no admission runs (2.6)."""
    calls: list[int] = []

    def schedule_running(request: Request, num_new_tokens: int, output: SchedulerOutput) -> bool:
        calls.append(request.id)
        if len(calls) == 1:
            victim = next(reversed(scheduler.active_pool.values()))
            del scheduler.active_pool[victim.id]
            victim.num_computed_tokens = victim.num_computed_tokens if keep_tokens else 0
            victim.status = RequestStatus.PREEMPTED
            output.preempted_req_ids.append(victim.id)
        start = request.num_computed_tokens
        tokens = request.all_token_ids[start : start + num_new_tokens]
        output.add(ScheduledSequence(request.id, tokens, request.is_prefill_done(), start, True))
        return True

    scheduler._schedule_running = schedule_running
    return calls


@pytest.mark.ex2_4
def test_a_decode_that_preempts_during_the_decode_pass():
    scheduler, manager = make()
    older = decoding(scheduler, manager, 7, prompt_len=8, outputs=[5])
    decoding(scheduler, manager, 3, prompt_len=8, outputs=[5])
    calls = preempting_newest(scheduler)
    error = raised_by(scheduler.schedule_next_batch)
    assert error is None, (
        "a decode that preempts another request while the decodes are planned must not break the loop (iterate "
        f"a copy of active_pool: preemption changes it); got {error!r}"
    )
    assert calls == [older.id], "a request preempted a moment ago (it has left active_pool) gets nothing this step"


@pytest.mark.ex2_4
def test_a_request_preempted_in_this_step_gets_no_decode_even_if_its_tokens_are_kept():
    scheduler, manager = make()
    older = decoding(scheduler, manager, 7, prompt_len=8, outputs=[5])
    decoding(scheduler, manager, 3, prompt_len=8, outputs=[5])
    calls = preempting_newest(scheduler, keep_tokens=True)  # as a swap-out: still past its prefill
    output = scheduler.schedule_next_batch()
    assert calls == [older.id] and [s.request_id for s in output] == [older.id], (
        "a request preempted a moment ago (it has left active_pool, here with its tokens kept) gets no decode in "
        "the same step: check that it is still running"
    )


@pytest.mark.ex2_5
def test_a_sampled_token_is_stored_as_a_python_int():
    import numpy as np

    scheduler, manager = make()
    first = decoding(scheduler, manager, 4, prompt_len=5, outputs=[3], max_new_tokens=9)
    second = decoding(scheduler, manager, 1, prompt_len=5, outputs=[3], max_new_tokens=9)
    batch = scheduler.schedule_next_batch()
    scheduler.update_from_output(batch, {4: np.int64(11), 1: np.int32(12)})  # what a sampler on arrays hands back
    assert [type(t) for t in first.output_tokens + second.output_tokens] == [int] * 4, (
        "each sampled token is appended as an int (int(...)), whatever integer type the executor handed back"
    )
    assert first.output_tokens[-1] == 11 and second.output_tokens[-1] == 12, "each request gets its own sampled token"


@pytest.mark.ex2_5
def test_the_last_prefill_chunk_takes_its_sampled_token():
    scheduler, manager = make(block_size=4, token_budget=64)
    request = prefilling(scheduler, manager, 3, prompt_len=10, computed=4)
    batch = scheduler.schedule_next_batch()
    assert batch[0].samples_token and not batch[0].is_decode, "(setup) the chunk completes the prompt"
    assert scheduler.update_from_output(batch, {3: 33}) == [], "a request with tokens still to generate goes on"
    assert request.output_tokens == [33], (
        "a prefill chunk that completes the prompt samples (samples_token): its token is appended, not only a decode's"
    )


@pytest.mark.ex2_5
def test_update_returns_the_finished_requests_in_plan_order_and_ignores_a_stray_token():
    scheduler, manager = make(block_size=4, token_budget=64)
    late = decoding(scheduler, manager, 5, prompt_len=5, outputs=[3], max_new_tokens=2)
    early = decoding(scheduler, manager, 2, prompt_len=5, outputs=[3], max_new_tokens=2)
    chunked = prefilling(scheduler, manager, 8, prompt_len=40, computed=0)
    scheduler.token_budget = 10  # the chunk stops inside the prompt
    batch = scheduler.schedule_next_batch()
    finished = scheduler.update_from_output(batch, {5: 1, 2: 2, 8: 9})
    assert finished == [late, early], "update_from_output returns the requests it finished, in plan order"
    assert chunked.output_tokens == [], (
        "a chunk that does not reach the end samples nothing: a token for it is not appended"
    )
    assert scheduler.finished == [late, early], "each finished request is settled once, through _finish"


@pytest.mark.ex2_6
def test_admission_gets_the_budget_left_in_tokens():
    scheduler, manager = make(block_size=4, token_budget=10)
    prefilling(scheduler, manager, 6, prompt_len=14, computed=8)  # 6 tokens left to feed
    newcomer = Request(id=2, prompt_tokens=prompt(8), max_new_tokens=2)
    queue(scheduler, newcomer)
    output = scheduler.schedule_next_batch()
    assert [s.request_id for s in output] == [6, 2], "the prefill in progress, then the admission"
    assert output.total_num_scheduled_tokens <= 10, "the step's tokens must stay within the token budget"
    assert len(output[1].tokens) == 10 - 6, "the admission's first chunk gets the budget left in tokens"


@pytest.mark.ex2_7
def test_the_victim_is_the_newest_admission_not_the_highest_id_or_the_longest():
    scheduler, manager = make(num_blocks=32, block_size=4)
    decoding(scheduler, manager, 4, prompt_len=6, outputs=[1])
    decoding(scheduler, manager, 9, prompt_len=20, outputs=[1, 2, 3])  # the highest id and the most tokens
    newest = decoding(scheduler, manager, 2, prompt_len=3, outputs=[1])  # admitted last
    victim = scheduler._preempt_most_recent()
    assert victim is newest, (
        "under first come, first served the victim is the most recently admitted running request (active_pool "
        "keeps admission order), whatever its id or size"
    )
    assert list(scheduler.active_pool) == [4, 9], "the others keep running, in their order"
    assert scheduler.waiting_queue[0] is newest, "the victim waits at the head of the queue"


@pytest.mark.ex2_7
def test_the_victim_is_preempted_and_returned():
    manager = SpyManager(num_blocks=32, block_size=4)
    scheduler = StallFreeScheduler(64, 8, manager)
    decoding(scheduler, manager, 6, prompt_len=6, outputs=[1])
    newest = decoding(scheduler, manager, 1, prompt_len=7, outputs=[2, 3])
    victim = scheduler._preempt_most_recent()
    assert victim is newest, "_preempt_most_recent returns the request it preempted"
    assert manager.freed == [newest.id], "the victim's blocks go back once, through self._preempt"
    assert newest.status is RequestStatus.PREEMPTED and newest.num_preemptions == 1, "the victim is preempted, counted"


@pytest.mark.ex2_8
def test_under_fcfs_nobody_older_is_preempted_whatever_the_ids():
    scheduler, manager = make(num_blocks=6, block_size=4)
    oldest = decoding(scheduler, manager, 8, prompt_len=8, outputs=[5])  # 8 cached: 2 full blocks
    middle = decoding(scheduler, manager, 1, prompt_len=8, outputs=[5])
    newest = decoding(scheduler, manager, 4, prompt_len=8, outputs=[5])
    assert scheduler._schedule_running(middle, 1, plan()) is True, "the middle request gets room by preemption"
    assert list(scheduler.active_pool) == [oldest.id, middle.id] and scheduler.num_preemptions == 1, (
        "only the newest admission steps back for it: never an older one, and no more than needed"
    )
    assert newest.status is RequestStatus.PREEMPTED, "the newest admission is the one preempted"


@pytest.mark.ex2_9
def test_the_reason_says_what_is_needed_and_what_there_is():
    scheduler, _ = make(num_blocks=3, block_size=4)  # 12 tokens in all
    request = Request(id=0, prompt_tokens=prompt(20), max_new_tokens=9)  # 29 tokens: 8 blocks
    result = scheduler._reject_if_never_fits(request)
    assert result is True, "a request that can never fit: _reject_if_never_fits returns True"
    assert request.status is RequestStatus.REJECTED and scheduler.rejected == [request], "it is REJECTED and listed"
    reason = request.reason or ""
    assert ("8" in reason or "29" in reason) and ("3" in reason or "12" in reason), (
        f"the reason should say what the request needs and what the cache has (blocks or tokens); it says {reason!r}"
    )
    fits = Request(id=1, prompt_tokens=prompt(5), max_new_tokens=7)  # 12 tokens: exactly the cache
    assert scheduler._reject_if_never_fits(fits) is False, "a request that fits the cache exactly is accepted (False)"
    assert fits.status is not RequestStatus.REJECTED and fits.reason is None, "when it returns False, nothing changed"
    assert scheduler.rejected == [request], "a request that fits is not listed as rejected"


@pytest.mark.ex2_2
def test_the_cached_prefix_blocks_reach_allocate_slots():
    hit_blocks = KVCacheBlocks([40, 41])

    class PrefixManager(MockKVCacheManager):
        """A mock reporting a 2-block cached prefix; it records what allocate_slots was told."""

        told: typing.ClassVar[list] = []

        def get_computed_blocks(self, request):
            return hit_blocks, 8

        def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None):
            self.told.append((num_new_computed_tokens, new_computed_blocks))
            return super().allocate_slots(request, num_new_tokens, num_new_computed_tokens)

    manager = PrefixManager(num_blocks=16, block_size=4)
    scheduler = StallFreeScheduler(64, 4, manager)
    request = Request(id=3, prompt_tokens=prompt(14), max_new_tokens=2)
    queue(scheduler, request)
    assert scheduler._admit(request, 64, plan()) is True, "a request that fits should be admitted (True)"
    assert manager.told == [(8, hit_blocks)], (
        "allocate_slots is told about the prefix hits: their token count (num_new_computed_tokens) AND the cached "
        "blocks get_computed_blocks returned (new_computed_blocks), so that the request's table holds them"
    )


@pytest.mark.ex2_4
def test_no_prefill_chunk_once_the_decodes_spent_the_budget():
    scheduler, manager = make(token_budget=2)
    decoding(scheduler, manager, 4, prompt_len=5, outputs=[9])
    decoding(scheduler, manager, 1, prompt_len=5, outputs=[9])
    waiting_chunk = prefilling(scheduler, manager, 6, prompt_len=20, computed=4)
    output = scheduler.schedule_next_batch()
    assert [s.request_id for s in output] == [4, 1], (
        "the prefill in progress is planned only while the plan has room (self._has_room): with the budget spent, "
        "it gets no chunk, not an empty one"
    )
    assert waiting_chunk.num_computed_tokens == 4, "a prefill that got nothing does not advance"


@pytest.mark.ex2_4
def test_the_batch_size_counts_the_plan_not_the_running_set():
    scheduler, manager = make(max_batch_size=3, token_budget=64)
    decoding(scheduler, manager, 9, prompt_len=5, outputs=[9])
    prefilling(scheduler, manager, 2, prompt_len=30, computed=8)
    prefilling(scheduler, manager, 5, prompt_len=30, computed=8)  # running, but only one prefill per step
    output = scheduler._has_room(plan())
    assert output is True, "an empty plan has room for a sequence even when max_batch_size requests are running"
    batch = scheduler.schedule_next_batch()
    assert [s.request_id for s in batch] == [9, 2], (
        "_has_room counts the sequences in the plan against max_batch_size (the running set may be full): the "
        "decode and the oldest prefill are planned"
    )


@pytest.mark.ex2_4
def test_a_prefill_preempted_during_the_decode_pass_gets_no_chunk():
    scheduler, manager = make()
    older = decoding(scheduler, manager, 7, prompt_len=8, outputs=[5])
    prefilling(scheduler, manager, 3, prompt_len=20, computed=8)  # the newest admission, still prefilling
    calls = preempting_newest(scheduler)
    error = raised_by(scheduler.schedule_next_batch)
    assert error is None, f"a step whose decode preempts the prefill in progress should plan the rest; got {error!r}"
    assert calls == [older.id], (
        "a request preempted a moment ago (it left active_pool) gets no prefill chunk in the same step: choose the "
        "prefill in progress after the decodes"
    )


@pytest.mark.ex2_5
def test_each_update_returns_only_what_it_finished_and_errors_name_the_request():
    scheduler, manager = make()
    first = decoding(scheduler, manager, 37, prompt_len=5, outputs=[3], max_new_tokens=2)
    second = decoding(scheduler, manager, 12, prompt_len=5, outputs=[3], max_new_tokens=3)
    assert scheduler.update_from_output(scheduler.schedule_next_batch(), {37: 1, 12: 2}) == [first], (
        "the first update finishes the request that got its last token"
    )
    assert scheduler.update_from_output(scheduler.schedule_next_batch(), {12: 4}) == [second], (
        "update_from_output returns the requests THIS update finished, not every request finished so far"
    )
    third = decoding(scheduler, manager, 41, prompt_len=5, outputs=[3], max_new_tokens=4)
    batch = scheduler.schedule_next_batch()
    error = raised_by(lambda: scheduler.update_from_output(batch, {}))
    assert isinstance(error, ValueError) and "41" in str(error), (
        f"a sequence that should have sampled but got no token is a ValueError naming its request; got {error!r}"
    )
    scheduler.update_from_output(batch, {41: 5})
    scheduler._finish(third)
    error = raised_by(lambda: scheduler.update_from_output(batch, {41: 5}))
    assert isinstance(error, ValueError) and "41" in str(error) and "not running" in str(error), (
        f"a plan entry for a request that is not running is a ValueError naming the request; got {error!r}"
    )


@pytest.mark.ex2_6
def test_nobody_is_admitted_once_the_budget_is_spent():
    scheduler, manager = make(token_budget=2)
    decoding(scheduler, manager, 4, prompt_len=5, outputs=[9])
    decoding(scheduler, manager, 1, prompt_len=5, outputs=[9])
    newcomer = Request(id=8, prompt_tokens=prompt(3), max_new_tokens=2)
    queue(scheduler, newcomer)
    output = scheduler.schedule_next_batch()
    assert [s.request_id for s in output] == [4, 1], "admission only while the plan has room (self._has_room)"
    assert newcomer.status is RequestStatus.WAITING and list(scheduler.waiting_queue) == [newcomer], (
        "with the token budget spent, a newcomer keeps waiting"
    )


@pytest.mark.ex2_6
def test_a_request_preempted_in_an_earlier_step_is_admitted_again():
    scheduler, manager = make(num_blocks=16, block_size=4)
    back = Request(id=9, prompt_tokens=prompt(6), max_new_tokens=5, output_tokens=[61])
    back.status, back.num_preemptions = RequestStatus.PREEMPTED, 1
    scheduler.num_preemptions = 1  # an earlier step preempted it; this one preempts nobody
    newcomer = Request(id=2, prompt_tokens=prompt(3), max_new_tokens=2)
    queue(scheduler, back, newcomer)
    output = scheduler.schedule_next_batch()
    assert [s.request_id for s in output] == [9, 2], (
        "only a step that preempted (output.preempted_req_ids) admits nobody: a later step admits again, a "
        "preempted request at the head of the queue first"
    )
    assert back.status is RequestStatus.RUNNING and not scheduler.waiting_queue, "both are admitted and running"


@pytest.mark.ex2_7
def test_the_victim_is_the_newest_admission_even_when_it_arrived_first():
    scheduler, manager = make(num_blocks=32, block_size=4)
    back = decoding(scheduler, manager, 6, prompt_len=5, outputs=[1, 2])  # arrived first, preempted, re-admitted
    back.arrival_time = 1.0
    del scheduler.active_pool[back.id]
    for request_id, arrival in ((3, 2.0), (8, 3.0)):
        decoding(scheduler, manager, request_id, prompt_len=6, outputs=[1]).arrival_time = arrival
    scheduler.active_pool[back.id] = back  # admitted last
    assert scheduler._preempt_most_recent() is back, (
        "the victim is the most recently ADMITTED running request (active_pool's order), not the latest arrival"
    )


# ---- lockstep (issue 35): every call compared with the reference on seeded random and adversarial workloads ----
@pytest.mark.parametrize(
    "exercise_id",
    [
        pytest.param(i, marks=getattr(pytest.mark, "ex" + i.replace(".", "_")))
        for i in (
            "2.1",
            "2.2",
            "2.3",
            "2.4",
            "2.5",
            "2.6",
            "2.7",
            "2.8",
            "2.9",
        )
    ],
)
def test_lockstep_with_the_reference(exercise_id):
    """The first call where this exercise's code differs from the reference fails, naming the rule it breaks."""
    from kvcourse.course.lockstep import assert_lockstep

    assert_lockstep(exercise_id)
