# %% [markdown]
# # 02 · The scheduler–cache contract
#
# > **What to expect.** The outputs stored in this notebook come from the reference solutions; running a
# > cell replaces its output with your code's. Run All stops at your first unwritten exercise (its
# > `NotImplementedError`) and leaves the cells below it empty, so run the notebook cell by cell.
#
# Notebook 01 ended with a scheduler that plans batches by token budget and batch size alone, and a
# plan that needed more KV memory than the GPU had. The fix is a conversation: before the scheduler
# puts a token in a batch, it **asks** a KV-cache manager for room for that token's keys and values;
# when a request finishes, it **gives** the room back; and when there is no room, it decides who waits.
#
# In this notebook you will:
#
# 1. separate the two roles: the scheduler (**policy**) and the KV-cache manager (**mechanism**);
# 2. meet the data structures they exchange and the few methods of their contract;
# 3. drive the contract from a mock manager that only counts blocks;
# 4. make `StallFreeScheduler` memory-aware, in nine exercises in `kvcourse/scheduler.py`, from the
#    source lesson's three TODOs to the whole step:
#
# | exercise | what you write | minutes |
# |---|---|---|
# | 2.1 | describe a chunk, and put it in the step's plan once its memory is secured | 10 |
# | 2.2 | admit a waiting request with its first chunk (allocate before admitting) | 15 |
# | 2.3 | free a request's blocks when it completes | 5 |
# | 2.4 | plan one step: decodes, the prefill in progress, then admissions | 20 |
# | 2.5 | take the step's results in (`update_from_output`) | 15 |
# | 2.6 | first-come, first-served admission | 10 |
# | 2.7 | choose the victim of a preemption: the newest request | 5 |
# | 2.8 | preempt until it fits | 10 |
# | 2.9 | reject a request that could never fit | 10 |
#
# Each exercise states a **contract** (what must be true when your code returns), not the statements to
# write. Six **spot the bug** boxes show what goes wrong in the lesson this course grew from, each
# before the exercise that fixes it; and three times you are asked to **predict** before the cell that
# shows the answer: `answer("2.a", None)` says what is asked, replace `None` with your guess.
#
# After each exercise, run its `check(...)` cell. Stuck? `hint("2.1")` nudges, `hint("2.1", level=2)`
# gives the approach in words, and `solution("2.1")` shows the reference.

# %% tags=["hide-input"]
# In Google Colab: fetch the course and install it beside Colab's own CUDA torch. Elsewhere: only autoreload.
import importlib.util
import os
import subprocess
import sys

try:
    import google.colab  # noqa: F401  (importable only in Colab)

    IN_COLAB = True
except ImportError:
    IN_COLAB = False
if IN_COLAB and importlib.util.find_spec("kvcourse") is None:
    if not os.path.isdir("/content/kvcourse"):
        subprocess.run(
            ["git", "clone", "--depth=1", "https://github.com/kvcourse-org/kvcourse", "/content/kvcourse"], check=True
        )
    sys.path.insert(0, "/content/kvcourse")
    from kvcourse.course.colab import install

    install("/content/kvcourse")
if IN_COLAB:
    os.chdir("/content/kvcourse/notebooks")  # where the notebooks read their data from
# %load_ext autoreload
# %autoreload 2

# %%
from collections import deque

import matplotlib.pyplot as plt

from kvcourse import answer, check, hint, solution, toy, viz  # noqa: F401  (hint, solution: for you)
from kvcourse.core.contract import KVCacheBlocks, KVCacheManagerProtocol, MockKVCacheManager, describe_protocol
from kvcourse.core.request import Request
from kvcourse.models.gpt2 import LESSON_PROMPTS, load_tokenizer
from kvcourse.scheduler import ScheduledSequence, SchedulerOutput, StallFreeScheduler
from kvcourse.viz import diagrams

# %% [markdown]
# ## 1. Two roles: policy and mechanism
#
# | | the scheduler | the KV-cache manager |
# |---|---|---|
# | decides | **which** requests run this step, and how many tokens each | **where** their keys and values live |
# | knows | requests, their queue, the token budget, the batch size | blocks: which are free, which request holds which |
# | does not know | block ids, reference counts, the free list | why a request runs, or what a token budget is |
#
# The scheduler is **policy**: decodes first, one chunked prefill, then admissions; who is preempted,
# who is rejected. The manager is **mechanism**: KV memory is cut into fixed-size **blocks** (here, of
# `block_size` tokens each), and the manager hands them out and takes them back. Because the scheduler
# only talks to the manager through a few methods, the mock manager of this notebook and the paged
# allocator you build in notebook 03 are interchangeable.
#
# **This policy is the source lesson's, not vLLM's.** "Decodes first, then one prefill chunk, then
# admissions" is the stall-free batching of Sarathi-Serve (Agrawal et al., OSDI '24): running decodes
# never wait behind a prefill. vLLM's `schedule()` (`vllm/v1/core/sched/scheduler.py` ·
# `Scheduler.schedule`) has no phases at all: every request just has tokens it still needs to compute.
#
# | | this course (`StallFreeScheduler`) | vLLM v1 (`Scheduler.schedule`) |
# |---|---|---|
# | order within a step | every decode, then at most one running prefill's chunk, then admissions | running requests in their queue order (a decode or the next chunk, whichever each needs), then waiting requests |
# | prefills in flight | one chunked prefill at a time | as many as the budget allows (`long_prefill_token_threshold` caps one prompt's chunk) |
# | a decode behind a long prefill | never: decodes are planned first | possible when the prefilling request is ahead of it in the running queue (newer requests sit behind, so usually not) |
# | admission | the first chunk must fit | the whole prompt must fit (`scheduler_reserve_full_isl`, on by default) |
# | a preemption this step | nobody is admitted | nobody is admitted |
#
# Both stop at the head of the waiting queue (first come, first served) and preempt the newest running
# request. Notebook 09 runs both orders on one batch.
#
# Each step, three parties talk:

