"""Which workloads each exercise runs, and how its observations compare (the contract's words, what is free)."""

from __future__ import annotations

from .attention import TOLERANCE, attention_ops, run_attention
from .core import Rules
from .engine import (
    costs_ops,
    engine_ops,
    guarded,
    hash_ops,
    manager_ops,
    run_costs,
    run_engine,
    run_hashes,
    run_manager,
)
from .eviction import policy_manager_ops, pool_ops, run_policy_manager, run_pool
from .small import memory_ops, run_memory, run_step, step_ops
from .tier import run_tier, run_tier_engine, tier_engine_ops, tier_ops

ENGINE = ("engine", engine_ops, guarded(run_engine))
MANAGER = ("manager", manager_ops, guarded(run_manager))
HASHES = ("hashes", hash_ops, guarded(run_hashes))
COSTS = ("costs", costs_ops, guarded(run_costs))

MEMORY = ("memory", memory_ops, guarded(run_memory))
STEP = ("step", step_ops, guarded(run_step))

ATTENTION = ("attention", attention_ops, guarded(run_attention))

POOL = ("pool", pool_ops, guarded(run_pool))
POLICY_MANAGER = ("manager", policy_manager_ops, guarded(run_policy_manager))
TIER = ("tier", tier_ops, guarded(run_tier))
TIER_ENGINE = ("tier engine", tier_engine_ops, guarded(run_tier_engine))

WORKLOADS: dict[str, list[tuple]] = {
    **{ex: [ATTENTION] for ex in ("5.1", "5.2", "5.3", "5.4", "5.5")},
    "0.1": [MEMORY],
    "0.2": [MEMORY],
    "1.1": [STEP],
    **{ex: [ENGINE] for ex in ("2.1", "2.2", "2.3", "2.4", "2.5", "2.6", "2.7", "2.8", "2.9", "7.1", "7.2", "7.4")},
    **{ex: [MANAGER, ENGINE] for ex in ("3.1", "3.2", "3.3", "3.4", "4.2", "4.3", "4.4", "4.5", "4.6", "7.5")},
    "4.1": [HASHES, MANAGER],
    "7.3": [COSTS, ENGINE],
    "4.7": [POOL, POLICY_MANAGER],
    "8.1": [TIER],  # not the engine: its offers would meet 8.1's free choices un-normalised
    "8.2": [TIER, TIER_ENGINE],
    "8.3": [TIER, TIER_ENGINE],
    "8.4": [TIER_ENGINE],
    "8.5": [TIER_ENGINE],
}

