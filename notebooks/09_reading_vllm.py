# %% [markdown]
# # 09 · Reading vLLM's core: a map
#
# > **What to expect.** Nothing to fill in: this closing notebook is a map for reading vLLM's source with
# > what you built in your hands. One cell runs a step of two schedulers side by side, after two
# > predictions; the last cell shows how every path on this page was checked.
#
# Eight notebooks built the memory side of a serving engine. vLLM's engine is the same machine grown up,
# and most of its core reads easily once you know which of your pieces each file is. For each piece
# below: the vLLM file and symbol to open, what is the same, and what vLLM adds that the course left
# out, one paragraph each.
#
# **Getting the source.** The paths are those of the release the course compares itself with (the
# README names it; the last cell prints it), written from the package root, `vllm/...`. Read them in a
# clone of [vllm-project/vllm](https://github.com/vllm-project/vllm) at that release's tag, in an
# installed copy (`python -c "import vllm, os; print(os.path.dirname(vllm.__file__))"`), or without
# installing anything: `pip download vllm==VERSION --no-deps -d wheels/` fetches the wheel (a zip, about
# 340 MB) and `unzip wheels/vllm-*.whl 'vllm/*.py'` gives you its Python files. The CUDA kernels
# (`csrc/` in the repository) are not in the wheel as source.
#
# | you built (notebook · `kvcourse/`) | open in vLLM |
# |---|---|
# | the request (02) · `kvcourse/core/request.py` | `vllm/v1/request.py` · `Request`, `RequestStatus` |
# | the engine's step (01) · `step.py`, `kvcourse/engine/llm_engine.py` | `vllm/v1/engine/core.py` · `EngineCore.step` |
# | the scheduler (02, 07) · `scheduler.py` | `vllm/v1/core/sched/scheduler.py` · `Scheduler` |
# | the step's plan (02) | `vllm/v1/core/sched/output.py` · `SchedulerOutput` |
# | the free-block queue (03) · `kv_cache.py` | `vllm/v1/core/kv_cache_utils.py` · `FreeKVCacheBlockQueue`, `KVCacheBlock` |
# | the block pool (03, 04) · `kv_cache.py` | `vllm/v1/core/block_pool.py` · `BlockPool` |
# | the manager (03, 04) · `kv_cache.py` | `vllm/v1/core/kv_cache_manager.py` · `KVCacheManager`, `KVCacheBlocks` |
# | the hash chain (04) · `kv_cache.py` | `vllm/v1/core/kv_cache_utils.py` · `hash_block_tokens`, `NONE_HASH` |
# | the cache write (05) · `attention.py` | `vllm/_custom_ops.py` · `reshape_and_cache_flash` |
# | paged attention and its kernel (05) · `attention.py` | `vllm/v1/attention/backends/triton_attn.py` · `TritonAttentionImpl`; `vllm/v1/attention/ops/triton_unified_attention.py` · `unified_attention` |
# | the model runner (05) · `model_runner.py` | `vllm/v1/worker/gpu/model_runner.py` · `GPUModelRunner` |
# | KV bytes per token, what fits, what never fits (00, 2.9) · `memory.py`, `scheduler.py` | `vllm/v1/core/kv_cache_planning.py` · `get_kv_cache_configs`, `check_enough_kv_cache_memory` |
# | the server (08) · `serve/` | `vllm/entrypoints/openai/completion/serving.py` · `OpenAIServingCompletion`; `vllm/v1/engine/async_llm.py` · `AsyncLLM` |

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
from kvcourse import answer

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
#
# ## 2. The free-block queue and the block pool (notebook 03)
#
# `vllm/v1/core/kv_cache_utils.py` · `FreeKVCacheBlockQueue` is your exercise 3.1: a doubly linked list
# threaded through `KVCacheBlock`'s `prev_free_block` / `next_free_block`, between the sentinels
# `fake_free_list_head` and `fake_free_list_tail`, with `popleft`, `remove` and `append`, plus batch
# forms (`popleft_n`, `append_n`, `prepend_n`). `vllm/v1/core/block_pool.py` · `BlockPool` is your 3.2:
# `get_new_blocks` takes from the front (evicting a cached block it hands out), `touch` revives a free
# block on a prefix hit, `free_blocks` gives blocks back. The one difference in behaviour: vLLM's
# `free_blocks` puts blocks that carry **no** prefix hash at the **front** of the queue (reused first,
# while their memory is warm) and only hashed blocks at the back, in LRU order; the course puts every
# freed block at the back (notebook 03 says why).
#
# ## 3. The manager and `allocate_slots` (notebooks 03 and 04)
#
# `vllm/v1/core/kv_cache_manager.py` · `KVCacheManager` has your methods under your names:
# `allocate_slots` (all or nothing: `None` when the pool is short), `get_computed_blocks` (the prefix
# lookup; it returns three values in vLLM, the blocks, the number of hit tokens and a boundary used by
# hybrid models), `free` (tail first), `reset_prefix_cache`. Its `allocate_slots` takes more arguments
# than yours: `num_lookahead_tokens` (section 9), tokens a KV connector will load
# (`num_external_computed_tokens`, section 11), and the two admission gates of section 8. The blocks it
# returns come in a `KVCacheBlocks`, which holds one list of blocks **per KV-cache group** (next
# section); yours holds one list.
#
# ## 4. The KV-cache coordinator and the hybrid allocator
#
# Your cache has one layout for every layer. A model that mixes full attention with sliding-window or
# Mamba layers has several, so vLLM describes each layer's needs with a `KVCacheSpec`
# (`vllm/v1/kv_cache_interface.py`: `FullAttentionSpec`, `SlidingWindowSpec`, `MambaSpec`, ...; a
# different thing from the course's scheduler–cache contract of notebook 02), puts layers with
# the same spec in a **group**, and gives each group a `SingleTypeKVCacheManager`
# (`vllm/v1/core/single_type_kv_cache_manager.py`: `FullAttentionManager`, `SlidingWindowManager`,
# `MambaManager`, ...), all drawing from one `BlockPool`. `vllm/v1/core/kv_cache_coordinator.py` ·
# `HybridKVCacheCoordinator` makes them agree: a prefix hit counts only as far as every group has it,
# and `KVCacheManager` talks to the coordinator, never to a group directly. With one group, as in
# GPT-2, `UnitaryKVCacheCoordinator` is your manager with one level of indirection.
#
# ## 5. The null block
#
# `BlockPool` takes block 0 out of the free queue before anyone allocates (`null_block`) and never
# gives it back. It stands in wherever a block table needs an entry that holds nothing: blocks a
# sliding-window group has dropped (tokens outside the window), padding in the worker's block tables,
# and writes a dummy run must not land anywhere real. Your tables are padded with 0 too (notebook 05),
# but your block 0 is an ordinary block that padding merely never reads.
#
# ## 6. Prefix caching: isolation keys, no token check, duplicates, events (notebook 04)
#
# `vllm/v1/core/kv_cache_utils.py` · `hash_block_tokens(hash_function, parent_block_hash,
# curr_block_token_ids, extra_keys)` is your chain, rooted at `NONE_HASH` (a hash of a seed, not `None`)
# and keyed by more than tokens: `generate_block_hash_extra_keys` adds the LoRA adapter, the multimodal
# inputs in the block, prompt embeddings, and the request's `cache_salt` on the first block, so that
# tenants who pass different salts never share a prefix (isolation between users). The
# lookup (`BlockPool.get_cached_block`) compares hashes only, where yours also compares tokens, and
# `BlockHashToBlockMap` may hold several blocks under one hash, where yours keeps one. How duplicates
# arise: two requests with the same prompt admitted in the same step both miss (neither has published
# yet), so each computes its own copy of the prefix and both publish it. vLLM cannot then point the second
# request at the first one's block: that would change an entry in the middle of its block table, and the
# worker's persistent batch (section 13) only accepts tables that grow at their end. So both copies stay,
# under one hash, until they are evicted. With
# `enable_kv_cache_events`, the pool publishes every change (`vllm/distributed/kv_events.py` ·
# `BlockStored`, `BlockRemoved`, `AllBlocksCleared`), so that a router in front of many servers can
# send a request where its prefix is cached. Hit rates are counted in `vllm/v1/metrics/stats.py` ·
# `PrefixCacheStats`, as yours are.
#
# **Copy-on-write is back**, in one place: a prefix hit that ends inside a block (hybrid models whose
# prefixes are hashed finer than a cache block) is redirected to a private copy
# (`SingleTypeKVCacheManager._apply_cow`), and the copies reach the worker through
# `KVCacheManager.take_kv_cache_block_copies`: your exercises 4.5 and 4.6 and your `take_pending_copies`.
# Parallel sampling, by contrast, shares the prompt through the prefix cache (`ParentRequest` in
# `vllm/v1/engine/parallel_sampling.py`) and, in a model with attention layers only, copies nothing.