# %%
# Figure: The three parties of a step: the scheduler plans, the KV-cache manager allocates, the executor runs the plan.
diagrams.scheduler_cache_executor()

# %% [markdown]
# ## 2. The data structures
#
# * **`Request`** (`kvcourse.core.request`): what the scheduler manages. The source lesson's names are all
#   there (`id`, `prompt_tokens`, `max_new_tokens`, `output_tokens`, `tokens_processed`,
#   `is_prefill_done()`, `is_complete()`), next to the ones vLLM uses: `num_computed_tokens` (tokens
#   whose K/V are in the cache; `tokens_processed` is another name for it), `num_tokens` (prompt plus
#   outputs), `all_token_ids`, `status` and `num_preemptions`.
# * **`KVCacheBlocks`**: an opaque handle the manager returns from a successful allocation. The
#   scheduler never looks inside; the executor asks it for `get_block_ids()`.
# * **The block table**: for each request, the manager keeps the list of physical blocks that hold its
#   tokens, in order. Token `p` of a request lives in block `table[p // block_size]`, slot
#   `p % block_size`. Blocks of one request need not be next to each other.

# %%
request = Request(id=0, prompt_tokens=[464, 3139, 286, 4881, 318, 6342, 13, 632, 318, 257], max_new_tokens=5)
print(request)
print(
    "num_tokens:",
    request.num_tokens,
    "| num_computed_tokens:",
    request.num_computed_tokens,
    "| prefill done:",
    request.is_prefill_done(),
    "| complete:",
    request.is_complete(),
)
print(KVCacheBlocks([7, 1, 4]), "->", KVCacheBlocks([7, 1, 4]).get_block_ids())

# %%
# Figure: A block table: a request's tokens in blocks 7, 1 and 4 of a pool of 10; token p in block table[p // 4], slot p % 4.
diagrams.block_table([7, 1, 4], num_tokens=10, block_size=4, pool=10)

# %% [markdown]
# ## 3. The contract
#
# The contract is written once, as a Protocol (`kvcourse/core/contract.py`): the scheduler accepts any manager
# that is an instance of it (`isinstance(manager, KVCacheManagerProtocol)`), the mock of this notebook and
# the paged manager of notebook 03 alike. Here it is, read from the Protocol itself:

# %%
print(describe_protocol(KVCacheManagerProtocol))
print("\nthe mock keeps it:", isinstance(MockKVCacheManager(num_blocks=4, block_size=4), KVCacheManagerProtocol))

# %% [markdown]
# The scheduler calls `allocate_slots` **before** it plans `n` tokens of a request, `free` when a request
# completes or is preempted, and `get_computed_blocks` when it admits one (prefix-cache hits: always none
# for the mock; notebook 04 makes them real). The executor never asks the manager anything: the
# scheduler hands it each request's block table, and the block copies to make (notebook 04), in the
# step's plan.
#
# `allocate_slots` is the heart of it. The blocks a request needs after a step are
# `ceil((num_computed_tokens + n) / block_size)`; it already holds some; the difference (never below
# zero) must come from the free pool. If the pool is short, the answer is `None`, and the scheduler
# must not schedule those tokens. Because the call is all or nothing, the scheduler simply tries it
# (as vLLM v1's does): the source lesson's "check `can_allocate`, then `allocate_slots`" would do the same
# arithmetic twice, and is not the scheduler's question. `can_allocate` stays in the contract for code
# that wants to look without taking (a widget, a test, an admission policy that only peeks).

# %% [markdown]
# ## 4. The mock manager
#
# `MockKVCacheManager(num_blocks, block_size)` implements the contract with counting alone: block ids
# are fake consecutive numbers, but the counts are exact. With `verbose=True` it prints what it does,
# like the source lesson's mock.

# %%
manager = MockKVCacheManager(num_blocks=8, block_size=4, verbose=True)
request = Request(id=0, prompt_tokens=list(range(1, 7)), max_new_tokens=4)  # 6 prompt tokens

blocks = manager.allocate_slots(request, 6)  # the whole prompt: ceil(6/4) = 2 blocks
request.num_computed_tokens += 6  # the scheduler applies this once the step's plan is made
print("handle:", blocks, "| block table:", manager.get_block_ids(request))

