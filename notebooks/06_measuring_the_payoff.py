# %% [markdown]
# # 06 · Measuring the payoff
#
# > **What to expect.** The outputs stored in this notebook come from the reference solutions; running a
# > cell replaces its output with your code's. A study stops at the first exercise of yours still
# > unwritten (its `NotImplementedError`), and Run All stops there too, so run the notebook cell by cell.
#
# Five notebooks built the memory side of a serving engine: a scheduler that asks before it schedules,
# a paged allocator, shared blocks, and attention that reads through a block table. This one asks what
# it all buys, with numbers measured here, on this machine, in this run:
#
# 1. **Memory waste**: how much of the KV memory an engine reserves actually holds token states,
#    after Fig. 2 of the vLLM paper (Kwon et al., SOSP '23).
# 2. **Throughput**: the same requests through Hugging Face `generate`, through transformers' own
#    continuous batching, and through our `LLMEngine`.
# 3. **Kernel bandwidth**: decode attention is memory-bound; how close to the memory system's speed
#    does each implementation get?
# 4. **Block size**: the one knob the paged design adds, and what it trades.
#
# Nothing to fill in here, but three times you are asked to **predict** before the cell that shows the
# answer: `answer("6.a", None)` says what is asked; replace `None` with your guess and run it (it is
# graded on the scoreboard, beside the exercises). Every study is a command you can also run from a terminal,
# `python -m kvcourse.bench {memory,throughput,kernel} [--quick] [--json]`, whose last line is one JSON
# object with every figure and the device it ran on. The studies measure your `kvcourse` modules; to
# measure the reference in `solutions/` instead, pass `reference=True` to a study's `run(...)` (or
# `--reference` on the command line): it then runs in a separate process, and this kernel's modules and
# environment stay as they are. (The stored outputs were made with `KVCOURSE_SOLUTIONS=1`.)

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
import json
from pathlib import Path

import matplotlib.pyplot as plt

from kvcourse import answer
from kvcourse.bench import kernel, throughput
from kvcourse.bench import waste as memory

# %% [markdown]
# ## 1. Memory waste, after the paper's Fig. 2
#
# **The workload.** One seeded trace of requests whose prompt and output lengths are drawn from
# long-tailed log-normal distributions shaped like ShareGPT's (conversations people shared from
# ChatGPT, one of the vLLM paper's workloads): medians of 80 prompt and 200 output tokens, means near
# 160 and 330 (outputs run longer than prompts), and a few requests running to the 2,048-token maximum
# length of the paper's OPT-13B. The table below prints what the seeded draw actually gave. They all queue at once in front of a pool of 16,384 KV slots.
#
# **The schemes.** The same trace is replayed, first come first served, through five ways of managing
# that pool:
#
# | scheme | what a request gets when it is admitted |
# |---|---|
# | `max` | one contiguous range of the maximum length, 2,048 slots (Orca (Max) in the paper) |
# | `pow2` | prompt + the next power of two of its true output length: at most 2x over (Orca (Pow2)) |
# | `oracle` | exactly prompt + true output length: it knows the future (Orca (Oracle)) |
# | `paged-N` | our `KVCacheManager` with blocks of N tokens: one block at a time, as tokens arrive; when none is free, the newest request is preempted and recomputed later |
#
# Contiguous ranges come from a first-fit allocator over one linear region, so holes left by finished
# requests are real. At every engine step while requests are still waiting (memory is the bottleneck),
# each slot of the pool is counted as one of:
#
# * **token states**: holds the K/V of a token already in the sequence (the useful part);
# * **reservation**: reserved for a token the request will still produce;
# * **internal fragmentation**: reserved but never used, past the request's true final length;
# * **external fragmentation & other**: free, yet the next request in line could not get it.
#
# The share that holds token states is the figure of merit; the paper measured 96.3% for vLLM's paging
# (Fig. 2), against 20.4–38.2% for the contiguous schemes.
#
# **Predict first.** The table below answers all three, so guess before you run it.
#
# *6.a* When every request reserves the maximum length (`max`), what share of the pool holds token
# states: (a) under 40%, (b) 40 to 70%, (c) 70 to 90%, or (d) over 90%?

# %%
answer("6.a", None)

# %% [markdown]
# *6.b* Paged, with blocks of 1, 8, 16, 32, 64 or 128 tokens: which block size leaves the largest share
# of the pool holding token states? Answer with the number of tokens per block.

# %%
answer("6.b", None)

# %% [markdown]
# *6.c* The **batch** column is the mean number of requests running side by side. How many times more
# does `paged-16` run than `max`: (a) under 1.5, (b) 1.5 to 3, (c) 3 to 5, or (d) over 5?

