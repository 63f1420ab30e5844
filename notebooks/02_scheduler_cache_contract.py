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
# 4. make `StallFreeScheduler` memory-aware, in five exercises in `kvcourse/scheduler.py`:
#
# | exercise | what you write |
# |---|---|
# | 2.1 | allocate a slot for each decode |
# | 2.2 | allocate prefill chunks, for running and for newly admitted requests |
# | 2.3 | free a request's blocks when it completes |
# | 2.4 | preempt (by recompute) when a running request cannot get its next block |
# | 2.5 | reject a request that could never fit |
#
# Along the way, five **spot the bug** boxes show what goes wrong in the lesson this course grew from:
# each one runs the buggy version first, then the fix.
#
# After each exercise, run its `check(...)` cell. `hint("2.1")` gives a nudge; `solution("2.1")`
# shows the reference when you are stuck.

# %%
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
import inspect
from collections import deque

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

from kvcourse import check, toy, viz
from kvcourse.kv_cache_interface import KVCacheBlocks, MockKVCacheManager
from kvcourse.models import LESSON_PROMPTS, load_tokenizer
from kvcourse.request import Request
from kvcourse.scheduler import ScheduledSequence, StallFreeScheduler

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
# Each step, three parties talk:


# %%
def box(ax, x, y, w, h, title, lines, color):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", facecolor=color, edgecolor="black"))
    ax.text(x + w / 2, y + h - 0.1, title, ha="center", va="top", fontsize=10.5, weight="bold")
    ax.text(x + w / 2, y + h - 0.75, "\n".join(lines), ha="center", va="top", fontsize=8.5)