for token in (7, 8, 9):  # one decode at a time
    blocks = manager.allocate_slots(request, 1)
    request.num_computed_tokens += 1
    print(f"token {token}: new blocks {blocks.get_block_ids()} | block table: {manager.get_block_ids(request)}")

print("room for 30 more tokens?", manager.can_allocate(request, 30), "->", manager.allocate_slots(request, 30))
manager.free(request)
manager.free(request)  # a second free is harmless


# %% [markdown]
# ### Spot the bug 1: the mock's "simplification"
#
# The source lesson's mock does not count blocks from the tokens a request will hold. It guesses how
# much room is left in the last block from `tokens_processed`, with the comment *"This is a
# simplification; a real manager would be more precise"*. Its scheduler advances `tokens_processed`
# only for prefill chunks, never for decodes. Take a 15-token prompt in blocks of 16, followed by 20
# decodes: 35 tokens, which need 3 blocks.
#
# **Predict.** How many blocks does the lesson's mock hold for this request after the 20 decodes?

# %%
answer("2.a", None)

# %% [markdown]
# Here is its arithmetic:


# %% collapsed=true jupyter={"outputs_hidden": true} tags=["hide-output"]
def lesson_blocks_to_allocate(held_blocks, tokens_processed, num_tokens_to_alloc, block_size):
    """The source lesson's mock: room left in the last block, guessed from tokens_processed."""
    current_tokens = held_blocks * block_size
    tokens_in_last_block = current_tokens - tokens_processed if tokens_processed < current_tokens else 0
    effective_tokens_to_alloc = max(0, num_tokens_to_alloc - tokens_in_last_block)
    return (effective_tokens_to_alloc + block_size - 1) // block_size


BLOCK_SIZE, PROMPT_LEN = 16, 15
held = lesson_blocks_to_allocate(0, 0, PROMPT_LEN, BLOCK_SIZE)  # the prefill
tokens_processed = PROMPT_LEN  # decodes never move it
for decode in range(1, 21):
    held += lesson_blocks_to_allocate(held, tokens_processed, 1, BLOCK_SIZE)
    if decode % 5 == 0:
        in_cache = PROMPT_LEN + decode
        print(
            f"after {decode:>2} decodes: {in_cache} tokens in the cache need "
            f"{-(-in_cache // BLOCK_SIZE)} blocks; the lesson's mock holds {held}"
        )

# %% [markdown]
# The mock keeps saying "there is room in the last block", so the request writes 35 tokens into
# one 16-token block: the extra keys and values land in blocks that belong to somebody else. **The fix**
# is to count, never guess: blocks needed = `ceil((num_computed_tokens + n) / block_size) - blocks held`,
# with `num_computed_tokens` advanced for **every** scheduled token, decodes included. That is what
# `MockKVCacheManager` does:

# %%
manager = MockKVCacheManager(num_blocks=100, block_size=BLOCK_SIZE)
request = Request(id=0, prompt_tokens=list(range(PROMPT_LEN)), max_new_tokens=20)
manager.allocate_slots(request, PROMPT_LEN)
request.num_computed_tokens = PROMPT_LEN
for decode in range(1, 21):
    manager.allocate_slots(request, 1)
    request.num_computed_tokens += 1
    if decode % 5 == 0:
        print(
            f"after {decode:>2} decodes: {request.num_computed_tokens} tokens, "
            f"MockKVCacheManager holds {len(manager.get_block_ids(request))} blocks"
        )

