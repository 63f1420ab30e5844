"""The course's exercises: id, title, module, estimated minutes, and two levels of hint that never give the code."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Exercise:
    """One graded exercise: the pytest marker is derived from the id ("2.1" -> "ex2_1").

    `hint` (level 1) nudges towards the idea; `approach` (level 2) gives the plan in words, never the code;
    `solution(id)` in kvcourse.course.feedback prints the reference code itself.
    """

    id: str
    title: str
    module: str
    minutes: int
    hint: str
    approach: str

    def __post_init__(self) -> None:
        """Catch a malformed row when the registry is imported, not when a learner asks for a hint."""
        if self.minutes <= 0:
            raise ValueError(f"Exercise {self.id}: minutes must be a positive estimate, got {self.minutes}.")
        if not self.hint or not self.approach:
            raise ValueError(f"Exercise {self.id}: give both a hint (level 1) and an approach (level 2).")

    @property
    def marker(self) -> str:
        """The pytest marker that selects this exercise's tests."""
        return "ex" + self.id.replace(".", "_")

    @property
    def path(self) -> str:
        """The file the learner edits, relative to the repository root."""
        return f"kvcourse/{self.module}.py"


# One block per exercise, in course order; edit a row with a precise replacement of its own block.
_EXERCISES = [
    Exercise(
        id="0.1",
        title="KV bytes per token",
        module="memory",
        minutes=5,
        hint="What does one token leave behind in every layer? Count elements first, bytes last.",
        approach="Per layer a token stores one key and one value vector of head_dim numbers for each KV head (spec.num_kv_heads, not the query heads); multiply by the layers and by the bytes of one element of the dtype.",
    ),
    Exercise(
        id="0.2",
        title="Sequences that fit in a memory budget",
        module="memory",
        minutes=5,
        hint="Half a sequence is useless: only whole sequences count.",
        approach="Work out the bytes one whole sequence needs (tokens times bytes per token), then how many of those fit with integer division.",
    ),
    Exercise(
        id="1.1",
        title="The engine's step",
        module="step",
        minutes=10,
        hint="Three calls, each in its own core.phase; the plan they share is one object. What should happen when the plan is empty?",
        approach="Inside core.phase('schedule'): scheduler_output = core.scheduler.schedule_next_batch(). If it is empty, raise Deadlock(describe_stall(core.scheduler, core.iteration)). Inside core.phase('execute', scheduler_output): sampled = core.executor.execute(scheduler_output). Inside core.phase('update', scheduler_output): return core.scheduler.update_from_output(scheduler_output, sampled).",
    ),
    Exercise(
        id="2.1",
        title="Describe a chunk and plan it",
        module="scheduler",
        minutes=10,
        hint="Everything follows from num_computed_tokens, which does not move while planning: where the chunk starts, which tokens it feeds, whether it reaches the end. Once memory is secured, the plan takes the sequence together with the blocks that were just added.",
        approach="_new_sequence: start = request.num_computed_tokens; return a ScheduledSequence with all_token_ids[start:start + n], position_ids_start=start, is_decode=request.is_prefill_done() and samples_token = (start + n == num_tokens); change nothing. In _schedule_running: output.add(self._new_sequence(request, n), new_blocks.get_block_ids()), then return True.",
    ),
    Exercise(
        id="2.2",
        title="Admit a waiting request",
        module="scheduler",
        minutes=15,
        hint="The first chunk is what is left to compute after the prefix-cache hits, cut to the budget that is left; and a newcomer never takes memory from anyone.",
        approach="Ask get_computed_blocks for (blocks, num_computed); n = min(num_tokens - num_computed, budget left); call allocate_slots(request, n, num_computed, blocks) directly (no preemption); on None return False, untouched. On success remove this very request from the queue (not popleft of someone else), mark it RUNNING, add it to active_pool, set num_computed_tokens to num_computed, output.add(self._new_sequence(request, n), the new blocks' ids) and return True.",
    ),
    Exercise(
        id="2.3",
        title="Free blocks on completion",
        module="scheduler",
        minutes=5,
        hint="Three facts must be true afterwards: its status, where it is (not), and who holds its blocks.",
        approach="Set the status to FINISHED, delete it from self.active_pool by id, and call self.kv_cache_manager.free(request) once.",
    ),
    Exercise(
        id="2.4",
        title="Plan one step",
        module="scheduler",
        minutes=20,
        hint="Two passes over the running set, in the order the contract lists them; let the helpers (_has_room, _budget_left, _is_prefilling) carry the arithmetic, and let _schedule_running secure the memory. Which count tells the budget what is already planned?",
        approach="Decode pass: loop over a copy of active_pool's values; skip a request no longer in active_pool, not past its prefill, or when not self._has_room(output); else self._schedule_running(request, 1, output). Prefill pass: the first running request for which _is_prefilling is true; if there is one and the plan has room, self._schedule_running(it, min(its uncomputed tokens, self._budget_left(output)), output). Helpers: _budget_left = token_budget - output.total_num_scheduled_tokens; _has_room compares it with num_tokens and len(output) with max_batch_size; _is_prefilling combines is_prefill_done() and num_uncomputed_tokens.",
    ),
    Exercise(
        id="2.5",
        title="Take the step's results in",
        module="scheduler",
        minutes=15,
        hint="Only sequences with samples_token get a token. After appending it, ask the request whether it is complete.",
        approach="For each sequence in the batch: skip it unless samples_token; look the request up with self._running(id); raise a ValueError naming the request if sampled_token_ids has no token for it; append int(token) to its output_tokens; if request.is_complete(), call self._finish(request) and collect it. Return the collected requests. _running: return self.active_pool[request_id], turning the KeyError into a ValueError with the id and what to do.",
    ),
    Exercise(
        id="2.6",
        title="First-come, first-served admission",
        module="scheduler",
        minutes=10,
        hint="Admission looks at the head of the queue only. What should happen to everyone behind a head that does not fit, and to everyone at all in a step that had to preempt?",
        approach="Loop while nobody was preempted this step (output.preempted_req_ids is empty), the queue is not empty and the plan has room: stop if max_batch_size requests run; _admit the head (self.waiting_queue[0]) with the budget left and the output; if it returns False, stop admitting for this step.",
    ),
    Exercise(
        id="2.7",
        title="Choose the victim: the newest",
        module="scheduler",
        minutes=5,
        hint="Under first come, first served the lowest priority is the request that arrived in the running set last. Which of active_pool's orders tells you that?",
        approach="victim = the last value of self.active_pool (admission order); return self._preempt(victim), which releases it (blocks back, nothing cached, outputs kept, head of the queue).",
    ),
    Exercise(
        id="2.8",
        title="Preempt until it fits",
        module="scheduler",
        minutes=10,
        hint="Each preemption frees some memory, maybe not enough: try again after each one. When must the loop give up?",
        approach="While new_blocks is None: victim = self._preempt_victim(output) (your 2.7 under first come, first served; the policy's choice otherwise); if the victim is the request itself, return False; otherwise new_blocks = allocate_slots(request, num_new_tokens) again. The running set shrinks by one each turn and the request is in it, so the loop ends.",
    ),
    Exercise(
        id="2.9",
        title="Reject what can never fit",
        module="scheduler",
        minutes=10,
        hint="Compare the blocks the whole request would ever need (prompt + max_new_tokens) with the size of the entire cache, not with what is free now.",
        approach="needed = ceil((num_prompt_tokens + max_new_tokens) / block_size). If needed <= num_blocks return False. Otherwise set status REJECTED, write a reason with both numbers, append the request to self.rejected and return True.",
    ),
    Exercise(
        id="3.1",
        title="A doubly linked free-block queue",
        module="kv_cache",
        minutes=15,
        hint="Every block knows its two neighbours; the sentinels mean no special case for the ends or an empty queue.",
        approach="remove: make the block's neighbours point at each other, set its pointers to None, count it out. popleft: remove the block after fake_head. append: link the block between fake_tail's previous block and fake_tail (four pointers), count it in.",
    ),
    Exercise(
        id="3.2",
        title="The block pool: hand out, take back, share",
        module="kv_cache",
        minutes=15,
        hint="Blocks leave from the front of the free queue and come back at the back; a block is free exactly when nobody holds it.",
        approach="get_new_blocks: popleft num_blocks times; for each block call _maybe_evict_cached_block, then set its one holder. free_blocks: decrement each ref_cnt in order and append the block when it reaches 0. touch: a block with ref_cnt 0 is removed from the free queue, then every block gets one more holder.",
    ),
    Exercise(
        id="3.3",
        title="allocate_slots: all or nothing",
        module="kv_cache",
        minutes=30,
        hint="Decide first, change second: work out everything the step will take from the pool, compare it with the free blocks, and only then touch anything.",
        approach="can_allocate and allocate_slots share _num_new_blocks: max(0, blocks_needed(num_tokens) - held); None when that plus num_extra exceeds the free blocks. allocate_slots: hits = _check_allocation(...); the step ends at num_computed_tokens + num_new_computed_tokens + num_new_tokens; find the shared blocks to copy; count extra free blocks (copies, and hits whose ref_cnt is 0); ask _num_new_blocks and return None on None. Otherwise create the table, touch and append the hits, make the copies, append the new blocks, publish full blocks, record an admission, return copies + new blocks.",
    ),
    Exercise(
        id="3.4",
        title="KVCacheManager.free",
        module="kv_cache",
        minutes=5,
        hint="Which of a request's blocks is least likely to be useful to someone else later?",
        approach="Pop the request's table (an empty list when there is none) and hand reversed(table) to the pool's free_blocks, so the tail is queued (and reused) first.",
    ),
    Exercise(
        id="4.1",
        title="The block hash chain",
        module="kv_cache",
        minutes=10,
        hint="A block's name must depend on every token before it, and on nothing that changes between processes.",
        approach="hash_block_tokens: hashlib.sha256 over a stable encoding of (parent hash, the tokens as ints), e.g. repr(...).encode(), and .digest(). hash_request_tokens: walk the full blocks, each block's parent being the previous hash (None first).",
    ),
    Exercise(
        id="4.2",
        title="Hash once, publish once",
        module="kv_cache",
        minutes=20,
        hint="A request's tokens only ever grow: what it hashed or published before is still right, so only the blocks after that need work.",
        approach="_block_hashes: while one more full block of request.all_token_ids fits after the known hashes, hash it with the last hash as parent (None first) and append. _cache_full_blocks: full = min(num_tokens, request.num_tokens) // block_size; offer blocks num_cached_block .. full with their hashes and token slices to the pool, then remember full. cache_full_blocks: skip a block that has a hash or whose hash is already in the map; else set its hash and tuple(tokens) and add it to the map.",
    ),
    Exercise(
        id="4.3",
        title="Prefix-cache lookup",
        module="kv_cache",
        minutes=15,
        hint="A hit must mean the whole prefix up to it is cached; and one token must always be left to compute.",
        approach="get_cached_block: dict lookup, then compare the block's token_ids with tuple(token_ids). get_computed_blocks: only the first (num_tokens - 1) // block_size hashes of _block_hashes(request) may hit; walk them, ask the pool for each with that block's tokens, stop at the first None.",
    ),
    Exercise(
        id="4.4",
        title="Free and LRU eviction",
        module="kv_cache",
        minutes=10,
        hint="A freed block stays published until the pool hands it out for other tokens; then its old name must go.",
        approach="Delete the block's entry from cached_block_hash_to_block, then set its block_hash and token_ids to None.",
    ),
    Exercise(
        id="4.5",
        title="Fork and copy-on-write",
        module="kv_cache",
        minutes=15,
        hint="A fork copies the table, not the blocks. A copy-on-write swaps one entry of the table for a fresh block.",
        approach="fork: touch the parent's blocks, store list(parent's blocks) as the child's table, and give the child (child, a copy of the parent's hash list) and the parent's num_cached_block. _copy_on_write: take len(indices) new blocks; for each index, free the old block through the pool, put the new one in its place, and append (old id, new id) to pending_copies; return the new blocks. take_pending_copies: swap the list for an empty one and return the old one.",
    ),
    Exercise(
        id="4.6",
        title="The copy-on-write decision",
        module="kv_cache",
        minutes=15,
        hint="Which blocks does this step write into, and which of them does someone else still read?",
        approach="The step writes positions first_write .. num_tokens - 1, i.e. blocks first_write // block_size up to the last one the table already holds (at most blocks_needed(num_tokens) of them); keep the indices of those with ref_cnt > 1; none when num_tokens <= first_write.",
    ),
    Exercise(
        id="4.7",
        title="Eviction policies: FIFO and LFU",
        module="eviction",
        minutes=20,
        hint="A heap cannot delete from its middle, so it keeps entries that no longer mean anything: when you meet one at the top, how do you tell it is out of date? A key is a tuple compared left to right: what must decide first, and what only breaks ties?",
        approach="_pop_victim: pop the smallest entry (key, tick, block id) off free_heap until the block it names is free (ref_cnt 0) and the entry's tick equals freed_at of that block; return that block (the block stays in the free queue). FIFOBlockPool.eviction_key: (cached_at of the block, freed_at of the block). LFUBlockPool.eviction_key: (whether the block holds a hash, its num_shares, its freed_at).",
    ),
    Exercise(
        id="5.1",
        title="Write K/V into the paged cache",
        module="attention",
        minutes=10,
        hint="A slot number names one token's place across all blocks: what shape makes the cache indexable by it?",
        approach="slot = block_id * block_size + offset: view each cache as [num_blocks * block_size, KVH, D] and assign the keys and values at those rows, in place, in the cache's dtype.",
    ),
    Exercise(
        id="5.2",
        title="Reference paged decode attention",
        module="attention",
        minutes=20,
        hint="Read the sequence back in logical order first; then it is ordinary attention for one query.",
        approach="gather_kv: index the cache with the first ceil(seq_len / block_size) ids of the row, flatten the blocks into tokens, keep seq_len. Attention: per sequence, give each query head its KV head (h // (H // KVH): repeat_interleave the gathered keys and values over the heads), then scores = q.k * scale per head, softmax over the keys, weighted sum of values, in float32.",
    ),
    Exercise(
        id="5.3",
        title="Mixed prefill and decode attention",
        module="attention",
        minutes=20,
        hint="A chunk is the sequence's LAST L tokens: where does query i sit, and which keys may it see?",
        approach="Query i sits at position seq_len - L + i and may see keys at positions 0 .. that position: mask later keys with -inf before the softmax, in float32. Query head h reads KV head h // (H // KVH), as in 5.2.",
    ),
    Exercise(
        id="5.4",
        title="Triton paged decode kernel",
        module="attention",
        minutes=40,
        hint="One program per (sequence, query head): loop over the block table, keep a running max and sum (online softmax).",
        approach="Each program takes one query row and reads KV head head // QUERIES_PER_KV. Keep three running values in float32: the largest score so far (start at minus infinity), the sum of exponentials (0.0) and the weighted sum of values. For each of the sequence's ceil(seq_len / BLOCK_SIZE) blocks, load its keys and values with masks for lanes past BLOCK_SIZE, seq_len and HEAD_DIM, score them (masked lanes at minus infinity), rescale the old sum and accumulator by exp(old max - new max), then add this block's exp(score - new max) terms. Finally divide the accumulator by the sum and store it in out's dtype.",
    ),
    Exercise(
        id="5.5",
        title="Model-runner inputs",
        module="model_runner",
        minutes=15,
        hint="Positions start at position_ids_start (the tokens already cached); position p lives in block p // block_size at offset p % block_size.",
        approach="First give every token the index of its sequence (repeat_interleave of arange(B) by num_tokens); then its offset within its chunk is its index in the row minus query_start_loc of its sequence; position = start + offset; index the table with (sequence, position // block_size) for the slot.",
    ),
    Exercise(
        id="7.1",
        title="Priority scheduling",
        module="scheduler",
        minutes=15,
        hint="Two places decide who goes first: where a request enters the waiting queue, and who steps back when memory is short. Both compare the same key, (priority, arrival_time); which end of it is 'least urgent'?",
        approach="_insert_by_priority: walk the queue and insert the request before the first one whose (priority, arrival_time) is strictly larger; if there is none, append (equal keys stay first come, first served). _preempt_lowest_priority: the victim is the running request with the largest (priority, arrival_time), taking the most recently admitted among exact ties (search the running set from its newest end); then return self._preempt(victim), the given release (under this policy it re-queues the victim through _insert_by_priority).",
    ),
    Exercise(
        id="7.2",
        title="A watermark for admission",
        module="scheduler",
        minutes=10,
        hint="The watermark protects requests that are already running. Count the blocks the first chunk would take (a partial block is a whole block) and see what would be left free. And if nobody is running, what is there to protect?",
        approach="If no request is running, return True. Otherwise blocks = blocks_needed(num_new_tokens, block_size); return free blocks - blocks >= self.watermark_blocks. Change nothing.",
    ),
    Exercise(
        id="7.3",
        title="Swap or recompute: a CPU pool and the cost model",
        module="scheduler",
        minutes=20,
        hint="A swap moves bytes twice (out, then back in) and pays the link's fixed latency each time; a recompute pays FLOPs once. Swap-out only has to remember what went to the CPU pool and give the victim its computed tokens back; swap-in is an admission that must also make room for everything it kept.",
        approach="swap_seconds: 0 for no tokens, else 2 * (latency + tokens * bytes per token / bandwidth). recompute_seconds: tokens * flops_per_token / flops_per_s. swap_crossover: try n = 1, 2, ... up to max_tokens and return the first n for which swap is strictly cheaper; None if none is. _move_to_cpu: cpu_blocks = blocks_needed(num_computed, block_size); if num_computed is 0 or cpu_blocks exceeds the free CPU blocks return False; else record _swapped[id] = cpu_blocks, set num_computed_tokens back to num_computed, return True. _move_to_gpu: kept = num_computed_tokens; n = min(uncomputed, budget left); set num_computed_tokens to 0, allocate_slots(request, kept + n), restore kept; on None return None; else delete it from _swapped, remove it from the waiting queue, mark it RUNNING, add it to active_pool, and return self._new_sequence(request, n).",
    ),
    Exercise(
        id="7.4",
        title="Abort: give everything back at once",
        module="scheduler",
        minutes=10,
        hint="A request to end is in one of three places: running, waiting, or already settled. Only the first two own anything to give back; the third must be left exactly as it is.",
        approach="Take the request out of active_pool (pop with a default) or, failing that, out of the waiting queue with self._take_waiting; if it is in neither, return None. Otherwise free its blocks with the manager, set its status and reason, and return it.",
    ),
    Exercise(
        id="7.5",
        title="Reset the prefix cache",
        module="kv_cache",
        minutes=5,
        hint="Unpublishing a block someone is reading would be harmless here, but vLLM refuses anyway: when is every block free? And a reset must forget a prefix in two places: the lookup table and the block itself.",
        approach="If fewer blocks are free than the pool has, return False. Otherwise clear every block's block_hash and token_ids, empty cached_block_hash_to_block, and return True; never touch the free queue.",
    ),
    Exercise(
        id="8.1",
        title="Keep an evicted block in the CPU tier",
        module="offload",
        minutes=15,
        hint="Three questions for each offered block: does the tier hold it already, is there a free slot, and if not, which entry may give its slot up? A slot a load reads this step is off limits.",
        approach="offer: if the hash is in entries, you may move it to the end and stop (no second save). Else take a slot from _free_slot; with None, keep nothing. Store TierEntry(slot, tuple(token_ids)) under the hash (the end of the OrderedDict is the most recent) and append (block id, slot) to pending_saves. _free_slot: pop a free slot if any; else walk entries from the oldest, drop the first whose slot is not pinned (count it) and return its slot; None if all are pinned.",
    ),
    Exercise(
        id="8.2",
        title="Ask the tier how much more it holds",
        module="offload",
        minutes=10,
        hint="It is 4.3's lookup again, one tier down: it starts where the device's hits stop, and it stops at the first block the tier cannot give back exactly. Which block may never be loaded?",
        approach="Walk block indices from num_computed_tokens // block_size up to (but not including) the block holding the last token, and the hash chain's length; stop at the first whose hash is missing or whose entry's token_ids differ from the block's tokens; return the count times block_size. Touch nothing.",
    ),
    Exercise(
        id="8.3",
        title="Queue the loads after allocation",
        module="offload",
        minutes=15,
        hint="Between the question and the allocation, the allocation itself may have pushed some of those blocks out of the tier. Load what is still there, in order, and make sure nothing can take those slots before the copy runs.",
        approach="Start at block index num_computed_tokens // block_size; for each allocated block id (as many as num_external_tokens // block_size), look its hash up again (tokens too); at the first miss stop. For each hit: append (entry.slot, block id) to pending_loads, add the slot to pinned, move the entry to the end. Count the misses in stats.failed and return hits times block_size.",
    ),
    Exercise(
        id="8.4",
        title="Admit a request whose prompt is in the tier",
        module="offload",
        minutes=15,
        hint="Device hits first, then the tier, then one allocation for both; a request that waits for its load is out of the queue but not running, and it costs this step nothing.",
        approach="hits, n = manager.get_computed_blocks(request); k = tier.get_num_new_matched_tokens(request, n); k == 0: return None. blocks = allocate_slots(request, k, n, hits); None: return False. Remove it from the waiting queue, set num_computed_tokens = n and status WAITING_FOR_REMOTE_KVS, loaded = tier.update_state_after_alloc(request, blocks, k), loading[id] = (request, loaded), manager.forget_unwritten_tail(request, n + loaded); return True.",
    ),
    Exercise(
        id="8.5",
        title="Proceed as a prefix hit",
        module="offload",
        minutes=10,
        hint="Once loaded, the request is like a swapped-in one: its table already covers what it counts as computed, so only its next chunk needs memory.",
        approach="chunk = min(request.num_uncomputed_tokens, token_budget_left); blocks = allocate_slots(request, chunk); None: return False. Discard its id from loaded, remove it from the waiting queue, status RUNNING, active_pool[id] = request, output.add(self._new_sequence(request, chunk), blocks.get_block_ids()); return True.",
    ),
]

EXERCISES: dict[str, Exercise] = {exercise.id: exercise for exercise in _EXERCISES}
EXERCISE_MODULES: frozenset[str] = frozenset(ex.module for ex in EXERCISES.values())


def get(exercise_id: str) -> Exercise:
    """Look an exercise up, with a clear error for a typo."""
    try:
        return EXERCISES[str(exercise_id)]
    except KeyError:
        known = ", ".join(EXERCISES)
        raise ValueError(f"No exercise {exercise_id!r}; the exercises are: {known}.") from None


def total_minutes(module: str | None = None) -> int:
    """The estimated time for the whole course (or one module's exercises), for planning a session."""
    return sum(ex.minutes for ex in EXERCISES.values() if module in (None, ex.module))
