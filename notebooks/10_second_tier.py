# %% [markdown]
# # 10 · A second tier: spilling KV blocks to CPU memory and loading them back
#
# > **What to expect.** The outputs stored in this notebook come from the reference solutions; running a
# > cell replaces its output with your code's. Run All stops at your first unwritten exercise (its
# > `NotImplementedError`) and leaves the cells below it empty, so run the notebook cell by cell.
#
# Notebook 04 ended on a number: on one hour of Mooncake's chat traffic, a cache of 10 million tokens
# serves 30% of the prompt tokens from cache, and only tens of millions of tokens serve nearly all that
# could be reused. A GPU holds a few million. A server's **CPU memory** holds ten times more, and it is
# idle. When your pool evicts a block (exercise 4.4), its keys and values are still good: copy them to
# the CPU first, and when a later request asks for that prefix, copy them back instead of running the
# model over those tokens again.
#
# That is what vLLM's KV connectors do (`KVConnectorBase_V1`; its CPU offloading connector since
# 0.11.0; LMCache and Mooncake Store do the same with remote memory), and it is the scheduler–cache
# contract of notebook 02 once more, one level down:
#
# * the **cache side**: on eviction, a full, hashed block is *offered* to the tier; the tier has its own
#   capacity in blocks and its own LRU order;
# * the **scheduler side**: at admission, after the device's prefix hits, the scheduler asks the tier how
#   many more prompt tokens it holds (vLLM's `get_num_new_matched_tokens(request, num_computed_tokens)`),
#   allocates device blocks for them and tells the tier (`update_state_after_alloc`), which queues the
#   copies. The request then **waits in a status of its own**, `WAITING_FOR_REMOTE_KVS` as in vLLM, without
#   holding up the batch, and proceeds as a prefix hit once its blocks are in.
#
# ```
#  step N   scheduler: device hits 1 block, tier holds 2 more -> allocate 3 blocks, request WAITING_FOR_REMOTE_KVS
#           executor:  saves (device -> CPU) of blocks evicted this step, then loads (CPU -> device), then the model
#  step N+1 scheduler: the request counts 3 blocks computed and runs its next chunk, like any prefix hit
# ```
#
# The copies are real: the runner keeps a second `PagedKVCache` in CPU memory, of the same block shape,
# and copies keys and values of every layer between the two (`ModelRunner.transfer_blocks`). The tier is
# off unless you ask for it (`LLMEngine(..., num_cpu_tier_blocks=N)`), so every other notebook runs as
# before.

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

# %% [markdown]
# ## 1. The request
#
# `vllm/v1/request.py` · `Request` carries what yours carries: the prompt's and the output's token ids,
# `num_computed_tokens` (tokens whose K/V are in the cache), a `status` from `RequestStatus` (`WAITING`,
# `RUNNING`, `PREEMPTED`, then one of the `FINISHED_*` values: `FINISHED_STOPPED`,
# `FINISHED_LENGTH_CAPPED`, `FINISHED_ABORTED`, ...), `priority` and `arrival_time`. vLLM adds what its
# other features need: `block_hashes`, the request's hash chain kept on the request (yours lives in the
# manager, exercise 4.2), `spec_token_ids` for speculative decoding, `num_output_placeholders` for async
# scheduling, a LoRA adapter, multimodal inputs, a `cache_salt`, and waiting states of its own
# (`WAITING_FOR_REMOTE_KVS` while a connector loads K/V, `WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR`).
# %%
from kvcourse import answer, check

# %% [markdown]
# ## 1. The tier: what it keeps (exercise 8.1)
#
# `CPUOffloadTier` in `kvcourse/offload.py` keeps blocks by **hash** (the chain of exercise 4.1: a hash
# names the whole prefix up to its block) in an `OrderedDict`, least recently used first, each entry a
# `TierEntry(slot, token_ids)`: the CPU slot holding its K/V and its tokens (a lookup confirms them, as
# 4.3 does). The pool calls `offer(block)` from `_maybe_evict_cached_block`, while the block's K/V is
# still intact (it is overwritten only when the step runs). A stored block is one copy out, queued as
# `(device block, slot)` in `pending_saves`; the executor runs the step's saves before anything else.
#
# **The contract fixes**: never more than `num_blocks` entries, one entry per hash, one save per stored
# block, no second copy of a hash already held; a full tier makes room only by dropping its least
# recently used entry that is not **pinned**: a slot that a load planned this step reads (exercise 8.3)
# must not be overwritten before that load runs. **It leaves to you**: whether offering a hash the tier
# holds counts as a use (refreshes its recency), and whether a full tier drops its LRU entry or refuses
# the newcomer (vLLM's offloading manager evicts LRU; refusing keeps old prefixes, dropping keeps recent ones).

