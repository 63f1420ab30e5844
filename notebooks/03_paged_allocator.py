# %% [markdown]
# # 03 · A paged KV-cache allocator
#
# > **What to expect.** The outputs stored in this notebook come from the reference solutions; running a
# > cell replaces its output with your code's. Run All stops at your first unwritten exercise (its
# > `NotImplementedError`) and leaves the cells below it empty, so run the notebook cell by cell.
#
# In notebook 02 the scheduler learned to *ask* for KV memory before it schedules a token, and a
# `MockKVCacheManager` answered by counting blocks. Here you open the black box and build the real
# thing, the way vLLM v1 does it:
#
# | layer | its one job | exercise |
# |---|---|---|
# | `FreeKVCacheBlockQueue` | the free blocks, in the order they will be reused: a doubly linked list | 3.1 |
# | `BlockPool` | owns every `KVCacheBlock`; hands blocks out, takes them back, adds holders | 3.2 |
# | `KVCacheManager` | what the scheduler talks to: one **block table** per request, all-or-nothing `allocate_slots` | 3.3, 3.4 |
#
# Then you watch your allocator serve the source lesson's four prompts and a larger random workload in
# a block-table widget, and you check that handing out a block costs the same whether the pool has a
# thousand blocks or a million.
#
# Every exercise lives in `kvcourse/kv_cache.py`. After each one, run its `check(...)` cell;
# each function's comment states its **contract** (what must hold when it returns), not the lines to write.
# `hint("3.1")` gives a nudge, `hint("3.1", level=2)` the approach in words, and `solution("3.1")` the
# reference code if you are stuck.

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
import random

import matplotlib.pyplot as plt

from kvcourse import answer, check, toy
from kvcourse.core.request import Request
from kvcourse.kv_cache import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock, KVCacheManager
from kvcourse.models.gpt2 import LESSON_PROMPTS, load_tokenizer
from kvcourse.scheduler import StallFreeScheduler
from kvcourse.viz import diagrams
from kvcourse.viz.widgets import BlockTableWidget, record_run

# %% [markdown]
# ## 1. Why fixed-size blocks?
#
# A request's KV cache grows by one token per decode step, and nobody knows in advance how long it
# will get. The obvious allocator gives each request **one contiguous region**, big enough for the
# longest it could ever become (`prompt + max_new_tokens` tokens), reserved when it is admitted.
# That wastes memory in two ways:
#
# * **Internal fragmentation**: reserved slots that the request never writes (it stops early, or
#   simply has not got there yet). They belong to it, so nobody else can use them.
# * **External fragmentation**: when requests finish at different times, the free memory is split into
#   holes. A newcomer that needs 20 contiguous slots waits even when 32 slots are free, because no
#   *single* hole is big enough.
#
# **Paging** removes both, as virtual memory does for processes. Cut the cache into fixed-size
# **blocks** of `block_size` tokens; any free block can hold any request's next tokens, so there are no
# holes to fit into; and a request takes a new block only when its last one is full, so it wastes at
# most `block_size - 1` slots, in its last block. The price is one indirection: each request keeps a
# **block table** that maps its *logical* block `i` (tokens `i*block_size` to `(i+1)*block_size - 1`)
# to a *physical* block anywhere in the pool. The vLLM paper measured existing systems keeping only
# 20–38% of their KV memory for actual token states, and vLLM itself 96.3% (its Fig. 2: measured, not a
# goal).

# %%
# Figure: The same requests' KV memory reserved contiguously against in blocks: paging wastes at most a block's tail per request.
BLOCK = 4  # tokens per block when paged
WRITTEN = {"A": 9, "C": 5, "D": 18}  # tokens each request has written when D arrives
diagrams.fragmentation(WRITTEN, block_size=BLOCK)

