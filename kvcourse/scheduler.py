# kvcourse/scheduler.py holds exercises 2.1-2.9, 7.1-7.4: write only inside their TODO regions (the rest is given).
"""The memory-aware StallFreeScheduler (exercises 2.1-2.9, 7.1-7.4): it plans each step and secures its KV memory.

Policy lives here (who runs, who is preempted or rejected); mechanism in the KV-cache manager, reached
only through `KVCacheManagerProtocol` (kvcourse/core/contract.py). `schedule_next_batch()` (vLLM's
`Scheduler.schedule()`) plans decodes, then one prefill in progress, then admissions, each only once
`allocate_slots` has succeeded, into a `SchedulerOutput`; then it applies the plan once. Knobs: kvcourse/core/scheduler_config.py.
"""

from __future__ import annotations

from collections import deque

from kvcourse.core.contract import KVCacheManagerProtocol, blocks_needed, check_implements  # noqa: F401
from kvcourse.core.request import Request, RequestStatus
from kvcourse.core.sched_base import SchedulerBase
from kvcourse.core.sched_output import ScheduledSequence, SchedulerOutput
from kvcourse.core.scheduler_config import PreemptionCosts, check_knobs, positive_int
from kvcourse.offload import CPUOffloadTier, SecondTierScheduling


def swap_seconds(num_tokens: int, costs: PreemptionCosts) -> float:
    """A swap's round trip: the victim's K/V out to the CPU pool and, later, back in."""
    # Exercise 7.3 (swap): returns the seconds that swapping out and later swapping back in the K/V
    #   of num_tokens tokens costs: two transfers (out, then in), each paying the link's fixed
    #   latency plus the bytes moved over the link's bandwidth. 0 tokens cost nothing (no transfer).
    # TODO: Exercise 7.3: write your code here, then delete the raise below.
    raise NotImplementedError(
        "Exercise 7.3 (Swap or recompute: a CPU pool and the cost model): not written yet: edit kvcourse/scheduler.py, swap_seconds."
    )


def recompute_seconds(num_tokens: int, costs: PreemptionCosts) -> float:
    """A recompute: the victim's tokens fed through the model again (attention's share is left out)."""
    # Exercise 7.3 (recompute): returns the seconds that feeding num_tokens tokens through the model
    #   again costs: their FLOPs (costs.flops_per_token each) at costs.flops_per_s.
    # TODO: Exercise 7.3: write your code here, then delete the raise below.
    raise NotImplementedError(
        "Exercise 7.3 (Swap or recompute: a CPU pool and the cost model): not written yet: edit kvcourse/scheduler.py, recompute_seconds."
    )


def swap_crossover(costs: PreemptionCosts, max_tokens: int) -> int | None:
    """The shortest context (in tokens) for which swapping is cheaper than recomputing, up to max_tokens."""
    # Exercise 7.3 (the crossover): returns the smallest n from 1 to max_tokens for which
    #   swap_seconds(n, costs) < recompute_seconds(n, costs), or None when recompute is at least as
    #   cheap all the way to max_tokens.
    # TODO: Exercise 7.3: write your code here, then delete the raise below.
    raise NotImplementedError(
        "Exercise 7.3 (Swap or recompute: a CPU pool and the cost model): not written yet: edit kvcourse/scheduler.py, swap_crossover."
    )


