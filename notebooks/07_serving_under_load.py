# %% [markdown]
# # 07 · Serving under load
#
# > **What to expect.** The outputs stored in this notebook come from the reference solutions; running a
# > cell replaces its output with your code's. Run All stops at your first unwritten exercise (its
# > `NotImplementedError`) and leaves the cells below it empty, so run the notebook cell by cell.
#
# Until now every workload put all its requests in the queue at time zero and we counted throughput.
# A server's day is different: requests **arrive** while it works, and each user feels **latency**. That
# is where a scheduler's policy choices show. This notebook measures what vLLM's serving benchmark
# measures, on the scheduler you built, and adds the policy knobs vLLM's scheduler exposes:
#
# 1. arrivals over time and a clock; per request **TTFT** (time to first token), **TPOT** (time per output
#    token after the first), **ITL** (the gaps between tokens), **E2E** (end-to-end latency); per run their
#    percentiles, throughput, and **goodput** (requests per second that met a latency SLO);
# 2. the latency–throughput knee; the token-budget trade-off of chunked prefill; FCFS against skip-ahead
#    (every step is planned by your scheduler's policy: decodes first, then one prefill chunk, then
#    admissions, the source lesson's stall-free, Sarathi-style order; vLLM's `schedule()` has no phases
#    and walks its running requests in order, then the waiting ones: notebook 09 shows both orders on
#    one batch);
# 3. five exercises in `kvcourse/scheduler.py` and `kvcourse/kv_cache.py`:
#
# | exercise | what you write | minutes |
# |---|---|---|
# | 7.1 | priority scheduling: the queue by (priority, arrival), the least urgent is the victim | 15 |
# | 7.2 | a watermark: admit only while some blocks stay free for running decodes | 10 |
# | 7.3 | swap or recompute: a CPU block pool's swap-out and swap-in, the cost model and its crossover | 20 |
# | 7.4 | abort: a cancelled request gives every block back at once | 10 |
# | 7.5 | `reset_prefix_cache`: drop every cached prefix, refused while a block is held | 5 |
#
# **The clock.** On a GPU the honest clock is the wall clock. On a CPU, timings jitter from run to run, so
# the studies here use a **simulated clock**: each engine step costs `fixed + per_token × tokens fed`
# seconds, a cost model of GPT-2 small's engine steps on a CPU (`serving.GPT2_CPU_STEP_COST`, printed
# below; `serving.fit_step_cost(serving.measure_step_costs(model))` fits one to your machine). The
# scheduler, the engine loop and every decision are the real ones; only the time each step takes comes
# from the model, so every output below is the same on every machine.

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
import warnings

import matplotlib.pyplot as plt

from kvcourse import answer, check, hint, solution, toy  # noqa: F401  (hint, solution: for you)
from kvcourse.bench import serving
from kvcourse.core.contract import MockKVCacheManager
from kvcourse.core.request import Request, RequestStatus
from kvcourse.kv_cache import KVCacheManager
from kvcourse.scheduler import PreemptionCosts, StallFreeScheduler, recompute_seconds, swap_crossover, swap_seconds
from kvcourse.toy.arrivals import SimulatedClock, serve

cost = serving.GPT2_CPU_STEP_COST
print(f"simulated step: {cost.fixed_s * 1e3:.1f} ms + {cost.per_token_s * 1e3:.2f} ms per token fed")

# %% [markdown]
# ## 1. Arrivals and a clock
#
# `serve(scheduler, arrivals, clock)` is the engine's own loop (`EngineCore`: schedule, execute, update)
# with one addition: before each step, every request whose arrival time has passed joins the waiting
# queue, as in vLLM's engine. Arrivals come from a Poisson process (exponential gaps at a given rate) or
# from a trace. Here: three requests, the third arriving while the first two are decoding.

