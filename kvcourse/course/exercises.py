"""The course's exercises: id, title, module, and a hint that never gives the answer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Exercise:
    """One graded exercise: the pytest marker is derived from the id ("2.1" -> "ex2_1")."""

    id: str
    title: str
    module: str
    hint: str

    @property
    def marker(self) -> str:
        """The pytest marker that selects this exercise's tests."""
        return "ex" + self.id.replace(".", "_")

    @property
    def path(self) -> str:
        """The file the learner edits, relative to the repository root."""
        return f"kvcourse/{self.module}.py"


_ROWS = [
    (
        "0.1",
        "KV bytes per token",
        "memory",
        "Every layer stores one key and one value vector per token; count the elements, then the bytes.",
    ),
    (
        "0.2",
        "Sequences that fit in a memory budget",
        "memory",
        "Work out the bytes one whole sequence needs first, then how many of those fit (whole sequences only).",
    ),
    (
        "2.1",
        "Allocate a slot for each decode",
        "scheduler",
        "A decode feeds exactly one token. Ask the manager for room for it before putting it in the batch.",
    ),
    (
        "2.2",
        "Allocate prefill chunks",
        "scheduler",
        "A chunk is at most what is left of the token budget. Allocate it before scheduling; when admitting, take the admitted request itself (not the queue's head) out of the waiting queue.",
    ),
    (
        "2.3",
        "Free blocks on completion",
        "scheduler",
        "A request that is complete gives all its blocks back, exactly once, and leaves the running set.",
    ),
    (
        "2.4",
        "Preempt by recompute",
        "scheduler",
        "Victim: the most recently admitted running request. Free its blocks, forget its computed tokens, keep its outputs.",
    ),
    (
        "2.5",
        "Reject what can never fit",
        "scheduler",
        "Compare the blocks the whole request would ever need (prompt + max_new_tokens) with the size of the entire cache.",
    ),
    (
        "3.1",
        "A doubly linked free-block queue",
        "kv_cache",
        "Each block keeps prev/next pointers; unlinking a block from the middle only rewires its two neighbours.",
    ),
    (
        "3.2",
        "The block pool",
        "kv_cache",
        "Take blocks from the front of the free queue; a freed block goes to the back, so it is reused last.",
    ),
    (
        "3.3",
        "KVCacheManager.allocate_slots",
        "kv_cache",
        "Blocks needed = ceil(tokens after this step / block_size) - blocks held. Check before you touch anything.",
    ),
    ("3.4", "KVCacheManager.free", "kv_cache", "Return the request's blocks tail first, and forget its block table."),
    (
        "4.1",
        "The block hash chain",
        "kv_cache",
        "A block's hash must depend on every token before it: mix in the parent block's hash.",
    ),
    (
        "4.2",
        "Prefix-cache lookup",
        "kv_cache",
        "Walk the prompt's full blocks in order and stop at the first miss; always leave the last prompt token to compute.",
    ),
    (
        "4.3",
        "Sharing cached blocks",
        "kv_cache",
        "A hit adds a holder: raise its ref count, and if it was free (ref count 0) take it out of the free queue.",
    ),
    (
        "4.4",
        "Free and LRU eviction",
        "kv_cache",
        "A block with ref count 0 keeps its hash until it is handed out again; evict from the front of the free queue.",
    ),
    (
        "4.5",
        "Fork and copy-on-write",
        "kv_cache",
        "A fork shares every block. Writing into a shared block means copying it first and reporting (src, dst).",
    ),
    (
        "5.1",
        "Write K/V into the paged cache",
        "attention",
        "slot = block_id * block_size + offset: view the cache as [num_blocks * block_size, H, D] and index it.",
    ),
    (
        "5.2",
        "Reference paged decode attention",
        "attention",
        "Gather each sequence's keys and values through its block table, keep the first seq_len, then softmax(q.k * scale) @ v.",
    ),
    (
        "5.3",
        "Mixed prefill and decode attention",
        "attention",
        "A chunk holds a sequence's last L tokens: query i sits at position (seq_len - L + i) and may see keys up to and including that position.",
    ),
    (
        "5.4",
        "Triton paged decode kernel",
        "attention",
        "One program per (sequence, head): loop over the block table, keep a running max and sum (online softmax).",
    ),
    (
        "5.5",
        "Model-runner inputs",
        "model_runner",
        "Positions start at position_ids_start (the tokens already cached); position p lives in block p // block_size at offset p % block_size.",
    ),
]

EXERCISES: dict[str, Exercise] = {row[0]: Exercise(*row) for row in _ROWS}
EXERCISE_MODULES: frozenset[str] = frozenset(ex.module for ex in EXERCISES.values())


def get(exercise_id: str) -> Exercise:
    """Look an exercise up, with a clear error for a typo."""
    try:
        return EXERCISES[str(exercise_id)]
    except KeyError:
        known = ", ".join(EXERCISES)
        raise ValueError(f"No exercise {exercise_id!r}; the exercises are: {known}.") from None