# %%
written = sum(WRITTEN[n] for n in "AC")
reserved = 20 + 12
print(f"contiguous: A and C reserve {reserved} slots for {written} written tokens: {1 - written / reserved:.0%} wasted")
print(
    f"paged:      A and C hold {5 * BLOCK} slots for the same {written} tokens: {1 - written / (5 * BLOCK):.0%} wasted"
)
print(f"paged:      the most a request can ever waste is block_size - 1 = {BLOCK - 1} slots")


# %% [markdown]
# ## 2. The free-block queue (exercise 3.1)
#
# The pool must answer three questions fast, whatever its size:
#
# * *give me a free block*: take the one that has been free the longest (the front);
# * *this block is free again*: put it at the back, so it is reused last (lesson 04 will keep the
#   contents of free blocks around as a cache, and the longest-free block is the least useful one);
#   the queue's `append` does exactly that, and the course's pool frees every block this way (below: what
#   vLLM does differently);
# * *this free block is wanted after all*: take it out **from the middle** (in lesson 04 a
#   prefix-cache hit revives a free block that still holds the right tokens).
#
# A Python list does the third in O(n) (`list.remove` scans), and `pop(0)` is O(n) too; a `deque`
# cannot remove from the middle cheaply either. vLLM's answer is a **doubly linked list** threaded
# through the blocks themselves: each `KVCacheBlock` has `prev_free_block` and `next_free_block`
# pointers, and two sentinel blocks (`fake_head`, `fake_tail` here; `fake_free_list_head` and
# `fake_free_list_tail` in `vllm/v1/core/kv_cache_utils.py` · `FreeKVCacheBlockQueue`) mean an empty
# list needs no special case. Unlinking a block rewires its two neighbours: O(1), no scan.

# %%
# Figure: Removing a block from the doubly linked free queue: its two neighbours are rewired, in O(1), without a scan.
diagrams.free_queue_remove()

# %% [markdown]
# ### Exercise 3.1: a doubly linked free-block queue
#
# In `kvcourse/kv_cache.py`, fill in `FreeKVCacheBlockQueue.popleft`, `append` and `remove`. The
# contract: each runs in O(1) (no walk), keeps the order of every other block in both directions, and
# keeps `num_free_blocks` equal to the blocks in the queue; a block's pointers are `None` exactly
# when it is not in the queue. The constructor and `get_all_free_blocks` are written for you; read
# them first. `check("3.1")` counts the block pointers each operation reads in a queue of thousands of
# blocks: a walk cannot pass for O(1).
#
# The cell below takes block 0 from the front, revives block 3 from the middle, and frees block 0
# again: print the queue and check it against what you expect.

# %%
blocks = [KVCacheBlock(block_id=i) for i in range(5)]
queue = FreeKVCacheBlockQueue(blocks)
first = queue.popleft()  # block 0: free the longest
queue.remove(blocks[3])  # taken from the middle (a prefix-cache hit, next lesson)
queue.append(first)  # block 0 is free again: it goes to the back
print("handed out first:", first.block_id)
print("free, front to back:", [b.block_id for b in queue.get_all_free_blocks()], "| count:", len(queue))

# %%
check("3.1")