# %%
answer("6.c", None)

# %% [markdown]
# Now the study.

# %% collapsed=true jupyter={"outputs_hidden": true} tags=["hide-output"]
mem = memory.run(quick=True)  # 300 requests, seed 0: the same numbers on every machine
memory.print_table(mem, show_device=False)

# %%
# Figure: Share of reserved KV memory holding token states for each allocation scheme (the memory study).
memory.plot_breakdown(mem)
plt.show()

# %%
print(f"{'scheme':<10} {'this trace':>10} {'paper Fig. 2':>12}")
for scheme, paper in memory.PAPER_FIG2.items():
    print(f"{scheme:<10} {mem['utilization'][scheme]:>10.1%} {paper:>12.1%}")
t = mem["trace"]
print(
    f"paged-16 preempted {mem['preemptions']['paged-16']} times and recomputed "
    f"{mem['recomputed_tokens']['paged-16']:,} tokens, for a trace of "
    f"{t['num_requests'] * (t['prompt_mean'] + t['output_mean']):,.0f} tokens in all"
)

# %% [markdown]
# **Reading the bars.** The ordering is the paper's: reserving the maximum wastes most of the pool
# on slots no request will ever use (internal fragmentation); rounding to a power of two wastes less,
# and even the oracle, which never over-reserves, holds its future tokens from the first step
# (reservation) and leaves holes between ranges of different sizes (external fragmentation). Paging
# removes the first two almost entirely: a request holds at most one partly filled block, and any
# free block fits any request. Our shares are not the paper's to the decimal (different trace,
# allocator and accounting), but the gap is the same kind: paged far above every contiguous scheme.
#
# Paging's price is in the **preempt** column, and it is paid in compute, not memory: it admits a
# request as soon as its prompt fits, so when every running request needs one more block and none is
# free, the newest is preempted and later recomputed (contiguous schemes never run out mid-request:
# they reserved everything up front). With the whole trace queued at once, as here, that price is
# high; real servers soften it by admitting less greedily: vLLM's `--watermark` (`SchedulerConfig.watermark`
# in `vllm/config/scheduler.py`, 0 by default, so off) keeps a share of blocks free when it admits a
# waiting request, "to avoid frequent preemptions", and by default it admits a request only when its
# whole prompt fits (`scheduler_reserve_full_isl`), not just its first chunk (notebook 07 builds a watermark).
# The payoff is the **batch** column: several times more requests run side by side in the same
# memory, and batch size is what decode throughput lives on.

# %% [markdown]
# ## 2. Throughput: the same requests through three engines
#
# One seeded workload of mixed prompt and output lengths (log-normal again; every request asks for its
# own number of new tokens and end-of-sequence is ignored, as in vLLM benchmarks), the same model, the
# same device, the same batch size and KV capacity:
#
# * `hf_static`: `model.generate` on fixed batches in arrival order, left-padded; each batch runs until
#   its longest request is done, so short requests idle in their slot;
# * `hf_continuous`: transformers' own continuous batching (`generate_batch`'s manager, paged KV
#   cache), one `add_request` per request;
# * `kvcourse`: our `LLMEngine`: `StallFreeScheduler` + paged `KVCacheManager` + the **fast attention
#   backend**, the engine's default (`kvcourse/backends/fast.py`: per layer, one gather of the whole
#   batch's keys and values through the block tables, then PyTorch's fused SDPA with a causal,
#   variable-length mask built once per step);
# * `kvcourse_ref_attention`: the same engine running *your* attention from exercises 5.2-5.3 (one
#   sequence at a time, readable, slower), and `kvcourse_triton` with your Triton kernel where CUDA exists;
# * `kvcourse_model_weights` (on a CPU, for GPT-2 small and wider): the same engine multiplying with
#   the model's own layers instead of the copy of its weights the engine packs for oneDNN
#   (`kvcourse/backends/packed.py`), so you can see what each of the two engine-side speed-ups is worth.
#
# Only the tokens each request asked for count. Every system is warmed up on a small slice first,
# then timed on the whole workload, the systems taking turns.
#
# On this CPU the `--quick` study uses the tiny 2-layer GPT-2 and one thread (the machine is shared;
# a second thread mostly waits for a core), so the model's arithmetic is small and the ratios show
# mostly how much padding and per-step overhead each engine carries. Serving's real gains (bigger
# batches in the same memory, at GPU speed) need a GPU: see section 5.

# %% tags=["nbval-ignore-output"]
tp = throughput.run(quick=True)
throughput.print_table(tp)