# %%
check("8.1")

# %% [markdown]
# ## 2. Asking the tier (exercise 8.2) and queuing the loads (exercise 8.3)
#
# `get_num_new_matched_tokens(request, num_computed_tokens)` is 4.3's lookup one tier down: it starts
# where the device's hits stop and counts the request's full blocks the tier holds, stopping at the
# first miss; the block holding the prompt's last token never counts (its logits give the next token).
# It changes nothing: between asking and allocating, the scheduler may still refuse the request.
#
# `update_state_after_alloc(request, blocks, num_external_tokens)` runs once device blocks are
# allocated for those tokens. The allocation itself may have evicted device blocks into the tier and
# pushed some of the wanted ones out: a load can **fail**. So the tier looks each block up again, queues
# `(slot, device block)` loads for the unbroken run still there, pins their slots and promotes them to
# most recently used (a hit is a use), and returns the tokens that will really load. The rest of the
# prompt is recomputed: nothing is lost, only time.

# %%
check("8.2")
check("8.3")

# %% [markdown]
# ## 3. The scheduler's side (exercises 8.4 and 8.5)
#
# In `SecondTierScheduling` (mixed into your `StallFreeScheduler`), `_start_load` runs at admission
# before 2.2 does: device hits, then the tier, then **one** `allocate_slots` for the hits and the tier's
# tokens. Granted, the request leaves the waiting queue for `self.loading`, in `WAITING_FOR_REMOTE_KVS`,
# and it takes **no token of the step's budget**: a copy is not a forward pass. The requests behind it
# are admitted in the same step. Blocks that will not load (the tier lost them) are unpublished from the
# device's prefix cache (`forget_unwritten_tail`), since no one will write them this step.
#
# Next step, the given `collect_finished_loads` puts it back at the head of the queue, counting hits
# plus loaded tokens as computed, and `_admit_loaded` runs it like a swapped-in request (7.3): only its
# next chunk needs memory. A loaded request that is still not admitted at the end of that step gives its
# blocks back: they stay cached on the device, so its next try hits them there (and a request holding
# blocks while it waits could otherwise deadlock the cache).

# %%
check("8.4")
check("8.5")

# %% [markdown]
# ## 4. Blocks moving between the tiers
#
# A tiny GPT-2 (random weights: we look at blocks and token ids, never at its text) with a device cache
# of 12 blocks of 4 tokens and a CPU tier of 32 blocks. Four rounds: six prompts sharing a 21-token
# prefix, five others, the six again (their prefix was evicted from the device meanwhile), then a mix.
# Each row pair below is a step that moved blocks: orange outlines are saves, blue ones loads.

# %%
import random

from kvcourse.engine.llm_engine import LLMEngine
from kvcourse.models.gpt2 import load_gpt2
from kvcourse.viz.tier import record_tier_run

rng = random.Random(40)