# %% [markdown]
# ## 5. The memory-aware scheduler
#
# `StallFreeScheduler(token_budget, max_batch_size, kv_cache_manager)` keeps the lesson's names:
# `waiting_queue` (a deque) and `active_pool` (a dict of running requests, in admission order). This is
# what one call of `schedule_next_batch()` must guarantee; you will write it, piece by piece:
#
# * **Order.** First a decode for every running request past its prefill (oldest admission first), then
#   at most one chunk of a running request that is still prefilling, then admissions from the waiting
#   queue, first come, first served.
# * **Limits.** At most `token_budget` tokens and `max_batch_size` sequences; each request at most once.
# * **Memory first.** No token goes into the batch before `allocate_slots` has succeeded for it. A
#   running request that gets no memory may take it from a younger one (preemption, section 7); a
#   newcomer never takes memory from anyone, and a step that had to preempt admits nobody.
#
# One call of `schedule_next_batch()` returns the step's **plan**, a `SchedulerOutput` (vLLM's name; in
# `kvcourse/core/sched_output.py`): the scheduled sequences (tokens, first position, whether each samples),
# `num_scheduled_tokens` per request, each request's block ids and the ones new this step, the block
# copies to make first, and who was preempted. The source lesson's loop still reads it as a batch:
# `if not batch`, `len(batch)` and `for seq in batch` go over the scheduled sequences. The executor takes
# the plan whole, and `update_from_output(scheduler_output, sampled)` closes the step with it.
#
# The bookkeeping rules that the executor and the rest of the course rely on:
#
# * **Plan, then apply.** While the step is being planned, `num_computed_tokens` does not move: each
#   chunk starts at the number of tokens already cached, and its tokens are `all_token_ids[start:start
#   + n]`. When planning is done, each planned request's `num_computed_tokens` grows by its
#   `num_scheduled_tokens`, once (vLLM's `_update_after_schedule`). A request preempted later in the same
#   step leaves the plan, and its tokens go back to the budget.
# * **The chunk that reaches `num_tokens` samples a token** (`ScheduledSequence.samples_token`): the
#   last prefill chunk samples the first output token, and every decode samples the next one.
#
# The names, once: the source lesson's where it has them, vLLM v1's everywhere else.
#
# | this course (the lesson's names) | vLLM v1 (`vllm/v1/core/sched/`, `vllm/v1/core/kv_cache_manager.py`) |
# |---|---|
# | `StallFreeScheduler` | `Scheduler` |
# | `schedule_next_batch()` | `Scheduler.schedule()` |
# | `active_pool` / `waiting_queue` | `Scheduler.running` / `Scheduler.waiting` |
# | `tokens_processed` (also `num_computed_tokens`) | `Request.num_computed_tokens` |
# | `ScheduledSequence` (one per scheduled request) | `NewRequestData` / `CachedRequestData` entries |
# | `SchedulerOutput`, `num_scheduled_tokens`, `finished_req_ids` | the same names |
# | `_update_after_schedule`, `update_from_output`, `finish_requests` | the same names |
# | `KVCacheBlocks`, `allocate_slots`, `get_computed_blocks`, `free` | the same names |
#
# Each exercise's comment in `kvcourse/scheduler.py` states its **contract**: what must be true when
# your code returns, and which helpers exist. Design the code yourself; `hint("2.1")` nudges,
# `hint("2.1", level=2)` gives the approach in words, and `solution("2.1")` shows the reference. The
# small helpers are exercises too: the budget arithmetic (`_budget_left`, `_has_room`) and
# `_is_prefilling` are part of 2.4, `_running(request_id)` of 2.5.
#
# The first three exercises are the source lesson's own three TODOs, each in a method of its own. Until
# `schedule_next_batch` exists (Exercise 2.4), the demos call those methods directly, and put requests
# straight into the waiting queue with `enqueue` (`add_request` also checks that a request could ever
# fit in the cache: that is Exercise 2.9):


# %%
def enqueue(scheduler, *requests):
    """What add_request does, minus the check that a request can ever fit (Exercise 2.9)."""
    scheduler.waiting_queue.extend(requests)


# %% [markdown]
# ### Spot the bug 2: a placeholder for the first decode
#
# In the source lesson, prefill chunks never sample. The first decode therefore has no token to feed,
# so it feeds a placeholder, `-1`, at position `len(prompt) + len(outputs)`. Our toy model reads its
# cache like a real model does, so let it run those two steps:

# %%
prompt = toy.toy_requests([6], max_new_tokens=3, seed=1)[0].prompt_tokens
executor = toy.ToyExecutor()
lesson_steps = [
    ScheduledSequence(0, prompt, is_decode=False, position_ids_start=0, samples_token=False),
    ScheduledSequence(0, [-1], is_decode=True, position_ids_start=len(prompt)),
]
try:
    for seq in lesson_steps:
        executor.execute_batch([seq])
except ValueError as error:
    print("Failing run:", error)

# %% [markdown]
# Even with a real first token, the lesson's position is off by one: the first output token belongs
# at position `len(prompt)` (positions start at 0), but `len(prompt) + len(outputs)` puts it one further.

# %%
executor = toy.ToyExecutor()
outputs = [executor.execute_batch([ScheduledSequence(0, prompt, False, 0, samples_token=True)])[0]]
try:
    executor.execute_batch([ScheduledSequence(0, [outputs[-1]], True, len(prompt) + len(outputs))])
except ValueError as error:
    print("Failing run:", error)

# %% [markdown]
# **The fix** is in the contract: the chunk that completes the prompt samples the first output token,
# a decode feeds the newest sampled token, and every position starts at `num_computed_tokens`.
#
# ### Exercise 2.1: describe a chunk, and plan it
#
# Two pieces, in `kvcourse/scheduler.py`. `StallFreeScheduler._new_sequence(request, n)` returns the
# `ScheduledSequence` of the request's next `n` tokens (which tokens, from which position, whether it is a
# decode, whether the chunk samples), and changes nothing. And the end of `_schedule_running(request, n,
# output)`: that method gets the memory for a running request's next `n` tokens first
# (`allocate_slots`, and preemption when memory is short: Exercise 2.8); your part puts the sequence into
# the step's plan with the ids of the blocks `allocate_slots` just added (`output.add(sequence,
# block_ids)`). One token may or may not need a new block: which is it here?

# %%
check("2.1")