# %% [markdown]
# ## 3. The block pool (exercise 3.2)
#
# `BlockPool` owns every `KVCacheBlock` (`pool.blocks[i]` is block `i`) and the free queue. Each block
# carries a **reference count** `ref_cnt`: how many block tables hold it. In this lesson that is 0 or 1;
# in lesson 04 several requests share one block and it climbs higher. A block goes back to the free
# queue only when its last holder lets go.
#
# ### Exercise 3.2: hand blocks out, take them back, share them
#
# Fill in three methods of `BlockPool`; their comments give the contracts:
#
# * `get_new_blocks(n)`: the `n` blocks at the front of the queue, each with one holder. A free block
#   may still carry an old prefix-cache entry (lesson 04), so every block handed out goes through
#   `_maybe_evict_cached_block` first (it does nothing yet);
# * `free_blocks(blocks)`: one holder less each; a block nobody holds joins the back of the queue (the
#   course's choice, one rule for every block; vLLM's rule is in the box below);
# * `touch(blocks)`: one holder more each, and a block that was free leaves the queue (lesson 04: a
#   prefix hit, or a fork, shares a block).
#
# Asking for more blocks than are free, or freeing a block more often than it is held, is a bug in the
# caller: the pool raises a `ValueError` that says so (already written for you).
#
# > **vLLM does it in two places.** `vllm/v1/core/block_pool.py` · `BlockPool.free_blocks` sorts the
# > blocks nobody holds any more by whether they carry a prefix hash: blocks **without** a hash (a
# > partly filled last block, or any block when prefix caching is off) go to the **front** of the queue
# > (`prepend_n`), to be reused first, while their memory is still warm in the GPU's caches; blocks
# > **with** a hash go to the **back** (`append_n`), in the order given, so the prefix cache evicts the
# > least recently used first. Here, where nothing is hashed until lesson 04, vLLM would put every freed
# > block at the front. The course keeps one rule (everything to the back) because it makes the queue's
# > order easy to predict in the widget and leaves lesson 04's eviction order the same; the graded tests
# > check the course's rule.

# %%
pool = BlockPool(num_blocks=8)
a = pool.get_new_blocks(3)
b = pool.get_new_blocks(2)
print(
    "a got",
    [blk.block_id for blk in a],
    "| b got",
    [blk.block_id for blk in b],
    f"| free {pool.get_num_free_blocks()} | usage {pool.usage:.1%}",
)
pool.free_blocks(reversed(a))  # a finished: its blocks go back, tail first
print("free queue, front to back:", [blk.block_id for blk in pool.free_block_queue.get_all_free_blocks()])
try:
    pool.free_blocks(a)  # freeing the same blocks again would corrupt the queue
except ValueError as error:
    print("ValueError:", error)

# %%
check("3.2")

# %% [markdown]
# ## 4. The manager: block tables (exercises 3.3 and 3.4)
#
# `KVCacheManager` is what the scheduler talks to, with the contract of notebook 02. It keeps one block
# table per request (`req_to_blocks[request.id]`, a list of blocks in logical order) and gets blocks
# from the pool.
#
# **The arithmetic.** After this step the request will hold `num_computed_tokens + num_new_tokens`
# tokens; they fill `ceil(tokens / block_size)` blocks, and it already holds some. So it needs
#
#     new blocks = ceil((num_computed_tokens + num_new_tokens) / block_size) - blocks held
#
# (never below 0). This is the exact count that the source lesson's mock "simplified" away.
#
# **All or nothing.** If the pool has fewer free blocks than the step needs, `allocate_slots` returns
# `None` and changes *nothing*: the scheduler relies on a failed call leaving no trace (it will preempt
# someone and try again).
#
# ### Exercise 3.3: `KVCacheManager.allocate_slots`
#
# This is the heart of the manager, and you write all of it: `_num_new_blocks` (the count, or `None`
# when the pool is short), `can_allocate` and `allocate_slots` itself. Its comment states the contract in full. In
# short: the request's table ends up covering `num_computed_tokens + num_new_computed_tokens +
# num_new_tokens` tokens, starting with the prefix-cache hits it was given (`new_computed_blocks`,
# lesson 04: each gains a holder), and the call returns the blocks it took from the pool; or, when the
# free blocks are too few for *everything* the step takes, it returns `None` and nothing has changed.
# A call is an **admission** when the manager holds no table for the request yet (a new request, or one
# freed since): even a call for 0 tokens creates the table, so the calls after it are not admissions.
# Each admission is counted once, for the prefix-cache statistics.
# The exercise holds three functions of `KVCacheManager`: `_num_new_blocks`, `can_allocate` (whether
# `allocate_slots` would succeed right now, changing nothing: the same count, asked without committing)
# and `allocate_slots`. Two things only lesson 04 makes real are already in the contract, so that you write the function
# once: a hit on a *free* block uses up a free block too, and a block shared with another table must be
# copied before it is written (`_shared_blocks_to_write` and `_copy_on_write` find and make the copies;
# until lesson 04 nothing is shared and they return `[]`). The graded tests hand your function prefix
# hits and shared blocks directly, with their own versions of lesson 04's methods, so they need nothing
# from lesson 04. After every call they make, they check what a slip breaks first: no block twice in a
# table, each block's `ref_cnt` equal to the number of tables holding it, the free queue holding exactly
# the blocks nobody holds. And they run 16 requests sharing 3 prompts through your manager under tight
# memory (prefix hits, preemption): the tokens must equal a run with all the memory in the world.
#
# Before you run the cell below, **predict**: a request holds 10 computed tokens in blocks of 4. How
# many of its next 6 decode steps take a new block from the pool?