def arrow(ax, start, end, label, dy=0.1):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=14, color="black"))
    ax.text((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + dy, label, ha="center", fontsize=8.5)


fig, ax = plt.subplots(figsize=(11, 3.8))
box(
    ax,
    0.0,
    0.5,
    2.8,
    1.9,
    "Scheduler\n(policy)",
    ["waiting_queue, active_pool", "token budget, batch size", "who runs, who waits, who is", "preempted or rejected"],
    "#fde2c8",
)
box(
    ax,
    5.0,
    0.5,
    2.8,
    1.9,
    "KV-cache manager\n(mechanism)",
    ["blocks of block_size tokens", "the free blocks", "a block table per request"],
    "#cfe3f7",
)
box(
    ax,
    10.0,
    0.5,
    2.6,
    1.9,
    "Executor\n(the model)",
    ["writes K/V into blocks", "reads them in attention", "samples next tokens"],
    "#d5efd5",
)
arrow(ax, (2.85, 1.9), (4.95, 1.9), "allocate_slots(req, n)\nfree(req)")
arrow(ax, (4.95, 1.1), (2.85, 1.1), "KVCacheBlocks or None", dy=-0.3)
arrow(ax, (7.85, 1.5), (9.95, 1.5), "block tables")
ax.add_patch(
    FancyArrowPatch(
        (1.4, 0.45), (11.3, 0.45), connectionstyle="arc3,rad=0.2", arrowstyle="-|>", mutation_scale=14, color="tab:gray"
    )
)
ax.text(6.35, -0.62, "batch of ScheduledSequence (tokens, positions)", ha="center", fontsize=8.5, color="dimgray")
ax.add_patch(
    FancyArrowPatch(
        (11.3, 2.45), (1.4, 2.45), connectionstyle="arc3,rad=0.2", arrowstyle="-|>", mutation_scale=14, color="tab:gray"
    )
)
ax.text(
    6.35,
    3.45,
    "sampled tokens -> update_from_output(batch, sampled_token_ids)",
    ha="center",
    fontsize=8.5,
    color="dimgray",
)
ax.set_xlim(-0.2, 12.8)
ax.set_ylim(-0.8, 3.7)
ax.axis("off")
plt.show()

# %% [markdown]
# ## 2. The data structures
#
# * **`Request`** (`kvcourse.request`): what the scheduler manages. The source lesson's names are all
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
BLOCK, TABLE, POOL = 4, [7, 1, 4], 10
fig, ax = plt.subplots(figsize=(11, 3.0))
for p in range(10):  # the request's 10 tokens, grouped into logical blocks
    ax.add_patch(Rectangle((p * 0.55 + (p // BLOCK) * 0.25, 2.0), 0.5, 0.5, facecolor="#fde2c8", edgecolor="black"))
    ax.text(p * 0.55 + (p // BLOCK) * 0.25 + 0.25, 2.25, str(p), ha="center", va="center", fontsize=8)
for i, block_id in enumerate(TABLE):
    x = i * (BLOCK * 0.55 + 0.25) + 1.0
    ax.text(x, 1.55, f"logical {i} -> block {block_id}", ha="center", fontsize=8.5)
ax.text(-0.1, 2.25, "token positions", ha="right", va="center", fontsize=9)
ax.text(-0.1, 1.6, "block table", ha="right", va="center", fontsize=9)
for b in range(POOL):  # the physical pool
    x = b * 1.05
    used = b in TABLE
    ax.add_patch(Rectangle((x, 0.2), 0.95, 0.7, facecolor="#cfe3f7" if used else "white", edgecolor="black"))
    if used:
        filled = min(BLOCK, 10 - TABLE.index(b) * BLOCK)
        for s in range(filled):
            ax.add_patch(Rectangle((x + 0.04 + s * 0.22, 0.28), 0.2, 0.3, facecolor="tab:blue"))
    ax.text(x + 0.475, 0.72, f"block {b}", ha="center", fontsize=7.5)
ax.text(-0.1, 0.55, "physical blocks", ha="right", va="center", fontsize=9)
for i, block_id in enumerate(TABLE):
    x0 = i * (BLOCK * 0.55 + 0.25) + 1.0
    ax.add_patch(
        FancyArrowPatch((x0, 1.5), (block_id * 1.05 + 0.475, 0.95), arrowstyle="-|>", mutation_scale=10, color="gray")
    )
ax.set_xlim(-1.8, 10.6)
ax.set_ylim(0, 2.7)
ax.axis("off")
ax.set_title("A 10-token request with block_size 4: three blocks, anywhere in the pool; the last one is half full")
plt.show()

# %% [markdown]
# ## 3. The contract: four methods (and two helpers)
#
# | method | who calls it, when | what it promises |
# |---|---|---|
# | `get_num_free_blocks() -> int` | the scheduler, to look before it plans | how many blocks could be handed out now |
# | `can_allocate(request, n) -> bool` | the scheduler, to ask without committing | whether `allocate_slots(request, n)` would succeed |
# | `allocate_slots(request, n, num_new_computed_tokens=0, new_computed_blocks=None)` | the scheduler, **before** it schedules `n` tokens of `request` | room for `num_computed_tokens + num_new_computed_tokens + n` tokens, **all or nothing**: a `KVCacheBlocks` handle with the newly added blocks, or `None` and nothing changed |
# | `free(request)` | the scheduler, when a request completes or is preempted | all its blocks go back; freeing an unknown request does nothing |
# | `get_block_ids(request)` | the executor (through the engine) | the request's block table |
# | `get_computed_blocks(request)` | the scheduler, at admission | prefix-cache hits: blocks that already hold the start of the prompt, and how many tokens (always none for the mock; notebook 04 makes them real) |
#
# `allocate_slots` is the heart of it. The blocks a request needs after a step are
# `ceil((num_computed_tokens + n) / block_size)`; it already holds some; the difference (never below
# zero) must come from the free pool. If the pool is short, the answer is `None`, and the scheduler
# must not schedule those tokens. Because the call is all or nothing, the scheduler can simply try it:
# asking `can_allocate` first would do the same arithmetic twice (it is there for code that wants to
# look without committing).

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
request.num_computed_tokens += 6  # the scheduler advances this once it schedules them
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
# only for prefill chunks, never for decodes. Here is its arithmetic, for a 15-token prompt in blocks
# of 16 followed by 20 decodes:


# %%
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
# `waiting_queue` (a deque) and `active_pool` (a dict of running requests, in admission order).
# `schedule_next_batch` still fills the budget in three passes, and now every pass secures memory
# before it schedules anything:

# %%
print(inspect.getsource(StallFreeScheduler.schedule_next_batch))


# %% [markdown]
# The bookkeeping rules that the executor and the rest of the course rely on:
#
# * **`num_computed_tokens` advances when a chunk is scheduled**, right after `allocate_slots`
#   succeeded for it (the executor writes those K/V in this very step). So `allocate_slots` always
#   sees the value *before* the step.
# * **Positions come from `num_computed_tokens`**: a chunk starts at the number of tokens already
#   cached, and its tokens are `all_token_ids[start:start + n]`.
# * **The chunk that reaches `num_tokens` samples a token** (`ScheduledSequence.samples_token`): the
#   last prefill chunk samples the first output token, and every decode samples the next one.
#   `update_from_output(batch, {request_id: token})` appends them and finishes complete requests.
#
# The small helpers are written for you: `_advance(request, n, is_decode)` builds the
# `ScheduledSequence` for the next `n` tokens and advances `num_computed_tokens`;
# `_allocate_or_preempt(request, n)` calls `allocate_slots` and, when memory is short, preempts
# (Exercise 2.4) until it succeeds or the request itself had to step back.
#
# Requests normally enter through `scheduler.add_request(request)`, which first checks that the
# request could ever fit in the cache: that check is Exercise 2.5, at the end of the notebook. Until
# then, the demos put requests straight into the waiting queue with `enqueue`:


# %%
def enqueue(scheduler, *requests):
    """What add_request does, minus the check that a request can ever fit (Exercise 2.5)."""
    scheduler.waiting_queue.extend(requests)


# %% [markdown]
# ### Exercise 2.1: allocate a slot for each decode
#
# A decode feeds one token: the request's newest sampled token, at position `num_computed_tokens`.
# In `kvcourse/scheduler.py`, fill in `StallFreeScheduler._schedule_decode`: ask for room for that
# one token with `self._allocate_or_preempt(request, 1)`; if that fails return `None` (the request
# gets no decode this step), otherwise return `self._advance(request, 1, is_decode=True)`.

# %%
check("2.1")

# %% [markdown]
# ### Exercise 2.2: allocate prefill chunks
#
# Two places, both in `kvcourse/scheduler.py`:
#
# * `_schedule_prefill_chunk(request, token_budget_left)`, for a **running** request whose tokens are
#   not all cached (a chunked prompt, or a recompute after preemption): the chunk is its uncomputed
#   tokens, at most `token_budget_left`; get room with `self._allocate_or_preempt`, then `_advance`.
# * `_admit(request, token_budget_left)`, for a **waiting** request: `num_computed` of its tokens are
#   already cached (prefix-cache hits; always 0 with the mock). Ask
#   `allocate_slots(request, n, num_computed, computed_blocks)` for the rest of its first chunk. A
#   newcomer preempts nobody: on `None` it simply keeps waiting. On success, take **this** request
#   out of the waiting queue, mark it `RUNNING`, put it in `active_pool`, count the cached tokens as
#   computed and `_advance`.

# %%
check("2.2")


# %% [markdown]
# ### Spot the bug 2: admission pops the head of the queue
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
# will ever say so. Request 2 is in both, so it would be admitted twice. **The fix**: remove the request
# you admit, `waiting_queue.remove(req)`, not the head. Your `_admit` does; here is the same situation
# through your scheduler (7 of 10 blocks held by someone else):

# %%
manager = MockKVCacheManager(num_blocks=10, block_size=4)
manager.allocate_slots(Request(id=99, prompt_tokens=[0] * 28, max_new_tokens=0), 28)  # someone else
scheduler = StallFreeScheduler(token_budget=64, max_batch_size=4, kv_cache_manager=manager)
big = Request(id=1, prompt_tokens=list(range(14)), max_new_tokens=4)
small = Request(id=2, prompt_tokens=list(range(6)), max_new_tokens=4)
enqueue(scheduler, big)
enqueue(scheduler, small)
batch = scheduler.schedule_next_batch()
print(
    "scheduled:",
    [s.request_id for s in batch],
    "| waiting:",
    [r.id for r in scheduler.waiting_queue],
    "| running:",
    list(scheduler.active_pool),
)

# %% [markdown]
# ### Spot the bug 3: a placeholder for the first decode
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
        executor.execute([seq])
except ValueError as error:
    print("Failing run:", error)

# %% [markdown]
# Even with a real first token, the lesson's position is off by one: the first output token belongs
# at position `len(prompt)` (positions start at 0), but `len(prompt) + len(outputs)` puts it one further.

# %%
executor = toy.ToyExecutor()
outputs = [executor.execute([ScheduledSequence(0, prompt, False, 0, samples_token=True)])[0]]
try:
    executor.execute([ScheduledSequence(0, [outputs[-1]], True, len(prompt) + len(outputs))])
except ValueError as error:
    print("Failing run:", error)

# %% [markdown]
# **The fix**: the chunk that completes the prompt samples the first output token, and every position
# starts at `num_computed_tokens`. Your scheduler, step by step, on the same prompt:

# %%
scheduler = StallFreeScheduler(64, 4, MockKVCacheManager(num_blocks=8, block_size=4))
request = Request(id=0, prompt_tokens=prompt, max_new_tokens=3)
enqueue(scheduler, request)
executor = toy.ToyExecutor(block_size=4)
while scheduler.has_unfinished_requests():
    batch = scheduler.schedule_next_batch()
    print(batch[0])
    sampled = executor.execute(batch, toy.block_tables_for(scheduler, batch))
    scheduler.update_from_output(batch, sampled)
print("outputs:", request.output_tokens, "| generated alone:", toy.toy_generate(prompt, 3))

# %% [markdown]
# ### Exercise 2.3: free blocks on completion
#
# When `update_from_output` appends a token and the request `is_complete()` (it has `max_new_tokens`
# tokens, or it sampled its end-of-sequence token), it calls `_finish(request)`. Fill it in: set the
# status to `FINISHED`, remove the request from `active_pool`, and give its blocks back with
# `self.kv_cache_manager.free(request)`. Without this, a finished request keeps its memory forever,
# and the cache fills with the dead.

# %%
check("2.3")

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
# ### Spot the bug 4: skipping is a deadlock
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

    def _allocate_or_preempt(self, request, num_new_tokens):
        return self.kv_cache_manager.allocate_slots(request, num_new_tokens) is not None


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
# ### Exercise 2.4: preempt by recompute
#
# vLLM's answer is **preemption by recompute**: pick a victim, free all its blocks, and put it back at
# the **head** of the waiting queue. Its generated tokens are kept; when it is admitted again, its
# prefill recomputes the K/V of the prompt *and* of those tokens (`all_token_ids`), and it continues
# exactly where it stopped. The victim is the **most recently admitted** running request: it has
# the least work to lose, and the oldest request always makes progress, so the run always ends.
#
# Fill in `StallFreeScheduler._preempt_most_recent`: the victim is the last request in
# `active_pool`. Remove it from the running set, `free` its blocks, set `num_computed_tokens` to 0
# (keep `output_tokens`), set its status to `PREEMPTED`, add one to its `num_preemptions` and to
# `self.num_preemptions`, `appendleft` it to the waiting queue, and return it.
# `_allocate_or_preempt` (written for you) calls it until the allocation succeeds, or until the
# victim is the requester itself, which then waits at the head of the queue.

# %%
check("2.4")

# %% [markdown]
# The same tight cache, with preemption:

# %%
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
# ### Spot the bug 5: it waits forever
#
# A cache of 12 blocks of 8 tokens holds 96 tokens. A request with a 100-token prompt can never fit,
# however long it waits. The source lesson would skip it every step, forever. With preemption it is
# worse: it is admitted (its first chunk fits), grows, preempts itself, and starts over, while the
# request behind it in the queue starves. Here it is, put in the queue with `enqueue`, which skips the
# check that Exercise 2.5 adds:


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
# ### Exercise 2.5: reject what can never fit
#
# At its longest, a request holds `len(prompt_tokens) + max_new_tokens` tokens. If the blocks for
# that many tokens (a partial block counts) are more than the **whole** cache (`num_blocks`), it can
# never finish. Fill in `StallFreeScheduler._reject_if_never_fits`, which `add_request` calls: in
# that case set the status to `REJECTED`, write a `reason` a user could read, and return `True`
# (`add_request` then lists it in `scheduler.rejected` instead of queueing it). Otherwise return
# `False`. A rejected request is settled: it is never silently dropped, and it never blocks others.

# %%
check("2.5")

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
#   keys and values live. They meet in a small contract: `allocate_slots` (all or nothing, `None` on
#   failure), `free`, `get_num_free_blocks`, `can_allocate`, plus the block tables for the executor.
# * **No token without memory.** Every scheduled token was allocated first; `num_computed_tokens`
#   advances with it, positions follow from it, and the chunk that reaches the end samples.
# * **Failure is policy too.** A failed allocation is not an error: a newcomer waits, a running
#   request preempts the most recently admitted one (recompute, nothing lost), and a request that
#   could never fit is rejected, with a reason, at once.
#
# In **03 · A paged KV-cache allocator** you replace the mock with the real thing: a free-block queue,
# a block pool and a `KVCacheManager` with one block table per request. Your scheduler will run on it
# unchanged.