# Each observable, in the contracts' words (kvcourse/core/contract.py, the exercises' comments).
WORDS = {
    "returned": "the call must return what the contract says",
    "kv_bytes": "one token's cache bytes: a key AND a value, in every layer, for each KV head (not each query "
    "head), spec.head_dim numbers each, times the dtype's element size",
    "sequences": "whole sequences only: memory // (seq_len x bytes_per_token), exact at any size (none when "
    "the budget holds less than one)",
    "seqs": "the plan lists, in order, each scheduled request's ScheduledSequence (its next tokens after "
    "num_computed_tokens, is_decode, position_ids_start, samples_token): decodes oldest admission first, then "
    "one prefill chunk, then admissions in queue order, within the token budget and max_batch_size",
    "new_block_ids": "each planned request's blocks NEW this step are exactly the blocks allocate_slots returned "
    "(prefix hits are not new)",
    "block_ids": "after the plan is applied, each planned request's block table is handed to the executor",
    "preempted": "preempt as few requests as needed, lowest priority first (under FCFS the newest admission), "
    "and only while memory is short",
    "finished_req_ids": "the plan lists the requests settled since the previous step",
    "blocks_to_copy": "the copy-on-write copies of this step go to the executor once",
    "swapped_out": "a victim is swapped out when it has computed tokens and the CPU pool has room for its blocks",
    "swapped_in": "a swapped-out request comes back with its kept tokens",
    "total": "the plan's total tokens never exceed the token budget",
    "waiting": "the waiting queue keeps its order: first come, first served (a preempted request at the head)",
    "running": "the running set (active_pool) keeps admission order",
    "finished": "every settled request (finished, aborted, failed) is listed once, in order",
    "rejected": "a request that can never fit (prompt + max_new_tokens in blocks > the whole cache) is rejected; "
    "one that fits exactly is accepted",
    "requests": "each request's [id, status, num_computed_tokens, output_tokens, num_preemptions, reason]",
    "output_types": "each sampled token is appended to output_tokens as an int (the executor may hand back a "
    "numpy or torch integer)",
    "reason_numbers": "a rejected request's reason says what it needs and what there is: [id, names the blocks it "
    "needs for its prompt and max_new_tokens, names the whole cache's num_blocks]",
    "frees": "a finished request's blocks are given back once, at once: free() calls per request id (one per "
    "finish, preemption or abort)",
    "deadlock": "an empty plan raises Deadlock(describe_stall(core.scheduler, core.iteration)): the text of THIS "
    "iteration",
    "preemptions": "num_preemptions counts preemptions (an abort or a finish is not one)",
    "swap": "swap counters: [tokens swapped out, tokens swapped in, transfers, CPU blocks held per request]",
    "tables": "each request's block table: prefix hits first, then its blocks, covering exactly its tokens",
    "free_queue": "the free-block queue's order, front first: blocks leave from the front, come back at the "
    "back in the order given (a request's blocks tail first)",
    "free_queue_backward": "walking the free queue backwards agrees with walking it forwards",
    "num_free": "num_free_blocks counts the blocks in the free queue",
    "ref_cnt": "each block's ref_cnt is the number of tables holding it",
    "published": "a full block whose tokens are all computed is published once, under the hash of its whole prefix "
    "(block_hash, token_ids); a block handed out for new tokens is unpublished first",
    "cache_map": "cached_block_hash_to_block maps each published hash to its block",
    "stats": "prefix-cache stats [admissions, tokens queried, hit tokens]: one admission per request admitted",
    "pending": "pending copy-on-write copies (old id, new id), oldest first",
    "hashes_computed": "each full block is hashed once per request: a request that grows, or is preempted and "
    "admitted again, costs at most its new full blocks",
    "computed": "num_computed_tokens of each request",
    "again": "equal (parent, tokens) give equal hashes, every time",
    "types": "a hash is a bytes digest",
    "tuple_input": "the hash depends on the tokens, not on the container they come in",
    "swap_seconds": "a swap's round trip: 2 x (latency + tokens x bytes per token / bandwidth); 0 tokens cost 0",
    "recompute_seconds": "a recompute costs tokens x flops_per_token / flops_per_s",
    "swap_crossover": "the smallest n from 1 to max_tokens for which swap is strictly cheaper, else None",
    "error": "the contract says this call raises",
    "type": "the result is a whole number (int), exact at any size: integer arithmetic, no float on the way",
    "events": "engine_step makes exactly one plan inside core.phase('schedule'), executes that plan inside "
    "core.phase('execute', plan), hands the executor's tokens to update_from_output inside core.phase('update', plan); "
    "an empty plan raises Deadlock(describe_stall(...)), also on an idle engine",
    "outputs": "each request's output_tokens and status after the step",
    "out_float32": "the output equals attention computed in float32 (the given scale; softmax over the keys the "
    "query may see) within float32 rounding",
    "out_float16": "the output, in float16, equals attention computed in float32 (scores past 65,504 must not "
    "overflow: upcast first, subtract the running max) within float16 rounding",
    "out_bfloat16": "the output, in bfloat16, equals attention computed in float32 within bfloat16 rounding",
    "dtype": "the result keeps the dtype the contract names (the cache's or the query's)",
    "shape": "the output has the query's shape",
    "chunk_dtype": "_chunk_attention returns its [L, H, D] rows in the query's dtype",
    "in_place": "the caches change IN PLACE: callers keep their references (a view of a bigger buffer too)",
    "gather_kv": "gather_kv returns row p = the entry written for position p (block p // block_size, offset p % block_size)",
    "gather_shape": "gather_kv returns [seq_len, H, D]",
    "positions": "token positions start at position_ids_start of each sequence",
    "slot_mapping": "slot = table[b, p // block_size] * block_size + p % block_size, exact for block ids past 2**31 (int64)",
    "seq_lens": "seq_lens = tokens in the cache once the step has run",
    # 4.7 (kvcourse/eviction.py)
    "handed": "get_new_blocks hands out, in order, the free blocks the policy ranks first (LRU: free the longest; "
    "FIFO: published earliest, an uncached block first, ties to the one free the longest; LFU: an uncached block "
    "first, then the fewest shares, ties to the one free the longest), ranked by their LAST free, never a block a "
    "hit revived",
    "cached": "the blocks still holding a cached prefix: only a block handed out loses its prefix",
    "heap": "each free_heap entry is looked at once: the victim's entry and every stale entry met on the way "
    "leave the heap (stale: its block is held again, or was freed again since); the rest stay",
    # 8.1-8.5 (kvcourse/offload.py); a CPU slot is named by the entry holding it (which free slot is free)
    "lru": "the tier's entries, least recently used first, each with its block's tokens: a stored block is the "
    "most recently used; a full tier drops only its least recently used entry that no load pins; a load promotes "
    "its entry; asking changes nothing",
    "saves": "one save (device block id, its slot) per stored block, in order; none for a block already held",
    "loads": "a load (its entry's slot, device block id) per leading allocated block still held with the same "
    "tokens, in order, stopping at the first that is not",
    "pinned": "a slot a planned load reads is pinned (never dropped or reused) until the step ends",
    "slots": "every CPU slot is held by one entry or listed in free_slots, never both, never past num_blocks",
    "tier_stats": "the tier's counters [offered, saved, dropped, loaded, failed]: each drop counted, and each "
    "allocated block that will not load counted as failed",
    "matched": "get_num_new_matched_tokens: the tokens of the longest run of full blocks right after the device "
    "hits that the tier holds with the same tokens (a collision never counts), never the block holding the last "
    "token; a multiple of block_size",
    "will_load": "update_state_after_alloc returns the tokens its queued loads bring (a multiple of block_size)",
    "kv_saves": "the step's saves (device block, CPU slot) go to the executor",
    "kv_loads": "the step's loads (CPU slot, device block) go to the executor",
    "loading_req_ids": "a request whose prompt is in the tier waits for its load (WAITING_FOR_REMOTE_KVS), out of "
    "the queue, with no plan entry and no token of the budget",
    "loading": "loading[id] = the tokens its load brings (what update_state_after_alloc said)",
    "calls": "right after each _start_load / _admit_loaded: [name, request, returned, status, num_computed_tokens, "
    "in the waiting queue, loading tokens, in `loaded`, running, block table]; _start_load: None and nothing "
    "changed when the tier holds no more, False and nothing changed when refused, else out of the queue, "
    "WAITING_FOR_REMOTE_KVS, its device hits computed, its table covering hits + the tokens that will load; "
    "_admit_loaded: False and nothing changed when refused, else RUNNING, out of the queue and of `loaded`",
    "loaded": "a loaded request is admitted as a prefix hit: its id leaves `loaded` when it runs",
}

# What the contracts leave free: never compared.
ALWAYS_FREE = frozenset({"message", "where"})
HASH_ONCE = {"4.2", "4.3", "4.5"}  # only these exercises' contracts fix how often a block is hashed


def rules_for(exercise_id: str) -> Rules:
    """The exercise's comparison rules."""
    free = set(ALWAYS_FREE)
    if exercise_id not in HASH_ONCE:
        free.add("hashes_computed")
    return Rules(
        words=WORDS,
        free=frozenset(free),
        rel_tol={"swap_seconds": 1e-9, "recompute_seconds": 1e-9, **{f"out_{k}": v for k, v in TOLERANCE.items()}},
        abs_tol={"swap_seconds": 1e-15, "recompute_seconds": 1e-15, **{f"out_{k}": v for k, v in TOLERANCE.items()}},
    )