# %%
arrivals = [(0.0, Request(0, list(range(1, 41)), 6)), (0.0, Request(1, list(range(1, 9)), 6))]
arrivals.append((0.15, Request(2, list(range(50, 80)), 6)))
scheduler = StallFreeScheduler(64, 8, MockKVCacheManager(num_blocks=32, block_size=16))
result = serve(scheduler, arrivals, SimulatedClock(serving.GPT2_CPU_STEP_COST))
for t in result.times:
    gaps = ", ".join(f"{gap * 1e3:.0f}" for gap in t.itl)
    print(
        f"R{t.request_id}: arrives {t.arrival:.2f} s, prompt {t.prompt_len:>2} | TTFT {t.ttft:.3f} s, "
        f"TPOT {t.tpot * 1e3:.0f} ms, E2E {t.e2e:.3f} s | ITL (ms): {gaps}"
    )

# %% [markdown]
# Read R2: it arrived mid-run and joined the running batch at the next step (continuous batching), so
# its TTFT is its wait for that step plus its own prefill. R0 and R1 felt it: one of their gaps is
# longer than the others, the step in which R2's prefill shared the batch with their decodes. Now a real load: 64 requests arriving at 4 per
# second, mostly short prompts (8–48 tokens) with one long prompt (160–240 tokens) in eight.

# %%
work = serving.make_workload(64, rate=4)
times = serving.simulate(work)
summary = serving.summarize(times, **serving.SLO)
print(f"{summary['requests']} requests in {summary['duration_s']:.1f} s (simulated)")
for metric in ("ttft", "tpot", "itl", "e2e"):
    print(
        f"{metric.upper():>4}: p50 {summary[f'{metric}_p50']:.3f} s   p90 {summary[f'{metric}_p90']:.3f} s   p99 {summary[f'{metric}_p99']:.3f} s"
    )
print(
    f"throughput {summary['output_tokens_per_s']:.1f} output tokens/s, goodput {summary['goodput']:.2f} "
    f"requests/s meeting TTFT <= {serving.SLO['slo_ttft_s']} s and TPOT <= {serving.SLO['slo_tpot_s']} s"
)

# %%
# Figure: Latency distributions (TTFT, TPOT, ITL) of 64 requests arriving at 4 per second.
serving.plot_latency_distributions(times, "64 requests at 4 per second")
plt.show()

# %% [markdown]
# The TTFT histogram has a long right tail: the long prompts (a 200-token prefill is one long step, or
# several) and whoever queued behind them. The p99 is what an SLO is written against, not the
# mean.
#
# ## 2. The latency–throughput knee
#
# Raise the request rate. At first throughput follows the load and latency barely moves: the batch
# just grows. Past some rate the engine cannot keep up, the queue grows for as long as requests keep
# coming, and TTFT climbs steeply. The knee is the highest rate whose p99 TTFT still meets the SLO.

# %%
# Figure: The latency-throughput knee: p99 TTFT against the arrival rate, with the SLO.
sweep = serving.rate_sweep((1, 2, 4, 6, 8, 12, 16, 24), 64)
print(" rate  tok/s  goodput  TTFT p50   p99   TPOT p50   p99")
for row in sweep:
    print(
        f"{row['rate']:>5} {row['output_tokens_per_s']:>6.1f} {row['goodput']:>8.2f} {row['ttft_p50']:>9.2f} "
        f"{row['ttft_p99']:>5.2f} {row['tpot_p50']:>10.3f} {row['tpot_p99']:>5.3f}"
    )
print(f"knee: {serving.knee(sweep)} requests/s (the highest rate with p99 TTFT <= {serving.SLO['slo_ttft_s']} s)")
busy = serving.busy_rate(sweep)  # the policy studies below run here: busy, not yet swamped
serving.plot_rate_sweep(sweep)
plt.show()

# %% [markdown]
# Goodput is the figure to watch: it rises with the rate up to the knee, then falls while raw
# throughput still creeps up. Past the knee more requests are served per second, but fewer of them
# are served well. The policy studies below run at the knee rate, where the queue is busy but not
# yet growing without bound.
#
# ## 3. The token budget: chunked prefill's trade-off
#
# The token budget (vLLM's `max_num_batched_tokens`) caps the tokens one step feeds. A long prompt is
# cut into chunks of what is left of the budget after the decodes. **Predict** before the next cell:
# as the budget grows from 32 to 512 tokens per step, what happens to the p99 inter-token latency of
# the requests that are decoding?