# %%
scheduler = StallFreeScheduler(64, 4, MockKVCacheManager(num_blocks=8, block_size=4))
request = Request(id=0, prompt_tokens=list(range(1, 8)), max_new_tokens=5, output_tokens=[42])
scheduler.kv_cache_manager.allocate_slots(request, 7)  # the prompt is cached: 7 tokens in 2 blocks
request.num_computed_tokens = 7
scheduler.active_pool[request.id] = request
for _ in range(2):
    output = SchedulerOutput(block_ids={})
    scheduler._schedule_running(request, 1, output)
    print(
        output[0], "| new blocks:", output.new_block_ids, "| table:", scheduler.kv_cache_manager.get_block_ids(request)
    )
    request.num_computed_tokens += 1  # what applying the plan does
    request.output_tokens.append(43)


# %% [markdown]
# ### Spot the bug 3: admission pops the head of the queue
#
# The source lesson admits like this: it iterates over a **copy** of the waiting queue, skips a
# request that does not fit, and, for one that fits, calls `popleft()`. Suppose request 1 is too big
# for the free memory right now and request 2 fits:


# %%
def lesson_admission(waiting_queue, active_pool, fits):
    """The source lesson's admission loop, reduced to its bookkeeping."""
    for req in list(waiting_queue):  # iterate over a copy ...
        if fits(req):
            waiting_queue.popleft()  # ... but pop the HEAD of the real queue
            active_pool[req.id] = req


big = Request(id=1, prompt_tokens=list(range(14)), max_new_tokens=4)
small = Request(id=2, prompt_tokens=list(range(6)), max_new_tokens=4)
waiting_queue, active_pool = deque([big, small]), {}
lesson_admission(waiting_queue, active_pool, fits=lambda req: req.num_tokens <= 8)
print("waiting:", [r.id for r in waiting_queue], "| running:", list(active_pool))

# %% [markdown]
# Request 1 vanished: it is in neither the queue nor the running set, so it will never run, and nobody
# will ever say so. Request 2 is in both, so it would be admitted twice. Keep that in mind for the
# next exercise: whatever request you admit is the one that must leave the queue.
#
# ### Exercise 2.2: admit a waiting request
#
# `_admit(request, token_budget_left, output)`, in `kvcourse/scheduler.py`, for a **waiting** request: the
# manager's `get_computed_blocks(request)` may report a cached prefix (prefix-cache hits; none with the
# mock), and the first chunk is what comes after it, as much as the budget allows. `allocate_slots`
# counts from the request's `num_computed_tokens`, which still says 0 when you call it: the hits reach it
# as its `num_new_computed_tokens` and `new_computed_blocks`, so they count once. A newcomer preempts
# nobody: when `allocate_slots` says no, `_admit` returns `False` and nothing has changed. On success it
# returns `True`: **this** request has left the queue, is `RUNNING`, is the newest entry of
# `active_pool`, counts its cached prefix as computed, and its first chunk is in the plan.

# %%
check("2.2")

# %% [markdown]
# The situation of the bug above, 7 of 10 blocks held by someone else: your `_admit` refuses the big
# request without touching it, and admits the small one, which alone leaves the queue.

# %%
manager = MockKVCacheManager(num_blocks=10, block_size=4)
manager.allocate_slots(Request(id=99, prompt_tokens=[0] * 28, max_new_tokens=0), 28)  # someone else
scheduler = StallFreeScheduler(token_budget=64, max_batch_size=4, kv_cache_manager=manager)
big = Request(id=1, prompt_tokens=list(range(14)), max_new_tokens=4)
small = Request(id=2, prompt_tokens=list(range(6)), max_new_tokens=4)
enqueue(scheduler, big, small)
output = SchedulerOutput(block_ids={})
print("admit request 1:", scheduler._admit(big, 64, output))
print("admit request 2:", scheduler._admit(small, 64, output), "| planned:", list(output))
print("waiting:", [r.id for r in scheduler.waiting_queue], "| running:", list(scheduler.active_pool))

# %% [markdown]
# ### Exercise 2.3: free blocks on completion
#
# When a request is complete (it has `max_new_tokens` tokens, or it sampled its end-of-sequence token),
# `_finish(request)` settles it. Write it: afterwards the request is `FINISHED`, it has left the running
# set, and all its blocks are back with the manager, at once, so that a waiting request can use them in
# this very step; the other requests keep theirs. Without this, a finished request keeps its memory
# forever, and the cache fills with the dead.

# %%
check("2.3")

# %% [markdown]
# ### Exercise 2.4: plan one step
#
# Now the step itself. `schedule_next_batch()` starts an empty `SchedulerOutput` and ends by applying it
# (that part is written). You write its first passes over the running requests: a decode for every
# request past its prefill, oldest admission first, then the next chunk of the oldest request still
# prefilling, each through `self._schedule_running(request, n, output)`, which secures the memory
# (your 2.1). The admissions after them are Exercise 2.6; until then the check keeps the waiting queue
# empty. The contract is the list at the top of this section: order, limits, memory first. One detail
# decides whether your step is right: a decode may preempt a younger running request; that request
# must then get nothing in this step.

# %%
check("2.4")

# %% [markdown]
# ### Exercise 2.5: take the step's results in
#
# After the executor ran the plan, `update_from_output(scheduler_output, sampled_token_ids)` receives one
# sampled token per sequence whose `samples_token` is true. Write it: each such request gets its token appended;
# a chunk that does not reach the end of its prompt samples nothing; every request that is now complete
# is finished (your 2.3); the method returns the requests it finished. A sequence that should have sampled
# but got no token is a `ValueError` that names the request, and so is any sequence of the plan (sampling
# or not) whose request is not running (`_running` says so).

