"""The memory-aware StallFreeScheduler (exercises 2.1-2.9, 7.1-7.4): it plans each step and secures its KV memory.

Policy lives here (who runs, who is preempted or rejected); mechanism in the KV-cache manager, reached
only through `KVCacheManagerProtocol` (kvcourse/core/contract.py). `schedule_next_batch()` (vLLM's
`Scheduler.schedule()`) plans decodes, then one prefill in progress, then admissions, each only once
`allocate_slots` has succeeded, into a `SchedulerOutput`; then it applies the plan once. Knobs: kvcourse/core/scheduler_config.py.
"""

from __future__ import annotations

from collections import deque

from kvcourse.core.contract import KVCacheManagerProtocol, blocks_needed, check_implements
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
    # BEGIN SOLUTION 7.3
    if num_tokens == 0:
        return 0.0
    return 2 * (costs.link_latency_s + num_tokens * costs.kv_bytes_per_token / costs.link_bytes_per_s)
    # END SOLUTION


def recompute_seconds(num_tokens: int, costs: PreemptionCosts) -> float:
    """A recompute: the victim's tokens fed through the model again (attention's share is left out)."""
    # Exercise 7.3 (recompute): returns the seconds that feeding num_tokens tokens through the model
    #   again costs: their FLOPs (costs.flops_per_token each) at costs.flops_per_s.
    # BEGIN SOLUTION 7.3
    return num_tokens * costs.flops_per_token / costs.flops_per_s
    # END SOLUTION


