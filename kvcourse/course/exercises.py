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
        hint="Every layer stores one key and one value vector per token; count the elements, then the bytes.",
        approach="Every layer stores one key and one value vector per token; count the elements, then the bytes.",
    ),
    Exercise(
        id="0.2",
        title="Sequences that fit in a memory budget",
        module="memory",
        minutes=5,
        hint="Work out the bytes one whole sequence needs first, then how many of those fit (whole sequences only).",
        approach="Work out the bytes one whole sequence needs first, then how many of those fit (whole sequences only).",
    ),
    Exercise(
        id="2.1",
        title="Allocate a slot for each decode",
        module="scheduler",
        minutes=10,
        hint="A decode feeds exactly one token. Ask the manager for room for it before putting it in the batch.",
        approach="A decode feeds exactly one token. Ask the manager for room for it before putting it in the batch.",
    ),
    Exercise(
        id="2.2",
        title="Allocate prefill chunks",
        module="scheduler",
        minutes=15,
        hint="A chunk is at most what is left of the token budget. Allocate it before scheduling; when admitting, take the admitted request itself (not the queue's head) out of the waiting queue.",
        approach="A chunk is at most what is left of the token budget. Allocate it before scheduling; when admitting, take the admitted request itself (not the queue's head) out of the waiting queue.",
    ),
    Exercise(
        id="2.3",
        title="Free blocks on completion",
        module="scheduler",
        minutes=10,
        hint="A request that is complete gives all its blocks back, exactly once, and leaves the running set.",
        approach="A request that is complete gives all its blocks back, exactly once, and leaves the running set.",
    ),
    Exercise(
        id="2.4",
        title="Preempt by recompute",
        module="scheduler",
        minutes=15,
        hint="Victim: the most recently admitted running request. Free its blocks, forget its computed tokens, keep its outputs.",
        approach="Victim: the most recently admitted running request. Free its blocks, forget its computed tokens, keep its outputs.",
    ),
    Exercise(
        id="2.5",
        title="Reject what can never fit",
        module="scheduler",
        minutes=10,
        hint="Compare the blocks the whole request would ever need (prompt + max_new_tokens) with the size of the entire cache.",
        approach="Compare the blocks the whole request would ever need (prompt + max_new_tokens) with the size of the entire cache.",
    ),
    Exercise(
        id="3.1",
        title="A doubly linked free-block queue",
        module="kv_cache",
        minutes=15,
        hint="Each block keeps prev/next pointers; unlinking a block from the middle only rewires its two neighbours.",
        approach="Each block keeps prev/next pointers; unlinking a block from the middle only rewires its two neighbours.",
    ),
    Exercise(
        id="3.2",
        title="The block pool",
        module="kv_cache",
        minutes=10,
        hint="Take blocks from the front of the free queue; a freed block goes to the back, so it is reused last.",
        approach="Take blocks from the front of the free queue; a freed block goes to the back, so it is reused last.",
    ),
    Exercise(
        id="3.3",
        title="KVCacheManager.allocate_slots",
        module="kv_cache",
        minutes=20,
        hint="Blocks needed = ceil(tokens after this step / block_size) - blocks held. Check before you touch anything.",
        approach="Blocks needed = ceil(tokens after this step / block_size) - blocks held. Check before you touch anything.",
    ),
    Exercise(
        id="3.4",
        title="KVCacheManager.free",
        module="kv_cache",
        minutes=5,
        hint="Return the request's blocks tail first, and forget its block table.",
        approach="Return the request's blocks tail first, and forget its block table.",
    ),
    Exercise(
        id="4.1",
        title="The block hash chain",
        module="kv_cache",
        minutes=10,
        hint="A block's hash must depend on every token before it: mix in the parent block's hash.",
        approach="A block's hash must depend on every token before it: mix in the parent block's hash.",
    ),
    Exercise(
        id="4.2",
        title="Prefix-cache lookup",
        module="kv_cache",
        minutes=15,
        hint="Walk the prompt's full blocks in order and stop at the first miss; always leave the last prompt token to compute.",
        approach="Walk the prompt's full blocks in order and stop at the first miss; always leave the last prompt token to compute.",
    ),
    Exercise(
        id="4.3",
        title="Sharing cached blocks",
        module="kv_cache",
        minutes=10,
        hint="A hit adds a holder: raise its ref count, and if it was free (ref count 0) take it out of the free queue.",
        approach="A hit adds a holder: raise its ref count, and if it was free (ref count 0) take it out of the free queue.",
    ),
    Exercise(
        id="4.4",
        title="Free and LRU eviction",
        module="kv_cache",
        minutes=15,
        hint="A block with ref count 0 keeps its hash until it is handed out again; evict from the front of the free queue.",
        approach="A block with ref count 0 keeps its hash until it is handed out again; evict from the front of the free queue.",
    ),
    Exercise(
        id="4.5",
        title="Fork and copy-on-write",
        module="kv_cache",
        minutes=20,
        hint="A fork shares every block. Writing into a shared block means copying it first and reporting (src, dst).",
        approach="A fork shares every block. Writing into a shared block means copying it first and reporting (src, dst).",
    ),
    Exercise(
        id="5.1",
        title="Write K/V into the paged cache",
        module="attention",
        minutes=10,
        hint="slot = block_id * block_size + offset: view the cache as [num_blocks * block_size, H, D] and index it.",
        approach="slot = block_id * block_size + offset: view the cache as [num_blocks * block_size, H, D] and index it.",
    ),
    Exercise(
        id="5.2",
        title="Reference paged decode attention",
        module="attention",
        minutes=20,
        hint="Gather each sequence's keys and values through its block table, keep the first seq_len, then softmax(q.k * scale) @ v.",
        approach="Gather each sequence's keys and values through its block table, keep the first seq_len, then softmax(q.k * scale) @ v.",
    ),
    Exercise(
        id="5.3",
        title="Mixed prefill and decode attention",
        module="attention",
        minutes=20,
        hint="A chunk holds a sequence's last L tokens: query i sits at position (seq_len - L + i) and may see keys up to and including that position.",
        approach="A chunk holds a sequence's last L tokens: query i sits at position (seq_len - L + i) and may see keys up to and including that position.",
    ),
    Exercise(
        id="5.4",
        title="Triton paged decode kernel",
        module="attention",
        minutes=40,
        hint="One program per (sequence, head): loop over the block table, keep a running max and sum (online softmax).",
        approach="One program per (sequence, head): loop over the block table, keep a running max and sum (online softmax).",
    ),
    Exercise(
        id="5.5",
        title="Model-runner inputs",
        module="model_runner",
        minutes=15,
        hint="Positions start at position_ids_start (the tokens already cached); position p lives in block p // block_size at offset p % block_size.",
        approach="Positions start at position_ids_start (the tokens already cached); position p lives in block p // block_size at offset p % block_size.",
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