# %%
check("2.5")

# %% [markdown]
# ### Spot the bug 4: skipping ahead starves a large request
#
# The source lesson, and this course until recently, admitted **past** a request that did not fit: try
# the next one in the queue, and the next. It looks efficient: memory that the head cannot use goes to
# someone who can. Here is that policy, on a cache of 16 blocks of 4 tokens: four small requests (6
# prompt tokens and 2 new ones: 2 blocks each, for two steps), then one with a 40-token prompt that wants
# a single token (10 free blocks at once), then four new small requests after every step, for 150 steps.
# Nobody ever needs a block beyond those of its first chunk, so nobody is preempted: only admission
# decides who runs.


# %%
class SkipAheadScheduler(StallFreeScheduler):
    """Admission that skips a waiting request that does not fit and admits the first one behind it that does."""

    def _admit(self, request, token_budget_left, output):
        for candidate in list(self.waiting_queue):  # noqa: SIM110 (super() needs a loop, not a generator)
            if super()._admit(candidate, token_budget_left, output):
                return True
        return False


def steady_stream(scheduler_class, arrival_steps=150):
    """Run the stream; return the step in which the 40-token request finished, and the trace."""
    scheduler = scheduler_class(64, 8, MockKVCacheManager(num_blocks=16, block_size=4))
    enqueue(scheduler, *toy.toy_requests([6] * 4, max_new_tokens=2, seed=1, first_id=10))
    large = toy.toy_requests([40], max_new_tokens=1, seed=2)[0]
    enqueue(scheduler, large)
    new_ids = iter(range(100, 100 + 4 * arrival_steps, 4))

    def arrive(iteration, batch, scheduler):
        if iteration < arrival_steps:
            enqueue(
                scheduler, *toy.toy_requests([6] * 4, max_new_tokens=2, seed=1000 + iteration, first_id=next(new_ids))
            )

    trace = toy.run(scheduler, on_step=arrive)
    done = next(step.iteration for step in trace.steps if large.id in step.finished)
    return done, trace


# %% [markdown]
# **Predict.** With skip-ahead, the 40-token request finishes (a) within 20 steps, (b) within 100 steps,
# or (c) only after the small requests stop arriving?

# %%
answer("2.b", None)

# %% collapsed=true jupyter={"outputs_hidden": true} tags=["hide-output"]
# Figure: Skip-ahead scheduling: a stream of small requests keeps every block busy and the 40-token request waits.
done, trace = steady_stream(SkipAheadScheduler)
small_done = sum(len(step.finished) for step in trace.steps if step.iteration < done)
print(f"skip-ahead: the 40-token request finished in step {done} of {len(trace.steps)};")
print(f"{small_done} small requests finished before it.")
fig, ax = plt.subplots(figsize=(10, 2.6))
viz.plot_memory(trace, capacity_tokens=16 * 4, ax=ax, title="Skip-ahead: small requests keep every block busy")
plt.tight_layout()
plt.show()

# %% [markdown]
# Every time a small request finishes, its blocks go to the small request behind the head, never enough
# of them free at once for the large one; it runs only when the stream dries up (and, in a server, it
# never does). vLLM v1 admits **first come, first served**: when the head of the queue cannot be
# allocated, admission stops for this step. The blocks that small requests give back then accumulate
# until the head fits. (vLLM is also stricter about what "can be allocated" means: with
# `scheduler_reserve_full_isl`, on by default, the head is admitted only when blocks for its whole
# prompt are free, not just for its first chunk as here.)
#
# ### Exercise 2.6: first-come, first-served admission
#
# Write the admissions at the end of `schedule_next_batch()`: they admit waiting requests (your `_admit`),
# in queue order, while the plan has room and fewer than `max_batch_size` requests are running, and they
# stop at the first request that cannot be admitted: nobody behind it may go first. And a step in which
# anyone was preempted (`output.preempted_req_ids`) admits nobody: the memory just freed is for the
# requests already running.

# %%
check("2.6")

# %%
done, trace = steady_stream(StallFreeScheduler)
print(f"first come, first served: the 40-token request finished in step {done} of {len(trace.steps)}.")

# %% [markdown]
# **The fix of spot the bug 2, step by step.** Your scheduler now runs whole steps. On the prompt of
# spot the bug 2: the chunk that completes the prompt samples, and each decode feeds the newest token at
# the next position.

# %%
scheduler = StallFreeScheduler(64, 4, MockKVCacheManager(num_blocks=8, block_size=4))
request = Request(id=0, prompt_tokens=prompt, max_new_tokens=3)
enqueue(scheduler, request)
executor = toy.ToyExecutor(block_size=4)
while scheduler.has_unfinished_requests():
    batch = scheduler.schedule_next_batch()
    print(batch[0])
    sampled = executor.execute(batch)
    scheduler.update_from_output(batch, sampled)