# %%
answer("7.a", None)

# %% collapsed=true jupyter={"outputs_hidden": true} tags=["hide-output"]
# Figure: The token budget's trade-off: TTFT against inter-token latency as the budget grows from 32 to 512 tokens per step.
budgets = serving.budget_sweep((32, 64, 128, 256, 512), rate=busy / 2, num_requests=64)  # half the knee rate
print("budget  TTFT p50   p99   TPOT p99   ITL p99")
for row in budgets:
    print(
        f"{row['token_budget']:>6} {row['ttft_p50']:>9.2f} {row['ttft_p99']:>5.2f} "
        f"{row['tpot_p99']:>10.3f} {row['itl_p99']:>9.3f}"
    )
serving.plot_budget_tradeoff(budgets)
plt.show()

# %% [markdown]
# One picture, two curves going opposite ways. A big budget lets a long prompt's prefill run in one
# or two steps: its TTFT falls. But every running request decodes in the same step, so each of them
# waits for that whole prefill: the inter-token latency a streaming user sees jumps. A small budget
# chops prefills into many steps (TTFT grows) and keeps every step short (smooth streaming). vLLM's
# `long_prefill_token_threshold` is a second knob on the same trade-off: it caps the chunk of any one
# long prompt, so a single request cannot take the whole budget.
#
# ## 4. FCFS against skip-ahead
#
# Notebook 02 made admission first come, first served: when the head of the queue does not fit, nobody
# behind it goes first. Skip-ahead admits whoever fits. In a cache of 40 blocks (640 tokens) at the
# knee rate (`busy`: loaded, not yet swamped), a long prompt often does not fit while short ones do.
# **Predict:** which admission gives the **long** prompts the lower p99 TTFT?

# %%
answer("7.b", None)

# %% collapsed=true jupyter={"outputs_hidden": true} tags=["hide-output"]
tails = serving.admission_tails(rate=busy, num_requests=64)
print("admission   long TTFT p50   p99   short TTFT p50   p99   tok/s")
for name, row in tails.items():
    print(
        f"{name:<10} {row['long_ttft_p50']:>14.2f} {row['long_ttft_p99']:>5.2f} {row['short_ttft_p50']:>16.2f} "
        f"{row['short_ttft_p99']:>5.2f} {row['output_tokens_per_s']:>7.1f}"
    )

# %% [markdown]
# Skip-ahead looks better on average (the many short requests get in sooner) and moves the pain onto
# the long prompts, whose tail grows: every short request that slips past takes blocks a long prompt
# was waiting for. FCFS is fairer: the tails of both kinds stay close. This is why vLLM v1 stops at a
# head that does not fit; when some requests should go first, it says so explicitly, with priorities.
#
# ## 5. Exercise 7.1: priority scheduling
#
# With `StallFreeScheduler(..., policy="priority")` (vLLM's `scheduling_policy="priority"`) each
# request carries a `priority` (lower is more urgent, as in vLLM) and an `arrival_time`. Two places
# change, both in `kvcourse/scheduler.py`:
#
# * `_insert_by_priority(request)`: the waiting queue stays ordered by `(priority, arrival_time)`, so
#   admission, which still stops at the head, admits the most urgent first;
# * `_preempt_lowest_priority()`: when memory is short, the victim is the running request with the
#   largest `(priority, arrival_time)`, not the newest admission. You choose it; the given
#   `_preempt(victim)` releases it, as for Exercise 2.7, and under this policy it rejoins the queue at
#   its place by priority.
#
# One subtlety is handled for you: a decode already planned this step may belong to the request a later
# chunk preempts. It leaves the step's plan (its blocks are gone), its tokens go back to the budget, and
# since the plan is applied only once planning is done, nothing of it was ever counted as computed.

# %%
check("7.1")

# %%
priorities = serving.priority_study(rate=busy, num_requests=64)
print("policy     urgent TTFT p50   p99   others TTFT p50   p99  preemptions")
for name, row in priorities.items():
    print(
        f"{name:<10} {row['urgent_ttft_p50']:>16.2f} {row['urgent_ttft_p99']:>5.2f} {row['other_ttft_p50']:>17.2f} "
        f"{row['other_ttft_p99']:>5.2f} {row['preemptions']:>12}"
    )