# %% tags=["nbval-ignore-output"]
# Figure: Throughput of each system in the quick study, in output tokens per second.
throughput.plot(tp)
plt.show()

# %% [markdown]
# The `same tokens` column is the sanity check behind the timing: the share of requests whose greedy
# tokens equal `hf_continuous`'s. Through our paged engine every request gets the same tokens as through
# transformers', so the engines did the same work.
#
# **Where each step's time goes.** The engine times the three phases of a step (schedule, execute,
# update) and the model runner the parts of execute: preparing the input tensors, the model's forward
# pass (attention apart), attention in every layer, and sampling. The study keeps those timings for
# each kvcourse system's best round; `other` is what the step loop costs besides.

# %% tags=["nbval-ignore-output"]
# Figure: Where kvcourse's step time goes: schedule, prepare, forward pass, attention, sample, update, other.
throughput.print_breakdown(tp)
throughput.plot_breakdown(tp)
plt.show()

# %% [markdown]
# **Against the machine's own limit.** Ratios to Hugging Face say who is faster, not how fast anyone
# could be. So the study also measures, in the same run, what this machine can do at best: its memory
# bandwidth (a 256 MiB copy) and the rate of its matrix multiplies at the shapes a step uses (each of the
# model's weight shapes, at the run's largest step, by the fastest product PyTorch has here). Every engine
# step must read each weight once, and the cached keys and values its sequences attend to, and must do its
# multiplies; whichever takes longer at those rates is the least that step can take. Summed over the run's
# steps, that is the **roofline bound** (after the roofline model of Williams, Waterman and Patterson);
# `time / bound` in the table above is each kvcourse system's wall time over it: 1.0 would be at the
# machine's limit, and no engine, ours or anyone's, can go below it on this machine.

# %% tags=["nbval-ignore-output"]
# Figure: Each kvcourse system's time against the machine's roofline bound for the same work (1.0 would be at the limit).
throughput.print_roofline(tp)
throughput.plot_roofline(tp)
plt.show()

# %% [markdown]
# With your reference attention the model's own matrix multiplies are not all there is: attention
# walks the batch one sequence at a time, a few small tensor operations per sequence per layer, and
# on the tiny model those dominate. The fast backend does the same arithmetic in a fixed handful of
# operations per layer, so its attention share shrinks and what remains is the forward pass itself.
#
# **On GPT-2 small** the full CPU study (`python -m kvcourse.bench throughput --reference --json`: seeded
# random weights, 32 requests, 1,204 prompt and 1,150 output tokens, batch 8, two threads, best of two
# rounds) takes a few minutes, so here is its stored result: run on 2026-12-02 at 10:36 UTC on this
# course's 2-core CPU machine with nothing else running (`notebooks/data/cpu_throughput.json`, with the
# versions it ran with).

# %%
# Figure: The stored full study (GPT-2 small): time against the roofline bound, per system.
full = json.loads((Path("data") / "cpu_throughput.json").read_text())
print(f"{full['date']}, " + ", ".join(f"{k} {v}" for k, v in full["versions"].items()))
throughput.print_table(full)
throughput.plot_roofline(full)
plt.show()

# %% [markdown]
# Here the forward pass is not Python overhead but GPT-2's matrix multiplies. A decode step multiplies
# eight rows by every weight matrix, so it is bound by **reading the weights**, 495 MB per step.
# Scheduling decides how many useful tokens each read of the weights produces (continuous batching
# needs 181 steps where static batches need 276 and pad every prompt); the kernel decides how fast one
# read goes. GPT-2's `Conv1D` layers multiply `x @ W` with W stored [in, out]; oneDNN multiplies by a
# packed copy of the same weights faster, so the engine packs that copy once, as vLLM converts weights
# after loading (`kvcourse_model_weights` is the same engine without the copy: 2.7 times slower).
#
# **How close to the bound?** The same study, the same quiet morning: before the packed layers called
# oneDNN once per product (they went through `MkldnnLinear`, three calls each), kvcourse took 5.88 s,
# **2.31x** its bound of 2.54 s; now 4.48 s, **1.66x** (a run a few minutes earlier: 1.67x). The goal
# was 1.25x, and it is not met. A profile of one run says where the 1.8 s above the bound goes: the linear
# layers alone take 2.8 s, already about 1.05x the whole bound (the body's matrices stream at about 31 GB/s
# and the LM head at 37 GB/s, against the 42 GB/s copy); attention 0.5 s (gathering K and V through the
# block tables, then SDPA); the rest is spread thin over GELU's seven element-wise operations, layer
# norms, residual adds and the Python of transformers' modules, a few microseconds each, hundreds a step.
# Closing that would mean replacing transformers' GPT-2 block by a fused one of our own, as vLLM's model
# classes do; this course runs transformers' own model through its attention and cache interfaces on
# purpose, so it stops here. Figures move with the machine and its load: rerun to see yours, and read
# the ratios within one run. GPU figures (GPT-2 with 64 or more requests) are still due: the kit that
# takes them on a bare CUDA machine is ready (section 5).