def swap_crossover(costs: PreemptionCosts, max_tokens: int) -> int | None:
    """The shortest context (in tokens) for which swapping is cheaper than recomputing, up to max_tokens."""
    # Exercise 7.3 (the crossover): returns the smallest n from 1 to max_tokens for which
    #   swap_seconds(n, costs) < recompute_seconds(n, costs), or None when recompute is at least as
    #   cheap all the way to max_tokens.
    # BEGIN SOLUTION 7.3
    for n in range(1, max_tokens + 1):
        if swap_seconds(n, costs) < recompute_seconds(n, costs):
            return n
    return None
    # END SOLUTION


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
        # BEGIN SOLUTION 7.1
        key = (request.priority, request.arrival_time)
        for index, other in enumerate(self.waiting_queue):
            if (other.priority, other.arrival_time) > key:
                self.waiting_queue.insert(index, request)
                return
        self.waiting_queue.append(request)
        # END SOLUTION

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
        # BEGIN SOLUTION 2.9
        manager = self.kv_cache_manager
        needed = blocks_needed(request.num_prompt_tokens + request.max_new_tokens, manager.block_size)
        if needed <= manager.num_blocks:
            return False
        request.status = RequestStatus.REJECTED
        request.reason = (
            f"it needs {needed} blocks for its prompt and max_new_tokens, "
            f"but the whole cache has only {manager.num_blocks}"
        )
        self.rejected.append(request)
        return True
        # END SOLUTION

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
        # BEGIN SOLUTION 2.4
        for request in list(self.active_pool.values()):
            if request.id in self.active_pool and request.is_prefill_done() and self._has_room(output):
                self._schedule_running(request, 1, output)
        prefilling = next((r for r in self.active_pool.values() if self._is_prefilling(r)), None)
        if prefilling is not None and self._has_room(output):
            num_new_tokens = min(prefilling.num_uncomputed_tokens, self._budget_left(output))
            self._schedule_running(prefilling, num_new_tokens, output)
        # END SOLUTION
        if self.waiting_queue:
            # Exercise 2.6: first-come, first-served admission.
            #   Then admit waiting requests with self._admit(request, budget left, output) (Exercise
            #   2.2), in queue order, while the plan has room and fewer than self.max_batch_size run.
            #   Must hold: when the head of the queue cannot be admitted, admission stops for this step:
            #   nobody behind it may go first (vLLM v1); skipping ahead starves a large request under a
            #   stream of small ones. A step that preempted anyone (output.preempted_req_ids) admits
            #   nobody: the memory just freed is for the requests already running.
            # BEGIN SOLUTION 2.6
            while not output.preempted_req_ids and self.waiting_queue and self._has_room(output):
                if len(self.active_pool) >= self.max_batch_size:
                    break
                if not self._admit(self.waiting_queue[0], self._budget_left(output), output):
                    break  # the head waits, and everyone behind it waits too
            # END SOLUTION
        self._update_after_schedule(output)
        return output

    def _budget_left(self, output: SchedulerOutput) -> int:
        """Tokens this step may still feed."""
        # Exercise 2.4, the budget: the token budget minus the tokens already planned in `output`
        #   (output.num_scheduled_tokens: a request preempted later in the step is out of it again).
        # BEGIN SOLUTION 2.4
        return self.token_budget - output.total_num_scheduled_tokens
        # END SOLUTION

    def _has_room(self, output: SchedulerOutput, num_tokens: int = 1) -> bool:
        """Whether one more sequence of at least num_tokens tokens fits the budget and the batch size."""
        # Exercise 2.4, the room: True when num_tokens more tokens fit the budget left AND one more
        #   sequence fits self.max_batch_size.
        # BEGIN SOLUTION 2.4
        return self._budget_left(output) >= num_tokens and len(output) < self.max_batch_size
        # END SOLUTION

    @staticmethod
    def _is_prefilling(request: Request) -> bool:
        """Running, with tokens still to feed before it can sample (a new or a recomputing request)."""
        # Exercise 2.4, prefilling: True when the request's prefill is not done and some of its tokens
        #   are not computed yet (a chunked prompt, or a recompute after preemption).
        # BEGIN SOLUTION 2.4
        return not request.is_prefill_done() and request.num_uncomputed_tokens > 0
        # END SOLUTION

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
            # BEGIN SOLUTION 2.8
            while new_blocks is None:
                if self._preempt_victim(output) is request:
                    return False  # it was the lowest priority itself: it waits, and the others keep going
                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            # END SOLUTION
        # Exercise 2.1 (plan it): the memory for the request's next num_new_tokens tokens is secured
        #   (new_blocks: the blocks allocate_slots just added). Put the request's sequence
        #   (self._new_sequence, below) into the step's plan with those blocks' ids
        #   (output.add(sequence, block_ids)), and return True.
        # BEGIN SOLUTION 2.1
        output.add(self._new_sequence(request, num_new_tokens), new_blocks.get_block_ids())
        return True
        # END SOLUTION

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
        # BEGIN SOLUTION 2.2
        computed_blocks, num_computed = self.kv_cache_manager.get_computed_blocks(request)
        num_new_tokens = min(request.num_tokens - num_computed, token_budget_left)
        new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens, num_computed, computed_blocks)
        if new_blocks is None:
            return False
        self.waiting_queue.remove(request)
        request.status = RequestStatus.RUNNING
        self.active_pool[request.id] = request
        request.num_computed_tokens = num_computed
        output.add(self._new_sequence(request, num_new_tokens), new_blocks.get_block_ids())
        return True
        # END SOLUTION

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
        # BEGIN SOLUTION 2.1
        start = request.num_computed_tokens
        return ScheduledSequence(
            request_id=request.id,
            tokens=request.all_token_ids[start : start + num_new_tokens],
            is_decode=request.is_prefill_done(),
            position_ids_start=start,
            samples_token=start + num_new_tokens == request.num_tokens,
        )
        # END SOLUTION

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
        # BEGIN SOLUTION 2.7
        victim = next(reversed(self.active_pool.values()))
        return self._preempt(victim)
        # END SOLUTION

    def _preempt_lowest_priority(self) -> Request:
        """Under policy="priority": free the least urgent running request's memory; it will be recomputed."""
        # Exercise 7.1 (the victim): priority scheduling.
        #   `victim` is the running request with the LARGEST (priority, arrival_time): the least
        #   urgent, and among equally urgent ones the latest arrival; among exact ties, the most
        #   recently admitted. Release it with self._preempt(victim), as in Exercise 2.7, and return
        #   what that returns (under this policy it waits at its place by priority).
        # BEGIN SOLUTION 7.1
        victim = max(reversed(list(self.active_pool.values())), key=lambda r: (r.priority, r.arrival_time))
        return self._preempt(victim)
        # END SOLUTION

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
        # BEGIN SOLUTION 7.3
        manager = self.kv_cache_manager
        cpu_blocks = blocks_needed(num_computed, manager.block_size)
        if num_computed == 0 or cpu_blocks > self.num_free_cpu_blocks:
            return False
        self._swapped[victim.id] = cpu_blocks
        victim.num_computed_tokens = num_computed
        return True
        # END SOLUTION

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
        # BEGIN SOLUTION 7.3
        manager = self.kv_cache_manager
        kept = request.num_computed_tokens
        num_new_tokens = min(request.num_uncomputed_tokens, token_budget_left)
        request.num_computed_tokens = 0
        blocks = manager.allocate_slots(request, kept + num_new_tokens)
        request.num_computed_tokens = kept
        if blocks is None:
            return None
        del self._swapped[request.id]
        self.waiting_queue.remove(request)
        request.status = RequestStatus.RUNNING
        self.active_pool[request.id] = request
        return self._new_sequence(request, num_new_tokens)
        # END SOLUTION

    def _keeps_watermark(self, request: Request, num_new_tokens: int) -> bool:
        """Whether admitting this request's first chunk leaves the watermark's blocks free for running decodes."""
        # Exercise 7.2: a watermark for admission.
        #   `request` is waiting, and its first chunk would be num_new_tokens tokens (nothing of it is
        #   cached yet). Returns True when admitting it keeps at least self.watermark_blocks blocks
        #   free: the manager's free blocks minus the blocks those tokens need (a partial block counts)
        #   stay at or above the watermark. Also True when no request is running: the watermark
        #   protects running decodes, and with none there, refusing could leave the request waiting
        #   forever. Changes nothing.
        # BEGIN SOLUTION 7.2
        manager = self.kv_cache_manager
        if not self.active_pool:
            return True
        needed = blocks_needed(num_new_tokens, manager.block_size)
        return manager.get_num_free_blocks() - needed >= self.watermark_blocks
        # END SOLUTION

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
        # BEGIN SOLUTION 2.5
        finished = []
        for sequence in scheduler_output:
            request = self._running(sequence.request_id)  # every entry of the plan must be running
            if not sequence.samples_token:
                continue  # a prefill chunk that does not reach the end samples nothing
            if sequence.request_id not in sampled_token_ids:
                raise ValueError(
                    f"No sampled token for request {sequence.request_id}, whose chunk reaches the end of "
                    "its tokens: the executor must sample one token for every sequence with samples_token."
                )
            request.output_tokens.append(int(sampled_token_ids[sequence.request_id]))
            if request.is_complete():
                self._finish(request)
                finished.append(request)
        return finished
        # END SOLUTION

    def _running(self, request_id: int) -> Request:
        """The running request a plan entry refers to (a clear error for a stale plan)."""
        # Exercise 2.5, the lookup: returns the running request with this id; for an id that is not
        #   running (a stale plan, or a plan passed twice), a ValueError whose message names the
        #   request, says it is "not running", and says to pass the latest schedule_next_batch(), once.
        # BEGIN SOLUTION 2.5
        try:
            return self.active_pool[request_id]
        except KeyError:
            raise ValueError(
                f"Request {request_id} is in the plan but not running; pass the SchedulerOutput returned by "
                "the latest schedule_next_batch(), once."
            ) from None
        # END SOLUTION

    def _finish(self, request: Request) -> None:
        """A complete request leaves the running set and gives its blocks back at once, for others."""
        # Exercise 2.3: free blocks on completion.
        #   `request` is running and complete. Afterwards it is FINISHED, it has left the running set,
        #   and all its blocks are back with the manager (given back once, at once, so that a waiting
        #   request can use them this very step); the other requests keep theirs.
        #   (Listing it in self.finished happens after your code.)
        # BEGIN SOLUTION 2.3
        request.status = RequestStatus.FINISHED
        del self.active_pool[request.id]
        self.kv_cache_manager.free(request)
        # END SOLUTION
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
        # BEGIN SOLUTION 7.4
        request = self.active_pool.pop(request_id, None) or self._take_waiting(request_id)
        if request is None:
            return None
        self.kv_cache_manager.free(request)
        request.status, request.reason = status, reason
        return request
        # END SOLUTION