# %% [markdown]
# One request in four is marked urgent. Under FCFS they wait like everyone else; under the priority
# policy their tail collapses, and the others pay a little. Priority does not create capacity: it
# chooses who waits.
#
# ## 6. Exercise 7.2: a watermark
#
# When everything arrives at once, notebook 06's memory study saw paged-16 recompute a large share of
# its trace: admission filled the cache, then running decodes needed one more block each and someone
# had to be preempted. A **watermark** admits a request only while, after its first chunk, at least
# `watermark_blocks` blocks stay free for the running decodes to grow into. vLLM v0's block manager had
# one (1% by default); vLLM v1 has one too, `--watermark` (`SchedulerConfig.watermark` in
# `vllm/config/scheduler.py`, a share of all blocks, 0 by default, so off), which
# `vllm/v1/core/kv_cache_manager.py` · `KVCacheManager.allocate_slots` applies to waiting and preempted
# requests, and only when some request is already scheduled. The course's rule, in the contract's words:
# the watermark holds only while some request is running; `_keeps_watermark` is also True when no
# request is running (the watermark protects running decodes; with none there, refusing could leave the
# request waiting forever). Write `_keeps_watermark` in `kvcourse/scheduler.py`.

# %%
check("7.2")

# %%
marks = serving.watermark_study((0.0, 0.05, 0.1, 0.2), rate=busy, num_requests=64)
print("watermark  preemptions  recomputed tokens  TTFT p99  TPOT p99")
for row in marks:
    print(
        f"{row['watermark']:>9} {row['preemptions']:>12} {row['recomputed_tokens']:>18} "
        f"{row['ttft_p99']:>9.2f} {row['tpot_p99']:>9.3f}"
    )

# %% [markdown]
# Recomputed tokens are work done twice (every token fed, minus each request's prompt and outputs
# fed once). A small watermark removes most preemptions and steadies TPOT; a large one keeps blocks
# idle, so requests wait longer to start. vLLM v1 leaves its watermark off by default; its admission is
# already conservative in another way: with `scheduler_reserve_full_isl` (on by default,
# `vllm/config/scheduler.py` · `SchedulerConfig.scheduler_reserve_full_isl`) it admits a request only
# when blocks for its **whole prompt** are free (after prefix-cache hits), not just for the first chunk,
# as ours does. A chunked prompt is then much less likely to stall halfway for want of memory. (The metric
# `vllm:watermark_requests` is about something else: text watermarking of outputs.)
#
# ## 7. Exercise 7.3: swap or recompute?
#
# A preempted request loses its K/V and recomputes it later (the course's default, and vLLM v1's only
# preemption mode). vLLM v0 could also **swap**: copy the victim's blocks to a CPU block pool and copy
# them back on re-admission. v1 moved the CPU copy out of preemption into a KV connector:
# `vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py` · `OffloadingConnector` offloads
# computed blocks to CPU memory and loads them back on a later prefix hit. Which is cheaper depends on the machine: a swap moves bytes twice over the
# host–device link, a recompute spends FLOPs once. In `kvcourse/scheduler.py`, write:
#
# * the mechanism, for `preemption_mode="swap"` with `num_cpu_blocks` of swap space: `_move_to_cpu`
#   (swap-out: the victim keeps its computed tokens if the CPU pool has room for their blocks) and
#   `_move_to_gpu` (swap-in: an admission that allocates GPU blocks for everything kept plus the next
#   chunk, all or nothing);
# * the cost model: `swap_seconds`, `recompute_seconds` and `swap_crossover` (the shortest context for
#   which swapping wins).

# %%
check("7.3")

# %% [markdown]
# **Predict:** GPT-2 small (124M parameters, 36,864 bytes of fp16 K/V per token) on an H200: about
# 400 TFLOP/s achieved on a prefill, a PCIe 5.0 x16 link at 64 GB/s with 10 µs per transfer. Is
# swapping ever cheaper than recomputing within GPT-2's 1,024-token context?