# %%
answer("3.a", None)

# %% collapsed=true jupyter={"outputs_hidden": true} tags=["hide-output"]
manager = KVCacheManager(num_blocks=6, block_size=4)
request = Request(id=0, prompt_tokens=list(range(10)), max_new_tokens=6)
new = manager.allocate_slots(request, 10)  # prefill: ceil(10 / 4) = 3 blocks
request.num_computed_tokens = 10  # (the scheduler counts a chunk once it is scheduled)
print(f"prefill 10 tokens   -> new blocks {new.get_block_ids()}, table {manager.get_block_ids(request)}")
for _ in range(6):
    new = manager.allocate_slots(request, 1)  # one decode token
    request.num_computed_tokens += 1
    print(
        f"decode to {request.num_computed_tokens} tokens -> new blocks {new.get_block_ids()}, "
        f"table {manager.get_block_ids(request)}"
    )
big = Request(id=1, prompt_tokens=list(range(20)), max_new_tokens=1)
free_before = manager.get_num_free_blocks()
print(
    f"20 tokens need 5 blocks, {free_before} are free ->",
    manager.allocate_slots(big, 20),
    f"| free after: {manager.get_num_free_blocks()}, table {manager.get_block_ids(big)}",
)

# %%
check("3.3")

# %% [markdown]
# ### Exercise 3.4: `KVCacheManager.free`
#
# When a request finishes (or is preempted) the scheduler calls `free(request)`. Remove its table and
# give its blocks to the pool **in reverse order**, tail first. Reverse, because the freed blocks
# join the back of the queue in that order, so the request's *tail* will be reused before its *head*.
# vLLM frees in the same reverse order (`vllm/v1/core/single_type_kv_cache_manager.py` ·
# `SingleTypeKVCacheManager.free`, which `KVCacheManager.free` reaches through the coordinator); its pool
# then puts the unhashed ones (here: all of them) at the front in that order, so there too the tail is
# reused first.
# Today that makes no difference; in lesson 04 the head of a finished request (say, a shared system
# prompt) is exactly what the next request wants to find still cached.
#
# Freeing a request the manager does not know (or already freed) does nothing: a finished request may
# be freed twice without harm.

# %%
manager.free(request)
print("free blocks:", manager.get_num_free_blocks(), "| table now:", manager.get_block_ids(request))
print("free queue, front to back:", [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()])
manager.free(request)  # a second free is a no-op
print("after a second free:", manager.get_num_free_blocks(), "free")

# %%
check("3.4")

# %% [markdown]
# ## 5. Your allocator under notebook 02's scheduler
#
# The scheduler you wrote in notebook 02 only speaks the contract (`allocate_slots`, `free`,
# `get_computed_blocks`, `num_blocks`, `block_size`), so your `KVCacheManager` drops in where the
# mock was, unchanged. Here are the source lesson's four prompts, tokenized with GPT-2's real
# tokenizer, served with 5 new tokens each from a deliberately small cache: **20 blocks of 4 tokens**
# (80 token slots, while the four requests reach 97 tokens at their longest) and a budget of 32 tokens per step. The toy executor stands in
# for the model (its "next token" is a hash of the whole context, so a wrong position or a lost token
# would change the outputs).