# %% [markdown]
# ## 3. Kernel: decode attention is a memory copy in disguise
#
# At decode each sequence brings one query, and attention reads every cached key and value of that
# sequence once, doing two small dot products per element. The arithmetic is trivial; the time goes
# into reading K and V. So the figure of merit is **achieved bandwidth**: bytes of K and V read, divided
# by the time. Its ceiling is the memory system's: we measure a large copy in the same run, and on a
# known GPU also quote the spec sheet (an H200 is rated at about 4.8 TB/s).
#
# Compared on the same data (GPT-2 small's 12 heads of 64, blocks of 16 tokens scattered at random):
#
# * `reference`: the gather reference from notebook 05 (`paged_decode_attention`), a Python loop over
#   sequences that copies each one's blocks into a contiguous tensor before attending;
# * `sdpa`: PyTorch's fused `scaled_dot_product_attention` on a contiguous cache, what a non-paged
#   engine would run over the same bytes;
# * `triton`: our Triton kernel, which reads blocks in place through the block table (CUDA only: on a
#   CPU, Triton's interpreter would time Python, not memory).

# %% tags=["nbval-ignore-output"]
kern = kernel.run(quick=True)
kernel.print_table(kern)

# %% tags=["nbval-ignore-output"]
# Figure: Attention kernels' effective bandwidth against context length, next to the measured copy bandwidth.
kernel.plot(kern)
plt.show()

# %% [markdown]
# On a CPU the smallest caches fit in the processor's own caches, so those points can beat the
# DRAM copy line; the larger ones show the real picture. The reference pays twice: a Python step per sequence, and a copy of every block before it attends.
# A fused kernel reads each byte once, and its bandwidth climbs toward the copy line as the batch and
# the context grow enough to keep the memory system busy. Reading through a block table instead of a
# contiguous tensor costs little once blocks hold a few dozen bytes per head in a row: that is the bet
# paged attention makes, and the GPU figures are where it is won or lost.

# %% [markdown]
# ## 4. Block size: the one new knob
#
# Small blocks waste less memory (at most one partly filled block per request) but mean more block
# table entries, more allocator calls and shorter contiguous reads for the kernel; large blocks are the
# opposite. vLLM's default of 16 sits where the memory curve has flattened. (On this shared CPU the
# throughput differences between block sizes are within the run-to-run noise; the GPU run is the one
# to read for that half.)

# %%
# Figure: Block size: the share of memory holding tokens (left) and throughput (right) for blocks of 1 to 128 tokens.
fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
memory.plot_block_sizes(mem, left)
for size in sorted(int(s.split("-")[1]) for s in mem["utilization"] if s.startswith("paged-")):
    print(f"block size {size:>3}: {mem['utilization'][f'paged-{size}']:.1%} of the pool holds token states")
throughput.plot_sweep(tp, right)
fig.tight_layout()
plt.show()

# %% tags=["nbval-ignore-output"]
for size, tps in tp["block_size_sweep"]["tokens_per_s"].items():
    print(f"block size {size:>3}: {tps:,.1f} output tokens/s (kvcourse, reference attention)")

# %% [markdown]
# ## 5. GPU figures
#
# The throughput and kernel studies mean most on a GPU. `scripts/gpu_check.sh` runs them on a CUDA
# machine with no network (after `scripts/gpu_wheels.sh` has fetched, elsewhere, the two small wheels such
# a machine lacks; CONTRIBUTING.md gives the commands), together with every GPU test, and commits its JSON
# as `notebooks/data/gpu_tests.json`, `gpu_throughput.json` and `gpu_kernel.json`, plotted here with the
# device, date and versions they came from.

# %%
gpu_files = sorted(Path("data").glob("gpu_*.json"))
if not gpu_files:
    print(
        "GPU figures are still due: no notebooks/data/gpu_*.json yet. The kit is ready: "
        "scripts/gpu_wheels.sh, then scripts/gpu_check.sh on the GPU machine (CONTRIBUTING.md)."
    )