def prompts(count, lo, hi, prefix=()):
    return [list(prefix) + [rng.randrange(1000) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


prefix = prompts(1, 21, 21)[0]
shared, other = prompts(6, 1, 9, prefix), prompts(5, 10, 30)
rounds = [shared, other, shared, other[:3] + shared[:3]]
tiny = load_gpt2("tiny", verbose=False)
knobs = dict(num_blocks=12, block_size=4, token_budget=24, max_batch_size=6, enable_prefix_caching=True)
engine = LLMEngine(tiny, **knobs, num_cpu_tier_blocks=32)
frames = record_tier_run(engine, rounds, max_new_tokens=5)
print(
    frames,
    "·",
    engine.tier.stats.saved,
    "saved,",
    engine.tier.stats.dropped,
    "dropped,",
    engine.tier.stats.failed,
    "failed",
)
frames

# %% [markdown]
# **The same tokens.** Loading a block must give exactly the keys and values recomputing it would:
# greedy outputs with the tier on and off are identical, under preemption too (the cache is tight).


# %%
def run(tier_blocks):
    engine = LLMEngine(tiny, **knobs, num_cpu_tier_blocks=tier_blocks)
    return [engine.generate(p, 5, progress=False) for p in rounds], engine


off, _ = run(0)
on, engine_on = run(32)
small, engine_small = run(3)
print("tier on == off:", on == off, "| blocks loaded:", engine_on.tier.stats.loaded)
print("3-block tier == off:", small == off, "| loads that fell short (recomputed):", engine_small.tier.stats.failed)

# %% [markdown]
# ## 5. When is loading cheaper than recomputing?
#
# A load costs the copy: the block's bytes (every layer's keys and values) over the link between the
# two memories, plus a fixed cost per transfer. A recompute costs a forward pass over those tokens. Both
# measured here, on your machine, with GPT-2 small's shapes (random weights if the Hub is unreachable:
# the same bytes and the same arithmetic). On a CPU-only machine both "memories" are host RAM, so the
# copy is a memory copy; on a GPU it crosses PCIe, tens of GB/s.

# %% tags=["nbval-ignore-output"]
# (timings: they differ between machines and runs; nbval reads the marker only on a line of its own)
from kvcourse.bench.offload import copy_bandwidth, load_or_recompute, prefill_tokens_per_s

gpt2 = load_gpt2("gpt2", verbose=False)
cost = copy_bandwidth(gpt2, num_blocks=32, block_size=16)
speed = prefill_tokens_per_s(gpt2, prompt_len=256)
print(
    f"one block of 16 tokens: {cost.bytes_per_block / 1e3:.0f} kB; copy out {cost.save_bytes_per_s / 1e9:.2f} GB/s, "
    f"back {cost.load_bytes_per_s / 1e9:.2f} GB/s ({cost.device}); prefill {speed:,.0f} tokens/s"
)
for row in load_or_recompute(cost, speed, block_size=16, lengths=(16, 64, 256, 1024)):
    print(
        f"{row['tokens']:>5} tokens: load {row['load_s'] * 1e3:8.3f} ms, recompute {row['recompute_s'] * 1e3:8.3f} ms"
        f" -> {'load' if row['load_wins'] else 'recompute'}"
    )

# %% [markdown]
# GPT-2 small keeps about 74 kB of K/V per token in float32 (2 × 12 layers × 768 × 4 bytes), and
# recomputing a token costs about 2 × 124 million multiply-adds: at any realistic bandwidth the copy wins
# from the first block on, by two orders of magnitude. What a load does cost is **waiting**: the request
# sits out one step, and the tier's memory must hold the bytes. The break-even moves only when the link
# is slow (a remote store over a network) or the model is tiny.
#
# ## 6. Mooncake with two tiers
#
# Before you look, **predict**: on the chat trace, a 10-million-token device cache serves 30% of prompt
# tokens. Add a 50-million-token CPU tier: the hit rate becomes (a) under 0.32, (b) 0.32 to 0.36, (c) over
# 0.36?

# %%
answer("10.a", None)

# %% [markdown]
# The replay is notebook 04's (`kvcourse.bench.trace.replay`, request order only, no model), with your
# tier wired to your cache (`tier_blocks=`). Two sanity checks you can see: with no tier the replay is
# exactly 4.7's, 0.2976 at 10 million tokens; and since a hit in the tier moves the block back to the
# device (promoted), two tiers behave like one cache of their combined size. The grid of sizes is stored
# in `notebooks/data/two_tier_mooncake.json` (`python -m kvcourse.bench.offload` redoes it in about a
# minute).

# %% collapsed=true jupyter={"outputs_hidden": true} tags=["hide-output"]
from kvcourse.bench.offload import stored
from kvcourse.bench.trace import capacity_blocks, replay, trace_requests
from kvcourse.bench.traces import load_trace

chat = load_trace("conversation")
chat_requests = trace_requests(chat)
device_only = replay(chat, chat_requests, capacity_blocks(10**7))
two_tiers = replay(chat, chat_requests, capacity_blocks(10**7), tier_blocks=capacity_blocks(5 * 10**7))
one_cache = replay(chat, chat_requests, capacity_blocks(6 * 10**7))
print(f"device 1e7 alone:          {device_only.hit_rate:.4f}  (exercise 4.7: 0.2976)")
print(
    f"device 1e7 + CPU tier 5e7: {two_tiers.hit_rate:.4f}  ({two_tiers.tier_hit_tokens / two_tiers.prompt_tokens:.4f} from the tier)"
)
print(f"one cache of 6e7:          {one_cache.hit_rate:.4f}")

# %%
# Figure: the two-tier prefix hit rate on Mooncake's chat trace against the CPU tier's size, one line per device cache size.
import matplotlib.pyplot as plt

study = stored()
fig, ax = plt.subplots(figsize=(7, 4))
for device in sorted({row["device_tokens"] for row in study["rows"]}):
    rows = [row for row in study["rows"] if row["device_tokens"] == device]
    ax.plot(
        [row["tier_tokens"] / 1e6 for row in rows],
        [row["hit_rate"] for row in rows],
        marker="o",
        label=f"device {device / 1e6:g}M tokens",
    )
ax.axhline(study["single_cache_6e7_hit_rate"], color="grey", ls="--", lw=1, label="one 60M-token cache")
ax.set_xlabel("CPU tier (million tokens)")
ax.set_ylabel("prefix hit rate (prompt tokens)")
ax.set_title("Mooncake chat trace: a CPU tier behind the device cache")
ax.legend()
plt.show()
for row in study["rows"]:
    print(
        f"device {row['device_tokens'] / 1e6:>4g}M + tier {row['tier_tokens'] / 1e6:>3g}M: hit rate {row['hit_rate']:.4f}, "
        f"{row['prefill_tokens_saved'] / 1e6:,.1f}M prefill tokens saved of {row['prompt_tokens'] / 1e6:,.1f}M"
    )

# %% [markdown]
# A 1-million-token device (about one GPU) with a 10-million-token tier does better than a device of 10
# million alone; with 50 million in the tier, the device's own size hardly matters any more. The tier
# turns cheap, plentiful memory into hits.
#
# **The TTFT a real run saves.** A slice of the trace (120 requests, each trace block standing for 16
# tokens, prompts cut to 12 blocks), one request at a time through the engine with a small device cache,
# tier off and on. The model is the tiny GPT-2, on this CPU: the times are this machine's, and on a busy
# machine their difference is mostly noise; the exact measure is the prompt tokens the model was fed. In
# so short a slice few turns come back after the device forgot them (the trace's reuse is mostly minutes
# apart), so expect a small gain: the replay above is where the tier's worth shows.

# %% tags=["nbval-ignore-output"]
# (timings)
from kvcourse.bench.offload import ttft_slice

slice_run = ttft_slice(tiny)
for label in ("off", "on"):
    part = slice_run[label]
    print(
        f"tier {label:>3}: total TTFT {part['ttft_total_s']:.2f} s, {part['prompt_tokens_computed']:,} tokens fed, "
        f"{part['blocks_loaded']} blocks loaded"
    )

# %% [markdown]
# ## What you built
#
# * On eviction, a full, hashed block goes to a CPU tier with its own capacity and LRU order; its K/V is
#   copied out before the step overwrites it (saves first, then loads, then the model).
# * At admission the scheduler asks the tier for more of the prompt after the device's hits, allocates
#   once for both, and the request waits in `WAITING_FOR_REMOTE_KVS` without holding up the batch or
#   spending budget; then it proceeds as a prefix hit.
# * A load that falls short (the tier lost a block meanwhile) recomputes the rest: the same tokens.
# * Loading beats recomputing by orders of magnitude per block; on Mooncake's chat hour, a CPU tier
#   behind a small device cache brings it close to a cache of their combined size.
#
# In vLLM: `vllm/distributed/kv_transfer/kv_connector/v1/base.py` · `KVConnectorBase_V1`
# (`get_num_new_matched_tokens`, `update_state_after_alloc`, and on the worker `start_load_kv`,
# `save_kv_layer`), `vllm/v1/request.py` · `RequestStatus.WAITING_FOR_REMOTE_KVS`, and the CPU
# offloading connector (`vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py` ·
# `OffloadingConnector`, over `vllm/v1/kv_offload/cpu/manager.py` · `CPUOffloadingManager` with an LRU
# policy, `vllm/v1/kv_offload/cpu/policies/lru.py` · `LRUCachePolicy`). vLLM's `get_num_new_matched_tokens`
# returns a pair: the tokens, and whether the load is asynchronous (yours always is). Its loads may take
# several steps and go layer by layer; yours complete within the step that plans them.