# %% [markdown]
# ## 7. The scheduler: one order, no phases (notebooks 02 and 07)
#
# `vllm/v1/core/sched/scheduler.py` · `Scheduler.schedule` does your `schedule_next_batch`'s job, and
# `update_from_output` your update; both stop admitting at a head that does not fit (first come, first
# served), preempt the newest running request (or, under `policy="priority"`, the least urgent) by
# recompute, and admit nobody in a step that preempted. The **policy** differs. Yours is the source
# lesson's stall-free (Sarathi-style) order: every decode first, then one running prefill's chunk, then
# admissions. vLLM's `schedule()` has no phases ("There's no decoding phase nor prefill phase", its
# comment says): it walks the running requests in queue order, giving each whatever it still needs (one
# token for a decode, the next chunk for a prompt), then the waiting queue, until the token budget
# (`max_num_batched_tokens`) is spent. Usually the order is the same, since newer requests sit behind
# older ones in the running queue. It differs when a long prompt was admitted ahead of short ones that
# are decoding now, and when two prompts are prefilling at once. The cell below plans one step both ways,
# with memory to spare; the two small functions restate the two policies on a list of requests.
#
# **Predict** first, for the step below (running, in queue order: decode A, prompt P with 30 tokens to
# go, decodes B and C; budget 16): how many of the three decodes does vLLM's order schedule? And in the
# second step (two prompts prefilling, P1 then P2, 20 tokens each; budget 32), how many tokens does the
# course's order give P2?