print("outputs:", request.output_tokens, "| generated alone:", toy.toy_generate(prompt, 3))

# %% [markdown]
# ## 6. The source lesson's example
#
# Four prompts, tokenized with the real GPT-2 tokenizer, each wanting 5 new tokens; a mock cache of
# 100 blocks of 16 tokens; a token budget of 1024 and at most 8 requests per batch. The toy model
# stands in for GPT-2 (its vocabulary has GPT-2's 50,257 ids), so the generated ids are deterministic
# but not English. The lesson's comments gave approximate prompt lengths; here are the real ones:

# %%
tokenizer = load_tokenizer()
for i, text in enumerate(LESSON_PROMPTS):
    print(f"Req {i}: {len(tokenizer.encode(text)):>2} tokens  {text[:60]}...")

# %%
manager = MockKVCacheManager(num_blocks=100, block_size=16, verbose=True)
scheduler = StallFreeScheduler(token_budget=1024, max_batch_size=8, kv_cache_manager=manager)
requests = [
    Request(id=i, prompt_tokens=tokenizer.encode(text), max_new_tokens=5) for i, text in enumerate(LESSON_PROMPTS)
]
for request in requests:
    enqueue(scheduler, request)

trace = toy.run(scheduler, executor=toy.ToyExecutor(vocab_size=len(tokenizer)), verbose=True)

# %% [markdown]
# Read it as the conversation of section 1: in iteration 1 every prompt fits the budget, so all four
# are admitted and each asks for its prompt's blocks; each prefill samples its first token. From then
# on everything is decodes, and a block is allocated only when a request's tokens spill past a block
# boundary (request 1 at its 17th token, requests 0 and 2 at theirs, request 3 at its 33rd). When the
# fifth token arrives, every request is complete and gives its blocks back: all 100 are free again.

# %%
print("outputs:", {r.id: r.output_tokens for r in requests})
print("free blocks at the end:", manager.get_num_free_blocks(), "of", manager.num_blocks)

# %% [markdown]
# ## 7. When memory runs out
#
# 100 blocks was plenty. Now take a cache of 12 blocks of 8 tokens (96 tokens) for four requests of
# 16 to 24 prompt tokens that each want 24 more: all four fit at admission, but they grow by one
# token per decode, and their blocks run out while all of them are still running.
#
# ### Spot the bug 5: skipping is a deadlock
#
# The source lesson's answer to a failed allocation is to skip the request for this step and try
# again next step. Here is that policy, as a scheduler whose running requests just wait when they get
# no block:

# %%
TIGHT_CACHE = dict(num_blocks=12, block_size=8)


def tight_workload():
    return toy.toy_requests([20, 18, 24, 16], max_new_tokens=24, seed=7)


class SkippingScheduler(StallFreeScheduler):
    """The source lesson's policy: a running request that gets no block waits for the next step."""

    def _schedule_running(self, request, num_new_tokens, output):
        new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
        if new_blocks is not None:  # no room: skip it this step, and hope
            output.add(self._new_sequence(request, num_new_tokens), new_blocks.get_block_ids())
        return new_blocks is not None


scheduler = SkippingScheduler(token_budget=64, max_batch_size=4, kv_cache_manager=MockKVCacheManager(**TIGHT_CACHE))
for request in tight_workload():
    enqueue(scheduler, request)
try:
    toy.run(scheduler)
except toy.Deadlock as stall:
    print(stall.trace.format())
    print("\nDeadlock:", stall)

# %% [markdown]
# Every running request waits for a block that only another running request could give back, and
# none of them will ever finish to give one back. Waiting does not help: the scheduler must **take**
# memory from someone.
#
# ### Exercise 2.7: choose the victim, the newest
#
# vLLM's answer is **preemption by recompute**: pick a victim, free all its blocks, and put it back at
# the **head** of the waiting queue. Its generated tokens are kept; when it is admitted again, its
# prefill recomputes the K/V of the prompt *and* of those tokens (`all_token_ids`), and it continues
# exactly where it stopped. The release is written once, for every policy: `_preempt(victim)` (read it
# in `kvcourse/scheduler.py`). The policy is which request to release: under first-come, first-served
# it is the **most recently admitted** running request, the lowest priority; since the oldest request
# is never the victim of a younger one, it always makes progress, so the run always ends.
#
# Write the choice in `_preempt_most_recent()`, and release the victim with `self._preempt(victim)`.

# %%
check("2.7")

# %% [markdown]
# ### Exercise 2.8: preempt until it fits
#
# `_schedule_running(request, n, output)` is where every running request gets its memory. When
# `allocate_slots` succeeds at the first try, the plan takes the sequence (your 2.1). Write the middle,
# for when memory is short: preempt, one victim at a time, as few requests as needed, until
# `allocate_slots` succeeds (one victim may free too little). Ask for each victim with
# `self._preempt_victim(output)`: it preempts by the scheduler's policy (under first come, first served
# your 2.7; notebook 07 adds others), takes the victim out of the plan, and returns it. When the request
# itself turns out to be the victim, it steps back (return `False`): it is then preempted and waits at
# the head of the queue. Nobody older than the request is ever preempted for it, and the loop always
# ends.