# %%
answer("7.c", None)

# %% collapsed=true jupyter={"outputs_hidden": true} tags=["hide-output"]
h200 = PreemptionCosts(
    kv_bytes_per_token=36_864,
    link_bytes_per_s=64e9,
    link_latency_s=10e-6,
    flops_per_token=2 * 124e6,
    flops_per_s=400e12,
)
print(
    f"H200, 1,024 tokens: swap {swap_seconds(1024, h200) * 1e3:.2f} ms, recompute {recompute_seconds(1024, h200) * 1e3:.2f} ms"
)
print(f"crossover within 1,024 tokens: {swap_crossover(h200, 1024)}")
sim = serving.simulated_preemption_costs()
link = serving.SWAP_LINK  # ASSUMED, not measured: a PCIe 4.0 x16 link's rate and a pessimistic fixed cost per swap
print(f"the simulated CPU machine: recompute {recompute_seconds(1, sim) * 1e3:.2f} ms per token;")
print(
    f"  swap over an assumed link of {link['link_bytes_per_s'] / 1e9:.0f} GB/s plus {link['link_latency_s'] * 1e3:.0f} ms "
    f"per transfer (pinning, copies, a synchronisation): crossover at {swap_crossover(sim, 1024)} tokens"
)

# %% [markdown]
# The last line is the course's simulated CPU machine (`kvcourse.bench.serving`): its link is an assumption, not a
# measurement (`SWAP_LINK` in `kvcourse/bench/serving.py`): a PCIe 4.0 x16 link's usable 25 GB/s, plus a fixed
# 20 ms per swap for pinning host memory, one copy per block and layer and a stream synchronisation, a
# pessimistic guess chosen so that the crossover falls inside GPT-2's prompt lengths and both sides show.
#
# At the assumed 400 TFLOP/s, GPT-2 small recomputes a token (0.62 µs) faster than the link moves its
# K/V out and back (1.15 µs): recompute wins at every context length. That is a **crossover**, not a
# law. By the same cost model (`swap_seconds`, `recompute_seconds` above), recompute costs
# `flops_per_token / flops_per_s` per token and swap about `2 × kv_bytes_per_token / link_bytes_per_s`,
# so swap wins for long enough contexts whenever the prefill achieves less than
# 2 × 124e6 × 64e9 / (2 × 36,864) ≈ 215 TFLOP/s (at 200 TFLOP/s from 228 tokens on; at 100 from 16).
# The model matters even more: an 8B model with grouped-query attention (32 layers, 8 K/V heads of
# 128: 131,072 bytes per token in fp16, 16 GFLOP per token) recomputes 1,024 tokens in 41 ms and swaps
# them in 4.2 ms, about ten times cheaper, from the first token on. GQA shrinks the K/V while the FLOPs
# stay. vLLM v1 still preempts by recompute only, and keeps CPU memory for the offloading connector
# above. On a CPU, compute is slow and swap wins early.
# The study below serves the same preemption-heavy workload (12 equal prompts arriving together into a
# cache that fits three at their longest) both ways, on the simulated machine, at prompt lengths around
# its crossover. Swap runs use the scheduler's `preemption_mode="swap"` with a CPU block pool; the toy
# executor keeps each request's K/V in its own list, which stands in for the CPU copy (the GPT-2 engine
# preempts by recompute only).

# %%
swap = serving.swap_study()  # prompt lengths from a quarter of the crossover to three times it
print(f"cost model's crossover: {swap['crossover_tokens']} tokens")
serving.print_swap_rows(swap["rows"])
agree = [row["agrees"] for row in swap["rows"] if row["agrees"] is not None]
print(f"the served runs agree with the cost model in {sum(agree)} of {len(agree)} rows with preemptions")