# %%
tokenizer = load_tokenizer()
lesson_tokens = [tokenizer.encode(prompt) for prompt in LESSON_PROMPTS]
print("prompt lengths (GPT-2 tokens):", [len(tokens) for tokens in lesson_tokens])

manager = KVCacheManager(num_blocks=20, block_size=4)
scheduler = StallFreeScheduler(token_budget=32, max_batch_size=4, kv_cache_manager=manager)
for i, tokens in enumerate(lesson_tokens):
    scheduler.add_request(Request(id=i, prompt_tokens=tokens, max_new_tokens=5))
lesson_snapshots, trace = record_run(scheduler, toy.ToyExecutor(vocab_size=len(tokenizer)))
print(trace.format())
print(
    f"{len(trace.steps)} steps, {trace.num_preemptions} preemption(s), "
    f"all {manager.num_blocks} blocks free at the end: {manager.get_num_free_blocks() == manager.num_blocks}"
)

# %% [markdown]
# `record_run` called the widget's recorder after every step; each snapshot is plain data (who holds
# which block, how full it is). Drag the slider, press ▶, or step with the buttons. Watch for:
#
# * **blocks are not contiguous**: a request's table points wherever the free queue's front was;
# * **the bar in a block** is how many of its `block_size` slots hold K/V; only each request's last
#   block is partly empty (that is all the internal fragmentation left);
# * **preemption**: in iteration 3, after the decodes took their blocks, R3's second prefill chunk
#   needs 4 more blocks and only 2 are free. R3 is the most recently admitted request, so it is the
#   one preempted: it gives its 4 blocks back and waits at the head of the queue. Once R0 and R1
#   finish, it is admitted again and recomputes its prompt into *different* blocks.
#
# The widget opens on the step with the highest usage. Without a running kernel (on GitHub, say) you
# see that step as a static picture.

# %%
peak = max(range(len(lesson_snapshots)), key=lambda i: lesson_snapshots[i].usage)
BlockTableWidget(lesson_snapshots, step=peak)

# %% [markdown]
# ### A larger random workload
#
# Forty requests with random prompt lengths (8 to 60 tokens) and output lengths (4 to 24), seeded so
# the run is the same every time, through a 48-block cache with blocks of 8 tokens: tight enough that the scheduler must preempt.

# %%
rng = random.Random(3)
prompt_lengths = [rng.randint(8, 60) for _ in range(40)]
output_lengths = [rng.randint(4, 24) for _ in range(40)]
workload = toy.toy_requests(prompt_lengths, output_lengths, seed=3)

big_manager = KVCacheManager(num_blocks=48, block_size=8)
big_scheduler = StallFreeScheduler(token_budget=64, max_batch_size=8, kv_cache_manager=big_manager)
for request in workload:
    big_scheduler.add_request(request)
big_snapshots, big_trace = record_run(big_scheduler)

tokens_held = sum(len(r.prompt_tokens) + len(r.output_tokens) for r in workload)
print(f"{len(workload)} requests, {tokens_held} tokens of prompts and outputs")
print(
    f"{len(big_trace.steps)} steps, {big_trace.num_preemptions} preemptions, "
    f"peak usage {max(s.usage for s in big_snapshots):.1%}"
)
print(
    "outputs equal the unconstrained toy model's:",
    all(r.output_tokens == toy.toy_generate(r.prompt_tokens, r.max_new_tokens) for r in workload),
)
print("every block back in the pool:", big_manager.get_num_free_blocks() == big_manager.num_blocks)

# %%
busiest = max(range(len(big_snapshots)), key=lambda i: (big_snapshots[i].usage, len(big_snapshots[i].block_tables)))
BlockTableWidget(big_snapshots, step=busiest, interval_ms=300)