# %%
answer("9.a", None)
answer("9.b", None)


# %% collapsed=true jupyter={"outputs_hidden": true} tags=["hide-output"]
def stall_free_order(running, waiting, budget):
    """The course's step: every decode, then the oldest prefill's next chunk, then first chunks, FCFS."""
    plan, left = {}, budget
    for name, need in running:
        if need == 1 and left:  # a decode needs one token
            plan[name], left = 1, left - 1
    prefilling = [(name, need) for name, need in running if need > 1]
    if prefilling and left:
        name, need = prefilling[0]
        plan[name] = min(need, left)
        left -= plan[name]
    for name, need in waiting:
        if not left:
            break  # the head gets nothing: nobody behind it goes first
        plan[name] = min(need, left)
        left -= plan[name]
    return plan


def vllm_order(running, waiting, budget):
    """vLLM's schedule(): each running request in queue order gets what it still needs, then the waiting ones."""
    plan, left = {}, budget
    for name, need in running + waiting:
        if not left:
            break
        plan[name] = min(need, left)
        left -= plan[name]
    return plan


steps = {
    "step 1, budget 16": ([("A", 1), ("P", 30), ("B", 1), ("C", 1)], [("W", 8)], 16),
    "step 2, budget 32": ([("A", 1), ("P1", 20), ("P2", 20), ("B", 1)], [("W", 8)], 32),
}
for title, (running, waiting, budget) in steps.items():
    ours, theirs = stall_free_order(running, waiting, budget), vllm_order(running, waiting, budget)
    print(f"{title}        course  vLLM")
    for name, need in running + waiting:
        kind = "decode" if need == 1 else f"{need} tokens to go" + (" (waiting)" if (name, need) in waiting else "")
        print(f"  {name:<3}{kind:<24}{ours.get(name, 0):>4}  {theirs.get(name, 0):>4}")
    print()