# %% [markdown]
# Compare each served run with the model's choice at the **victim's context**, not at the prompt
# length: a victim has usually generated some tokens by the time it is preempted, so its context is
# longer than its prompt, and the runs flip to swap at shorter prompts than the crossover. Where a
# run disagrees, look at the whole run: preemptions change who runs in which step, and a swap's
# transfers stall a step while a recompute's tokens ride along in steps that run anyway.
#
# ## 8. Exercise 7.4: abort
#
# A client disconnects; the server calls `scheduler.finish_requests([id], RequestStatus.ABORTED,
# reason)`. The name is vLLM's (`vllm/v1/core/sched/scheduler.py` · `Scheduler.finish_requests`), whose
# signature is `finish_requests(request_ids, finished_status)`, with no reason (the status says it:
# `RequestStatus.FINISHED_ABORTED`); the course adds a reason so the trace can say why. Its core,
# `_end_request`, is yours: a request cancelled while waiting or running gives back every block at
# once, and nothing else changes.

# %%
check("7.4")

# %%
scheduler = StallFreeScheduler(32, 4, MockKVCacheManager(num_blocks=16, block_size=4))
reqs = toy.toy_requests([9, 5, 7], max_new_tokens=6, seed=1)
for req in reqs:
    scheduler.add_request(req)
batch = scheduler.schedule_next_batch()
scheduler.update_from_output(batch, toy.ToyExecutor(block_size=4).execute(batch))
print(f"after one step: {scheduler.kv_cache_manager.get_num_free_blocks()} of 16 blocks free; {scheduler!r}")
scheduler.finish_requests([0], RequestStatus.ABORTED, "client went away")
print(f"R0 aborted:     {scheduler.kv_cache_manager.get_num_free_blocks()} of 16 blocks free; {scheduler!r}")
print(
    f"R0: {reqs[0].status.name}, {reqs[0].reason!r}; R1 still holds blocks {scheduler.kv_cache_manager.get_block_ids(reqs[1])}"
)

# %% [markdown]
# ## 9. Exercise 7.5: `reset_prefix_cache`
#
# After new weights are loaded, or before a cold-cache benchmark, every cached prefix must go: its
# K/V no longer matches. `KVCacheManager.reset_prefix_cache()` (vLLM's name) unpublishes every
# cached-free block. Like vLLM, it refuses (returns `False`, with a warning that says why, also kept in
# `manager.reset_refusal`) while any block is held by a request. (vLLM's scheduler can also force it:
# `Scheduler.reset_prefix_cache(reset_running_requests=True)` first preempts every running request.) Write `BlockPool.reset_prefix_cache`
# in `kvcourse/kv_cache.py`.

# %%
check("7.5")

# %%
manager = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
first = Request(0, list(range(1, 14)), 2)
manager.allocate_slots(first, first.num_tokens)
with warnings.catch_warnings():  # the refusal also warns (for a script); here its reason is printed
    warnings.simplefilter("ignore", UserWarning)
    print("while R0 holds its blocks:", manager.reset_prefix_cache(), "|", manager.reset_refusal)
manager.free(first)
probe = Request(1, list(range(1, 14)), 2)
print(f"after R0 ends: the same prompt finds {manager.get_computed_blocks(probe)[1]} cached tokens")
print("reset:", manager.reset_prefix_cache(), f"| now it finds {manager.get_computed_blocks(probe)[1]}")