# %% [markdown]
# ## 6. Allocation in O(1)
#
# An allocator runs in the scheduler's loop, every step, for every request: it must not slow down as
# the cache grows. Yours does a constant amount of work per block: pop the front of a linked list,
# bump a counter. A naive allocator that scans a list of "is this block free?" flags does work
# proportional to the pool's size. But O(1) allocation alone does not need a linked list: a plain
# **stack** of free block ids (`list.pop()` to allocate, `list.append()` to free) is O(1) too, and
# simpler. What the linked list buys is the third operation of section 2: taking a block out of the
# **middle** of the free list (a prefix-cache hit on a free block, lesson 04) while every other free
# block keeps its place in LRU order. A stack must search for the block (`list.remove`), and it reuses
# the most recently freed block first, the cached prefix most likely to be wanted again.
#
# `kvcourse.bench.allocator` measures, side by side in one run, from 1,000 to 1,000,000 blocks:
# (1) allocate + free in a busy pool (all but 64 blocks held; allocate 16 blocks, free them) for your
# pool, the stack and the naive scan; (2) a prefix hit on a free block in the middle of the list, for
# your pool and the stack. It is the same study as `python -m kvcourse.bench allocator`, and it
# measures *your* `kvcourse/kv_cache.py`. Timings depend on the machine; the *shape* is the lesson.
# It first counts the pointers each queue operation reads: a queue that walks is timed at the small
# sizes only (a million-block walk takes minutes), and the study says it does not meet the goal.
#
# Before you run it, **predict** workload (2): as the pool grows from a thousand to a million blocks,
# whose cost per hit grows? (a) both, (b) only the stack's, (c) only the linked list's, (d) neither.

# %%
answer("3.b", None)

# %% collapsed=true jupyter={"outputs_hidden": true} tags=["nbval-ignore-output", "hide-output"]
# Figure: Allocator cost per block as the pool grows from a thousand to a million blocks: the paged pool against the baselines.
import contextlib
import io

from kvcourse.bench.allocator import report
from kvcourse.bench.allocator import run as allocator_benchmark

with contextlib.redirect_stderr(io.StringIO()):  # no progress bars in the notebook
    result = allocator_benchmark(quick=True)
print(report(result))

sizes = [int(n) for n in result["per_block_us"]]
fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.6))
left.plot(sizes, list(result["per_block_us"].values()), "o-", label="paged pool (your free-block queue)")
left.plot(sizes, list(result["stack_per_block_us"].values()), "^-", label="stack: a list of free ids")
left.plot(sizes, list(result["naive_per_block_us"].values()), "s--", label="naive: scan a list of free flags")
left.set_ylabel("µs per block")
left.set_title(f"(1) allocate + free: paged ×{result['ratio']:.2f}, stack ×{result['stack_ratio']:.2f}", fontsize=10)
right.plot(sizes, list(result["hit_linked_us"].values()), "o-", label="linked list: unlink in O(1)")
right.plot(sizes, list(result["hit_stack_us"].values()), "^-", label="stack: list.remove searches")
right.set_title(
    f"(2) prefix hit on a free block: linked ×{result['hit_linked_ratio']:.2f}, stack ×{result['hit_stack_ratio']:.0f}",
    fontsize=10,
)
for ax in (left, right):
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("blocks in the pool")
    ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## What you built, and what comes next
#
# * Fixed-size blocks and a block table per request end external fragmentation and bound internal
#   fragmentation by one partly filled block per request.
# * The free-block queue is a doubly linked list through the blocks, so taking, returning and reviving
#   a block are O(1): allocation cost does not grow with the cache. A stack allocates in O(1) too; only
#   the linked list also takes a block out of the middle in O(1) and keeps the rest in LRU order.
# * `allocate_slots` is exact and all or nothing, so the scheduler's preemption logic from notebook 02
#   works unchanged on real memory.
#
# In **04 · Sharing blocks** the reference count earns its keep: requests with the same prefix share
# physical blocks, freed blocks stay findable as a cache, and parallel samples fork a sequence without
# copying it.