# %%
check("2.8")

# %% [markdown]
# The same tight cache, with preemption. **Predict** first: the four requests (ids 0 to 3) are admitted
# in the order of their ids. Which one is preempted first?

# %%
answer("2.c", None)

# %% collapsed=true jupyter={"outputs_hidden": true} tags=["hide-output"]
scheduler = StallFreeScheduler(token_budget=64, max_batch_size=4, kv_cache_manager=MockKVCacheManager(**TIGHT_CACHE))
requests = tight_workload()
for request in requests:
    enqueue(scheduler, request)
trace = toy.run(scheduler)
print(trace.format())
print(
    f"\nFinished in {len(trace.steps)} iterations with {scheduler.num_preemptions} preemptions "
    f"(per request: {[r.num_preemptions for r in requests]})."
)
print(
    "outputs equal to generating each request alone:",
    all(r.output_tokens == toy.toy_generate(r.prompt_tokens, r.max_new_tokens) for r in requests),
)

# %%
# Figure: Tight memory with preemption: the timeline (x: preempted, then recomputed) and the blocks in use at each step.
fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.2), height_ratios=[1.3, 1])
viz.plot_timeline(trace, ax=top, title="Tight memory with preemption (x: preempted, then recomputed)")
viz.plot_memory(trace, capacity_tokens=12 * 8, ax=bottom, title="KV memory in use never exceeds the cache")
plt.tight_layout()
plt.show()


# %% [markdown]
# Preemption costs work (each victim's prompt and outputs are computed again), but nothing is lost:
# the outputs are exactly those of an unconstrained run, and the memory in use never crosses the line
# that notebook 01's scheduler ignored.

# %% [markdown]
# ## 8. A request that can never fit
#
# ### Spot the bug 6: it waits forever
#
# A cache of 12 blocks of 8 tokens holds 96 tokens. A request with a 100-token prompt can never fit,
# however long it waits. The source lesson would skip it every step, forever. With preemption it is
# worse: it is admitted (its first chunk fits), grows, preempts itself, and starts over, while the
# request behind it in the queue starves. Here it is, put in the queue with `enqueue`, which skips the
# check that Exercise 2.9 adds:


# %%
def workload_with_a_giant():
    return toy.toy_requests([20, 100, 18], max_new_tokens=8, seed=3)


scheduler = StallFreeScheduler(token_budget=64, max_batch_size=4, kv_cache_manager=MockKVCacheManager(**TIGHT_CACHE))
requests = workload_with_a_giant()
for request in requests:
    enqueue(scheduler, request)
try:
    toy.run(scheduler)
except toy.Deadlock as stall:
    print(stall.trace.format())
    print("\nStuck:", stall)
print("statuses:", {r.id: r.status.name for r in requests})

# %% [markdown]
# ### Exercise 2.9: reject what can never fit
#
# At its longest, a request holds `len(prompt_tokens) + max_new_tokens` tokens. If the blocks for that
# many tokens (a partial block counts) are more than the **whole** cache (`num_blocks`), it can never
# finish. `add_request` asks `_reject_if_never_fits(request)`; write it. It returns `True` exactly when
# the request can never fit, and then the request is `REJECTED`, has a `reason` a user can act on (what
# it needs, what there is), and is listed in `scheduler.rejected`; `add_request` leaves it out of the
# queue. When it returns `False`, nothing has changed. A rejected request is settled: never silently
# dropped, and it never blocks others.

# %%
check("2.9")

# %%
scheduler = StallFreeScheduler(token_budget=64, max_batch_size=4, kv_cache_manager=MockKVCacheManager(**TIGHT_CACHE))
requests = workload_with_a_giant()
for request in requests:
    scheduler.add_request(request)
trace = toy.run(scheduler)
print(trace.format())
for request in requests:
    print(
        f"Req {request.id}: {request.status.name:<8} {len(request.output_tokens)} tokens"
        + (f"  reason: {request.reason}" if request.reason else "")
    )

# %% [markdown]
# ## Takeaways
#
# * **Policy and mechanism.** The scheduler decides who runs; the KV-cache manager decides where their
#   keys and values live. They meet in a small contract, one Protocol: `allocate_slots` (all or nothing,
#   `None` on failure), `free`, `get_computed_blocks`, `get_num_free_blocks`, and a few more.
# * **No token without memory, one plan per step.** Every planned token was allocated first; the plan
#   (`SchedulerOutput`) carries everything the executor needs; `num_computed_tokens` moves once, after
#   planning; positions follow from it, and the chunk that reaches the end samples.
# * **Failure is policy too.** A failed allocation is not an error: a newcomer waits, and so does
#   everyone behind it (first come, first served: skipping ahead starves large requests); a running
#   request preempts the most recently admitted one, the lowest priority (recompute, nothing lost); and
#   a request that could never fit is rejected, with a reason, at once.
#
# In **03 · A paged KV-cache allocator** you replace the mock with the real thing: a free-block queue,
# a block pool and a `KVCacheManager` with one block table per request. Your scheduler will run on it
# unchanged.