# %% [markdown]
# ## 10. Where each knob lives in vLLM v1
#
# | here | vLLM v1 | what it trades |
# |---|---|---|
# | `token_budget` | `max_num_batched_tokens` (`--max-num-batched-tokens`) | TTFT against inter-token stalls |
# | (not built here: a chunk takes whatever budget is left) | `long_prefill_token_threshold` | one long prompt against everyone's steps |
# | `policy="priority"`, `Request.priority` | `scheduling_policy="priority"`, `priority=` per request | urgent requests' tails against the rest |
# | FCFS admission (stop at the head) | `scheduling_policy="fcfs"` (the default) | fairness against utilisation |
# | `watermark` | `--watermark` (`SchedulerConfig.watermark`, 0 = off by default); v0's block-manager watermark | preemptions against admissions |
# | first-chunk admission | `scheduler_reserve_full_isl` (on by default): the whole prompt must fit | admissions against stalls mid-prompt |
# | `preemption_mode="swap"` | v0's `preemption_mode="swap"`, `swap_space`; v1 recomputes, and offloads to the CPU through `OffloadingConnector` | link bytes against FLOPs |
# | `finish_requests(ids, ABORTED, reason)` | `Scheduler.finish_requests(request_ids, finished_status)` with `FINISHED_ABORTED` (abort on client disconnect) | nothing: memory back at once |
# | `reset_prefix_cache()` | `LLM.reset_prefix_cache()`; over HTTP `POST /reset_prefix_cache` (only with `VLLM_SERVER_DEV_MODE=1`; `?reset_running_requests=true` forces it by preempting the running requests first) | a cold cache on purpose |
#
# The same loop runs on a GPU with `WallClock()` in place of the simulated clock, and the whole study
# is one command: `python -m kvcourse.bench serving [--quick] [--json]`; its last line is a JSON object
# with every figure, per rate and per policy, the device and the date. Notebook 08 puts this engine
# behind an OpenAI-compatible server and measures the same TTFT and TPOT from real clients.

# %% [markdown]
# ## 11. Real arrivals: Mooncake's chat trace
#
# Every workload above was Poisson arrivals of made-up prompts. Notebook 04 replayed Mooncake's
# production chat trace through your prefix cache in request order only; here it is **served**, with
# its real arrival times, through your scheduler and your `KVCacheManager` with prefix caching, on the
# simulated clock of GPT-2 small on a CPU. Scaled to fit (`serving.trace_arrivals`):
#
# * **time**: the first 600 requests (201 s of the trace), at the times they arrived (1 trace second
#   = 1 simulated second);
# * **length**: every length divided by 64. A 512-token block becomes a block of 8 toy tokens drawn
#   from its hash id, so requests that share blocks in the trace share tokens here; outputs shrink by
#   the same factor (at least one token); prompts are cut at 112 blocks (896 tokens), so that prompt
#   and output fit GPT-2 small's 1,024 positions;
# * **memory**: a block of 8 toy tokens stands for 512 real ones, so 3,800 blocks are 1.95 M real
#   tokens, the KV cache of GPT-2 small on one 80 GB GPU (notebook 04), and 100,000 blocks are 51 M
#   tokens, a cluster's KV pool in the spirit of Mooncake's.
#
# The executor is the paged toy model, which reads every token's "K/V" back through the block tables:
# a wrong prefix hit would change the outputs, and the last column checks them all.
#
# One GPU's cache serves between 8 and 9% of these prompt tokens. Before you run the cell,
# **predict**: by how much does that cut the median TTFT: (a) under 10%, (b) 10 to 30%, (c) 30 to
# 60%, (d) over 60%?

# %%
answer("7.d", None)

# %% collapsed=true jupyter={"outputs_hidden": true} tags=["hide-output"]
study = serving.trace_prefix_caching(num_requests=600)
print(f"{study['truncated']} of {study['requests']} prompts cut at {serving.TRACE_MAX_BLOCKS} blocks")
serving.print_trace_rows(study)
off, gpu, pool = study["rows"]
print(
    f"one GPU's cache: {1 - gpu['tokens_fed'] / off['tokens_fed']:.0%} fewer tokens fed, "
    f"median TTFT {off['ttft_p50']:.2f} s -> {gpu['ttft_p50']:.2f} s; "
    f"the pool: {1 - pool['tokens_fed'] / off['tokens_fed']:.0%} fewer, {pool['ttft_p50']:.2f} s"
)

# %% [markdown]
# A hit rate under 10% looks like little, yet the median TTFT falls by about half. At these arrival
# times the engine runs near its knee (section 2): without caching, the median request waits over five
# seconds for its first token, most of it in the queue, and every prefill token the cache saves
# shortens the queue for everyone behind. The cluster-sized cache roughly doubles the hit rate and
# cuts the tail further. Its 17% is still far below the 37% of notebook 04's curve: this window is
# the trace's first three minutes, its cache starts cold, and a conversation's next turn comes back
# minutes later. That is Mooncake's argument seen from the user's side: the prefix cache is worth
# far more memory than one GPU has, because it buys back time to first token.