# %% [markdown]
# In step 1, vLLM's order feeds P's chunk before B and C: they wait a step, a gap in their stream that the
# stall-free order never makes. In step 2 it gives both prompts a chunk and drops decode B, while the
# course's order keeps every decode, prefills one prompt and admits W instead. Neither is wrong: the
# stall-free order guards inter-token latency; vLLM's treats every request alike and leaves the
# latency knob to `long_prefill_token_threshold` (0, off, by default: a cap on one prompt's chunk so
# that it cannot take the whole budget) and to the budget itself.
#
# ## 8. Admission gates beyond the budget
#
# Your admission asks: is there budget, is there a seat (`max_batch_size`), do the first chunk's blocks
# fit? vLLM asks more. With `scheduler_reserve_full_isl` (on by default, `vllm/config/scheduler.py`) the
# blocks for the **whole prompt** must be free, not just the first chunk's; `--watermark`
# (`SchedulerConfig.watermark`, 0 by default) keeps a share of blocks free when admitting while others
# run (your exercise 7.2); `max_num_seqs` caps the running requests; a request waiting for a
# structured-output grammar or for K/V from a connector is skipped until it is ready; encoder inputs
# have their own budget; and the number of distinct LoRA adapters in one batch is capped. Every gate
# is in the waiting loop of `Scheduler.schedule` and in `KVCacheManager.allocate_slots`.
#
# ## 9. Lookahead tokens and speculative decoding
#
# With speculative decoding a cheap drafter (`vllm/v1/spec_decode/`: n-gram, EAGLE, a draft model)
# proposes several tokens, and one forward pass of the real model checks them all
# (`vllm/v1/sample/rejection_sampler.py` · `RejectionSampler`). The scheduler then schedules a request's
# draft tokens as if they were prompt tokens (`Request.spec_token_ids`), and `allocate_slots` reserves
# `num_lookahead_tokens` extra slots beyond the step's tokens so that the drafts have somewhere to go.
# Rejected drafts simply leave `num_computed_tokens` behind. Your decode always feeds exactly one token.
#
# ## 10. Async scheduling (on by default)
#
# `vllm/v1/engine/core.py` · `EngineCore.step` is your step (notebook 01): `schedule`, then
# `execute_model` (and `sample_tokens`, sampling split off the forward pass), then
# `update_from_output`. Your loop is strictly serial: schedule, run, update, schedule again. vLLM
# overlaps them: while the GPU
# runs step *n*, the CPU already schedules step *n + 1* (`vllm/v1/core/sched/async_scheduler.py` ·
# `AsyncScheduler`), counting each running request's not-yet-sampled token as a placeholder
# (`num_output_placeholders`) so that the next plan is right before the token is known.
# `SchedulerConfig.async_scheduling` is unset by default and `VllmConfig` turns it on unless the setup
# does not support it; `EngineCore.step_with_batch_queue` runs the overlapped loop.
#
# ## 11. KV connectors: disaggregated prefill and CPU offload
#
# A KV connector moves blocks in and out of the cache around the scheduler's back, through one
# interface (`vllm/distributed/kv_transfer/kv_connector/v1/base.py` · `KVConnectorBase_V1`): on the
# scheduler's side `get_num_new_matched_tokens` says how many of a prompt's tokens it can supply, on the
# worker's side it loads and saves blocks layer by layer. The NIXL connectors
# (`vllm/distributed/kv_transfer/kv_connector/v1/nixl/connector.py`) ship K/V between machines, so one
# fleet prefills and another decodes (disaggregated prefill);
# `vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py` · `OffloadingConnector` copies
# computed blocks to CPU memory and loads them back on a later prefix hit, after the GPU copy was
# evicted. That is where v0's swap space went (your exercise 7.3): v1 preempts by recompute only.
#
# ## 12. KV memory sizing at start-up (vLLM's answer to exercise 2.9)
#
# You reject, per request, what can never fit the cache (2.9), and notebook 00 computed how many
# sequences fit a memory budget. vLLM settles both once, at start-up: the worker runs the model on a
# dummy batch of the largest size and measures what is left
# (`vllm/v1/worker/gpu_worker.py` · `Worker.determine_available_memory`, under
# `gpu_memory_utilization`), `vllm/v1/core/kv_cache_planning.py` · `get_kv_cache_configs` divides that
# into blocks per group (your `kv_bytes_per_token` times the block size, per layer), and
# `check_enough_kv_cache_memory` refuses to start unless one request of `max_model_len` tokens fits.
# From then on a request longer than `max_model_len` is refused when it arrives
# (`vllm/v1/engine/input_processor.py` · `InputProcessor`), so none can be too large for the cache.
# `EngineCore._initialize_kv_caches` (`vllm/v1/engine/core.py`) ties the steps together.
#
# ## 13. The worker's persistent batch
#
# Your runner builds every tensor afresh each step (5.5). vLLM's keeps the batch between steps: per
# request state lives in fixed slots on the GPU (`vllm/v1/worker/gpu/states.py` · `RequestState`, and
# `vllm/v1/worker/gpu/block_table.py` · `BlockTables`), and each step's `SchedulerOutput` carries only
# what changed: new requests in full (`NewRequestData`), running ones as their new block ids and tokens
# (`CachedRequestData`). So a block table may only grow at its end: the worker never hears of an entry
# that changes in the middle (section 6 shows what that costs the prefix cache). The older
# runner's version is `vllm/v1/worker/gpu_input_batch.py` · `InputBatch`.
#
# ## 14. Model Runner V2 and the attention backends (notebook 05)
#
# `vllm/v1/worker/gpu/model_runner.py` · `GPUModelRunner` (Model Runner V2, the default; the older
# `vllm/v1/worker/gpu_model_runner.py` is the fallback when a feature V2 lacks is on, or
# `VLLM_USE_V2_MODEL_RUNNER=0`) is your `ModelRunner`: `prepare_inputs` packs every scheduled token into
# one row with positions, a slot mapping, sequence lengths and query start offsets, the tensors of your
# 5.5; `execute_model` runs the model. It adds CUDA graphs: a step's token count is padded up to a size
# captured in advance (`vllm/v1/cudagraph_dispatcher.py` · `CudagraphDispatcher`), the extra slots set
# to `PAD_SLOT_ID` (-1) so nothing is written. Attention is a **backend** chosen per device and model
# (`vllm/v1/attention/selector.py` · `get_attn_backend`): `vllm/v1/attention/backends/flash_attn.py` ·
# `FlashAttentionBackend` on many NVIDIA GPUs, FlashInfer, and the Triton backend whose kernel
# (`vllm/v1/attention/ops/triton_unified_attention.py` · `unified_attention`) handles prefill and decode
# in one launch, as your mixed attention (5.3) does in PyTorch. Before attention, the new K/V go into
# the cache, your 5.1, in the layout your cache uses: `reshape_and_cache_flash` (a CUDA kernel) in the
# FlashAttention backend, a Triton version of it in the Triton backend.
#
# ## 15. How this page was checked