class StallFreeScheduler(SecondTierScheduling, SchedulerBase):
    """Continuous batching with chunked prefill that never schedules a token it has no KV memory for.

    Given in SchedulerBase (kvcourse/core/sched_base.py): add_request, finish_requests,
    has_unfinished_requests, _update_after_schedule (applies a plan), _take_waiting, watermark_blocks.
    From SecondTierScheduling (kvcourse/offload.py, lesson 10): _start_load, _admit_loaded (8.4, 8.5).
    """

    def __init__(
        self,
        token_budget: int,
        max_batch_size: int,
        kv_cache_manager: KVCacheManagerProtocol,
        *,
        policy: str = "fcfs",
        watermark: float = 0.0,
        preemption_mode: str = "recompute",
        num_cpu_blocks: int = 0,
        kv_connector: CPUOffloadTier | None = None,
    ) -> None:
        """Check the sizes, the knobs and the manager up front, so a misconfigured engine fails before it runs."""
        self.token_budget = positive_int("token_budget", token_budget)
        self.max_batch_size = positive_int("max_batch_size", max_batch_size)
        check_knobs(policy, watermark, preemption_mode, num_cpu_blocks)
        self.policy, self.watermark, self.preemption_mode = policy, float(watermark), preemption_mode
        self.num_cpu_blocks = num_cpu_blocks  # the swap space (preemption_mode="swap")
        self.kv_cache_manager = check_implements(kv_cache_manager, KVCacheManagerProtocol, "kv_cache_manager")
        self.waiting_queue: deque[Request] = deque()
        self.active_pool: dict[int, Request] = {}  # the running set, in admission order
        self.finished: list[Request] = []  # every settled request (finished, aborted, failed), in order
        self.rejected: list[Request] = []
        self.num_preemptions = 0  # total over the scheduler's life
        # swap mode: K/V tokens moved out to the CPU pool and back in, and the transfers (each pays the link's latency)
        self.num_swapped_out_tokens = self.num_swapped_in_tokens = self.num_swaps = 0
        self._swapped: dict[int, int] = {}  # request id -> CPU blocks it holds while swapped out
        self._known_ids: set[int] = set()
        self.kv_connector = kv_connector  # a second KV tier (lesson 10); None: off, as before
        self.loading: dict[int, tuple[Request, int]] = {}  # WAITING_FOR_REMOTE_KVS: (request, tokens it loads)
        self.loaded: set[int] = set()  # their loads ran: admitted next as prefix hits (8.5)
        self._num_finished_reported = 0  # how much of self.finished earlier steps' outputs reported

    # ----------------------------------------------------------------------------- requests in
    def _insert_by_priority(self, request: Request) -> None:
        """Keep the waiting queue ordered by (priority, arrival_time): the most urgent at the head."""
        # Exercise 7.1 (the queue): priority scheduling.
        #   Puts `request` into self.waiting_queue so that the queue stays ordered by the key
        #   (request.priority, request.arrival_time), smallest first (a lower priority value is more
        #   urgent, as in vLLM). Among requests with an equal key it goes BEHIND those already there
        #   (first come, first served); every other request keeps its order.
        # TODO: Exercise 7.1: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 7.1 (Priority scheduling): not written yet: edit kvcourse/scheduler.py, StallFreeScheduler._insert_by_priority."
        )

    def _reject_if_never_fits(self, request: Request) -> bool:
        """A request needing more blocks than the whole cache could never finish: refuse it now, saying why."""
        # Exercise 2.9: reject what can never fit.
        #   Returns True when the request could never finish even with the whole cache to itself: at its
        #   longest it holds its prompt plus max_new_tokens tokens, in blocks of the manager's block_size
        #   (a partial block counts: blocks_needed), and the cache has its num_blocks (the manager:
        #   self.kv_cache_manager). Otherwise returns False.
        #   When it returns True: the request is REJECTED, its `reason` is a sentence a user can act on
        #   (what it needs, what there is), and it is listed in self.rejected; add_request then leaves
        #   it out of the waiting queue. When it returns False, nothing has changed.
        #   Edge: a request that fits the cache exactly is accepted.
        # TODO: Exercise 2.9: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 2.9 (Reject what can never fit): not written yet: edit kvcourse/scheduler.py, StallFreeScheduler._reject_if_never_fits."
        )

    # ----------------------------------------------------------------------------- one step
    def schedule_next_batch(self) -> SchedulerOutput:
        """Plan one step, then apply it: decodes, the prefill in progress, admissions (see the module docstring)."""
        finished_req_ids = [r.id for r in self.finished[self._num_finished_reported :]]  # since the last step
        self._num_finished_reported = len(self.finished)
        self.collect_finished_loads()  # loads planned last step have run (lesson 10; nothing without a tier)
        output = SchedulerOutput(block_ids={}, finished_req_ids=finished_req_ids)
        # Exercise 2.4: plan the running requests.
        #   Adds to `output`, through self._schedule_running(request, num_new_tokens, output) (it secures
        #   the memory, preempting if it must, and returns False when the request got nothing), in this
        #   order: a decode (1 token) for every running request past its prefill, oldest admission
        #   first; then the next chunk of the OLDEST running request that is still prefilling
        #   (self._is_prefilling): as many of its uncomputed tokens as the budget left allows.
        #   Each only while the plan has room for it (self._has_room); a request preempted a moment ago
        #   (it has left self.active_pool) gets nothing. At most one prefill chunk per step.
        # TODO: Exercise 2.4: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 2.4 (Plan one step): not written yet: edit kvcourse/scheduler.py, StallFreeScheduler.schedule_next_batch."
        )
        if self.waiting_queue:
            # Exercise 2.6: first-come, first-served admission.
            #   Then admit waiting requests with self._admit(request, budget left, output) (Exercise
            #   2.2), in queue order, while the plan has room and fewer than self.max_batch_size run.
            #   Must hold: when the head of the queue cannot be admitted, admission stops for this step:
            #   nobody behind it may go first (vLLM v1); skipping ahead starves a large request under a
            #   stream of small ones. A step that preempted anyone (output.preempted_req_ids) admits
            #   nobody: the memory just freed is for the requests already running.
            # TODO: Exercise 2.6: write your code here, then delete the raise below.
            raise NotImplementedError(
                "Exercise 2.6 (First-come, first-served admission): not written yet: edit kvcourse/scheduler.py, StallFreeScheduler.schedule_next_batch."
            )
        self._update_after_schedule(output)
        return output

    def _budget_left(self, output: SchedulerOutput) -> int:
        """Tokens this step may still feed."""
        # Exercise 2.4, the budget: the token budget minus the tokens already planned in `output`
        #   (output.num_scheduled_tokens: a request preempted later in the step is out of it again).
        # TODO: Exercise 2.4: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 2.4 (Plan one step): not written yet: edit kvcourse/scheduler.py, StallFreeScheduler._budget_left."
        )

    def _has_room(self, output: SchedulerOutput, num_tokens: int = 1) -> bool:
        """Whether one more sequence of at least num_tokens tokens fits the budget and the batch size."""
        # Exercise 2.4, the room: True when num_tokens more tokens fit the budget left AND one more
        #   sequence fits self.max_batch_size.
        # TODO: Exercise 2.4: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 2.4 (Plan one step): not written yet: edit kvcourse/scheduler.py, StallFreeScheduler._has_room."
        )

    @staticmethod
    def _is_prefilling(request: Request) -> bool:
        """Running, with tokens still to feed before it can sample (a new or a recomputing request)."""
        # Exercise 2.4, prefilling: True when the request's prefill is not done and some of its tokens
        #   are not computed yet (a chunked prompt, or a recompute after preemption).
        # TODO: Exercise 2.4: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 2.4 (Plan one step): not written yet: edit kvcourse/scheduler.py, StallFreeScheduler._is_prefilling."
        )

    def _schedule_running(self, request: Request, num_new_tokens: int, output: SchedulerOutput) -> bool:
        """Memory for a running request's next tokens, preempting the lowest priority until it fits; then plan them."""
        new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
        if new_blocks is None:  # memory is short
            # Exercise 2.8: preempt until it fits.
            #   allocate_slots(request, num_new_tokens) has just said no (None: too few free blocks) for
            #   `request`, which is running. Preempt, one victim at a time, and try again after each:
            #   self._preempt_victim(output) preempts the lowest-priority running request (Exercise 2.7
            #   chooses it), takes it out of the plan, and returns it. When allocate_slots succeeds,
            #   leave its blocks in `new_blocks` and go on below. Return False, planning nothing, when the
            #   request itself was the victim (it then waits, holding no blocks).
            #   Must hold: as few requests as needed are preempted, never one of higher priority than
            #   `request` (under FCFS: nobody older); the loop always ends.
            # TODO: Exercise 2.8: write your code here, then delete the raise below.
            raise NotImplementedError(
                "Exercise 2.8 (Preempt until it fits): not written yet: edit kvcourse/scheduler.py, StallFreeScheduler._schedule_running."
            )
        # Exercise 2.1 (plan it): the memory for the request's next num_new_tokens tokens is secured
        #   (new_blocks: the blocks allocate_slots just added). Put the request's sequence
        #   (self._new_sequence, below) into the step's plan with those blocks' ids
        #   (output.add(sequence, block_ids)), and return True.
        # TODO: Exercise 2.1: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 2.1 (Describe a chunk and plan it): not written yet: edit kvcourse/scheduler.py, StallFreeScheduler._schedule_running."
        )

    def _admit(self, request: Request, token_budget_left: int, output: SchedulerOutput) -> bool:
        """Move a waiting request to the running set with its first chunk, reusing cached prefix blocks."""
        if request.id in self._swapped:
            return self._swap_in(request, token_budget_left, output)
        if request.id in self.loaded:
            return self._admit_loaded(request, token_budget_left, output)
        if self.kv_connector is not None and (started := self._start_load(request)) is not None:
            return started  # it waits for its load (True), or memory is short (False)
        if self.watermark > 0 and not self._keeps_watermark(request, min(request.num_tokens, token_budget_left)):
            return False  # admitting it would eat into the blocks kept for the running decodes
        # Exercise 2.2: admit a waiting request with its first chunk.
        #   `request` is in self.waiting_queue (new, or preempted earlier) and nothing of it is cached
        #   by this scheduler; the manager's get_computed_blocks(request) may report a cached prefix
        #   (prefix-cache hits: blocks and a token count; always none with the mock). allocate_slots
        #   sizes from the request's num_computed_tokens, which still says 0 when you call it: the hits
        #   reach it as its num_new_computed_tokens and new_computed_blocks, so they count once.
        #   The first chunk is the tokens after the cached prefix, as many as token_budget_left allows.
        #   Returns False when allocate_slots (told about the prefix hits) says no: then nothing has
        #   changed (a newcomer preempts nobody and keeps its place in the queue).
        #   Returns True on success: THIS request (wherever it is in the queue) has left the waiting
        #   queue, is RUNNING, is the newest entry of self.active_pool, counts its cached prefix as
        #   computed, and its first chunk (self._new_sequence) is in `output` with the ids of the blocks
        #   allocate_slots returned.
        # TODO: Exercise 2.2: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 2.2 (Admit a waiting request): not written yet: edit kvcourse/scheduler.py, StallFreeScheduler._admit."
        )

    @staticmethod
    def _new_sequence(request: Request, num_new_tokens: int) -> ScheduledSequence:
        """Describe the request's next num_new_tokens tokens (their memory is secured) for the executor."""
        # Exercise 2.1 (describe it):
        #   Returns the ScheduledSequence of the request's next num_new_tokens tokens: the tokens of
        #   request.all_token_ids (prompt, then outputs) that follow the ones already cached
        #   (request.num_computed_tokens, which does not move while planning), the position of the
        #   first of them, is_decode True exactly when the request is past its prefill
        #   (request.is_prefill_done()), and samples_token True exactly when the chunk reaches the end of
        #   the request's tokens (the last prefill chunk, and every decode). Changes nothing.
        # TODO: Exercise 2.1: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 2.1 (Describe a chunk and plan it): not written yet: edit kvcourse/scheduler.py, StallFreeScheduler._new_sequence."
        )

    # ----------------------------------------------------------------------------- memory pressure
    def _preempt_victim(self, output: SchedulerOutput) -> Request:
        """Preempt by the policy, while planning: the victim leaves the plan; in swap mode its K/V goes to the CPU pool."""
        computed = {r.id: r.num_computed_tokens for r in self.active_pool.values()}  # what is really cached
        victim = self._preempt_lowest_priority() if self.policy == "priority" else self._preempt_most_recent()
        output.remove(victim.id)
        output.preempted_req_ids.append(victim.id)
        if self.preemption_mode == "swap" and self._move_to_cpu(victim, computed[victim.id]):
            self.num_swapped_out_tokens += computed[victim.id]
            self.num_swaps += 1
            output.swapped_out[victim.id] = computed[victim.id]
        return victim

    def _preempt_most_recent(self) -> Request:
        """Free the most recently admitted running request's memory; it will be recomputed later."""
        # Exercise 2.7: choose the victim under first come, first served.
        #   `victim` is the most recently admitted running request: the lowest priority under FCFS
        #   (self.active_pool keeps admission order). Release it with self._preempt(victim), given
        #   below (blocks back, nothing cached, waiting again), and return what that returns.
        # TODO: Exercise 2.7: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 2.7 (Choose the victim: the newest): not written yet: edit kvcourse/scheduler.py, StallFreeScheduler._preempt_most_recent."
        )

    def _preempt_lowest_priority(self) -> Request:
        """Under policy="priority": free the least urgent running request's memory; it will be recomputed."""
        # Exercise 7.1 (the victim): priority scheduling.
        #   `victim` is the running request with the LARGEST (priority, arrival_time): the least
        #   urgent, and among equally urgent ones the latest arrival; among exact ties, the most
        #   recently admitted. Release it with self._preempt(victim), as in Exercise 2.7, and return
        #   what that returns (under this policy it waits at its place by priority).
        # TODO: Exercise 7.1: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 7.1 (Priority scheduling): not written yet: edit kvcourse/scheduler.py, StallFreeScheduler._preempt_lowest_priority."
        )

    def _preempt(self, victim: Request) -> Request:
        """Release a victim by recompute: blocks back, nothing cached, outputs kept, waiting again (head or by priority)."""
        del self.active_pool[victim.id]
        self.kv_cache_manager.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        if self.policy == "priority":
            self._insert_by_priority(victim)
        else:
            self.waiting_queue.appendleft(victim)  # ahead of requests that never ran
        return victim

    def _move_to_cpu(self, victim: Request, num_computed: int) -> bool:
        """Swap-out: the victim's blocks were copied to the CPU pool before being freed, if the pool has room."""
        # Exercise 7.3 (swap-out): `victim` has just been preempted (self._preempt): it holds no
        #   GPU blocks and counts nothing as computed; `num_computed` is how many of its tokens were
        #   cached a moment ago. Their K/V needs blocks_needed(num_computed, self.kv_cache_manager.block_size) CPU
        #   blocks, and self.num_free_cpu_blocks are free.
        #   Returns True when it was swapped out: there was something to keep and room for it. Then
        #   self._swapped[victim.id] holds the number of CPU blocks it takes, and the victim again
        #   counts num_computed tokens as computed (they will come back, not be recomputed).
        #   Returns False otherwise, changing nothing: the victim will be recomputed.
        # TODO: Exercise 7.3: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 7.3 (Swap or recompute: a CPU pool and the cost model): not written yet: edit kvcourse/scheduler.py, StallFreeScheduler._move_to_cpu."
        )

    def _swap_in(self, request: Request, token_budget_left: int, output: SchedulerOutput) -> bool:
        """Re-admit a swapped-out request: GPU blocks for its kept tokens plus its next chunk, or nothing."""
        kept = request.num_computed_tokens
        sequence = self._move_to_gpu(request, token_budget_left)
        if sequence is None:
            return False
        self.num_swapped_in_tokens += kept
        self.num_swaps += 1
        output.swapped_in[request.id] = kept
        output.add(sequence, self.kv_cache_manager.get_block_ids(request))  # every GPU block is new
        return True

    def _move_to_gpu(self, request: Request, token_budget_left: int) -> ScheduledSequence | None:
        """Swap-in: GPU blocks for the kept tokens and the next chunk, all or nothing, then it runs again."""
        # Exercise 7.3 (swap-in): `request` is waiting and swapped out (it is in self._swapped): it
        #   counts request.num_computed_tokens tokens as computed, kept in the CPU pool, but holds no
        #   GPU blocks. Returns its next chunk, built by self._new_sequence (Exercise 2.1): as many of its uncomputed
        #   tokens as token_budget_left allows, a decode when its prefill is done
        #   (request.is_prefill_done()). Before that, GPU blocks for the kept tokens AND the chunk
        #   must be allocated, all or nothing (allocate_slots sizes from the request's
        #   num_computed_tokens: ask while it counts 0, for kept + chunk tokens, then restore it).
        #   On success it has left self._swapped and the waiting queue, is RUNNING and the newest in
        #   self.active_pool. When allocate_slots says no: returns None, and nothing has changed (like
        #   any admission, a swap-in preempts nobody).
        # TODO: Exercise 7.3: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 7.3 (Swap or recompute: a CPU pool and the cost model): not written yet: edit kvcourse/scheduler.py, StallFreeScheduler._move_to_gpu."
        )

    def _keeps_watermark(self, request: Request, num_new_tokens: int) -> bool:
        """Whether admitting this request's first chunk leaves the watermark's blocks free for running decodes."""
        # Exercise 7.2: a watermark for admission.
        #   `request` is waiting, and its first chunk would be num_new_tokens tokens (nothing of it is
        #   cached yet). Returns True when admitting it keeps at least self.watermark_blocks blocks
        #   free: the manager's free blocks minus the blocks those tokens need (a partial block counts)
        #   stay at or above the watermark. Also True when no request is running: the watermark
        #   protects running decodes, and with none there, refusing could leave the request waiting
        #   forever. Changes nothing.
        # TODO: Exercise 7.2: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 7.2 (A watermark for admission): not written yet: edit kvcourse/scheduler.py, StallFreeScheduler._keeps_watermark."
        )

    # ----------------------------------------------------------------------------- results in
    def update_from_output(self, scheduler_output: SchedulerOutput, sampled_token_ids: dict[int, int]) -> list[Request]:
        """Append each sampled token; return the requests this update finished (their blocks are freed)."""
        # Exercise 2.5: take the step's results in.
        #   `scheduler_output` is what the latest schedule_next_batch() returned (iterate it for its
        #   sequences); `sampled_token_ids` maps a request id to the one token the executor sampled for
        #   each sequence whose samples_token is True.
        #   Afterwards: each such request has that token (as an int) appended to its output_tokens; a
        #   prefill chunk that does not reach the end of its request samples nothing and changes
        #   nothing. Each request that is now complete (request.is_complete()) is finished with
        #   self._finish (Exercise 2.3). Returns the requests this update finished, in plan order.
        #   Bad input is a ValueError that says what was wrong: a sequence that should have sampled but
        #   has no token, or a sequence (sampling or not) whose request is not running (self._running,
        #   below, raises that one).
        # TODO: Exercise 2.5: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 2.5 (Take the step's results in): not written yet: edit kvcourse/scheduler.py, StallFreeScheduler.update_from_output."
        )

    def _running(self, request_id: int) -> Request:
        """The running request a plan entry refers to (a clear error for a stale plan)."""
        # Exercise 2.5, the lookup: returns the running request with this id; for an id that is not
        #   running (a stale plan, or a plan passed twice), a ValueError whose message names the
        #   request, says it is "not running", and says to pass the latest schedule_next_batch(), once.
        # TODO: Exercise 2.5: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 2.5 (Take the step's results in): not written yet: edit kvcourse/scheduler.py, StallFreeScheduler._running."
        )

    def _finish(self, request: Request) -> None:
        """A complete request leaves the running set and gives its blocks back at once, for others."""
        # Exercise 2.3: free blocks on completion.
        #   `request` is running and complete. Afterwards it is FINISHED, it has left the running set,
        #   and all its blocks are back with the manager (given back once, at once, so that a waiting
        #   request can use them this very step); the other requests keep theirs.
        #   (Listing it in self.finished happens after your code.)
        # TODO: Exercise 2.3: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 2.3 (Free blocks on completion): not written yet: edit kvcourse/scheduler.py, StallFreeScheduler._finish."
        )
        self.finished.append(request)

    def _end_request(self, request_id: int, status: RequestStatus, reason: str | None) -> Request | None:
        """End one request now, wherever it is (abort): its memory back at once, everyone else untouched."""
        # Exercise 7.4: abort.
        #   Returns the request with this id if it was waiting or running, None if it is settled
        #   already (finished, rejected, aborted or failed: leave it exactly as it is).
        #   Afterwards an ended request is neither running nor waiting, holds no blocks (every one is
        #   back with the manager, at once), and has the given status and reason. Nothing else
        #   changes: every other request keeps its place, its blocks and its status.
        #   Helper: self._take_waiting(request_id). (Listing it in self.finished happens after your code.)
        # TODO: Exercise 7.4: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 7.4 (Abort: give everything back at once): not written yet: edit kvcourse/scheduler.py, StallFreeScheduler._end_request."
        )