for path in gpu_files:
    result = json.loads(path.read_text())
    versions = result.get("versions") or {k: result[k] for k in ("torch", "transformers", "triton") if k in result}
    print(
        f"{path.name}: {result['study']} on {result['device']}, {result['date']}; "
        + ", ".join(f"{k} {v}" for k, v in versions.items())
    )
    if result["study"] == "throughput":
        throughput.print_table(result)
        throughput.plot(result)
        plt.show()
    elif result["study"] == "kernel":
        kernel.print_table(result)
        kernel.plot(result)
        plt.show()

# %% [markdown]
# ## 6. Reading the real thing: kvcourse → vLLM v1
#
# Every piece you built has a counterpart in vLLM's v1 engine (paths in the
# [vllm-project/vllm](https://github.com/vllm-project/vllm) repository, in the release the README names,
# each checked there by `scripts/check_vllm.py`; the real classes carry more:
# KV-cache groups for hybrid models, speculative decoding, connectors, CUDA graphs):
#
# | kvcourse (file · class or function) | vLLM v1 (file · class or function) |
# |---|---|
# | `kvcourse/core/request.py` · `Request`, `RequestStatus` | `vllm/v1/request.py` · `Request`, `RequestStatus` |
# | `kvcourse/core/contract.py` · `KVCacheBlocks` | `vllm/v1/core/kv_cache_manager.py` · `KVCacheBlocks` |
# | `kvcourse/core/contract.py` · `MockKVCacheManager` | none: a teaching double that only counts blocks |
# | `kvcourse/core/kv_cache_utils.py` · `KVCacheBlock`; `kv_cache.py` · `FreeKVCacheBlockQueue` | `vllm/v1/core/kv_cache_utils.py` · `KVCacheBlock`, `FreeKVCacheBlockQueue` |
# | `kv_cache.py` · `hash_block_tokens` | `vllm/v1/core/kv_cache_utils.py` · `hash_block_tokens` |
# | `kv_cache.py` · `BlockPool` | `vllm/v1/core/block_pool.py` · `BlockPool` |
# | `kv_cache.py` · `KVCacheManager` | `vllm/v1/core/kv_cache_manager.py` · `KVCacheManager` |
# | `kvcourse/core/kv_cache_utils.py` · `PrefixCacheStats` | `vllm/v1/metrics/stats.py` · `PrefixCacheStats` |
# | `scheduler.py` · `StallFreeScheduler` | `vllm/v1/core/sched/scheduler.py` · `Scheduler` |
# | `kvcourse/core/sched_output.py` · `SchedulerOutput`, `ScheduledSequence` | `vllm/v1/core/sched/output.py` · `SchedulerOutput`, `NewRequestData`, `CachedRequestData` |
# | `model_runner.py` · `ModelRunner`, `prepare_inputs` | `vllm/v1/worker/gpu/model_runner.py` · `GPUModelRunner` (`prepare_inputs`, `execute_model`): Model Runner V2, the default; the older `vllm/v1/worker/gpu_model_runner.py` · `GPUModelRunner` is the fallback for features V2 lacks |
# | `kvcourse/worker/paged_cache.py` · `PagedKVCache` (one K and one V tensor per layer) | `vllm/v1/worker/gpu/model_runner.py` · `GPUModelRunner.initialize_kv_cache` |
# | `attention.py` · `write_to_cache` | `vllm/_custom_ops.py` · `reshape_and_cache_flash` (a CUDA kernel) |
# | `attention.py` · `paged_decode_attention`, `triton_paged_decode_attention` | `vllm/v1/attention/backends/triton_attn.py` · `TritonAttentionImpl`, calling `vllm/v1/attention/ops/triton_unified_attention.py` · `unified_attention` |
# | `kvcourse/engine/llm_engine.py` · `LLMEngine` (`generate`, `step`) | `vllm/v1/engine/llm_engine.py` · `LLMEngine`; the step loop is `vllm/v1/engine/core.py` · `EngineCore.step` |
#
# The teaching tools (`kvcourse/toy/`, `kvcourse/viz/widgets.py`, the mock manager) have no counterpart. A good order
# to read them in: `vllm/v1/request.py`, then `vllm/v1/core/kv_cache_utils.py` and
# `vllm/v1/core/block_pool.py` (the allocator you wrote in notebook 03, with prefix caching from 04),
# `vllm/v1/core/kv_cache_manager.py`, and `vllm/v1/core/sched/scheduler.py`, whose `schedule()` does
# notebook 02's job with a different policy: it has no phases. It walks the running requests in order,
# giving each what it still needs (a decode, or the next chunk of its prompt), then admits waiting
# requests while the budget lasts; the course's decodes first, then one prefill chunk, then admissions
# is the source lesson's stall-free (Sarathi-style) policy. **Notebook 09** maps every piece, and
# what vLLM adds to it, file by file.