# %% tags=["nbval-ignore-output"]
import json
from pathlib import Path

report = json.loads(Path("data/vllm_checked.json").read_text())
named = [v for kind in ("paths", "symbols", "claims", "metrics") for v in report[kind]]
missing = [v for v in named if not v["found"]]
print(f"vLLM {report['vllm_version']} ({report['wheel']}), checked {report['checked_on']}:")
print(f"  {len(report['paths'])} paths, {len(report['symbols'])} symbols next to them, {len(report['claims'])} facts")
print(f"  and {len(report['metrics'])} metric names named in the course; not found: {len(missing)}")

# %% [markdown]
# Every vLLM path and symbol this course names, here and in the other notebooks, the README and the
# code's comments, was looked up in that release's own Python files by `scripts/check_vllm.py`, which
# downloads the wheel (never installing it) and writes the verdicts above to
# `notebooks/data/vllm_checked.json`; `tests/test_vllm_facts.py` fails when the course names a path
# the report does not list as found. vLLM moves fast: when a path here no longer opens, the release
# has moved on, and that script says where the course must follow.
#
# ## What you can read now
#
# Start where you built: `vllm/v1/core/kv_cache_utils.py` (the queue and the hash), then
# `vllm/v1/core/block_pool.py`, `vllm/v1/core/kv_cache_manager.py` and
# `vllm/v1/core/sched/scheduler.py` (whose `schedule()` is long, but now every branch is a feature from
# this page), then `vllm/v1/engine/core.py` for the loop around them. The names are the ones you wrote.
