# %% [markdown]
# # 01 · Continuous batching and its blind spot
#
# > **What to expect.** The outputs stored in this notebook come from the reference solutions; running a
# > cell replaces its output with your code's. Run All stops at your first unwritten exercise (its
# > `NotImplementedError`) and leaves the cells below it empty, so run the notebook cell by cell.
#
# A serving engine runs one model over many requests at once. **Continuous batching** re-plans the
# batch at every iteration: a request joins as soon as there is room and leaves the moment it is done,
# instead of the whole batch waiting for its slowest member. **Chunked prefill** cuts a long prompt
# into pieces so that it never stalls the decodes of the requests already running: that is why the
# scheduler of the previous lesson is called `StallFreeScheduler`.
#
# That scheduler plans with two numbers only: a **token budget** (how many tokens one forward pass may
# take) and a **maximum batch size**. It never asks whether the keys and values (the KV cache) of the
# requests it admits fit in GPU memory. This notebook makes that blind spot visible:
#
# 1. a deterministic **toy model** stands in for GPT-2, so that runs are instant and reproducible;
# 2. you write **the engine's step**, the loop every serving engine runs (Exercise 1.1, about 15 minutes);
# 3. the memory-blind scheduler serves a small workload through your step, drawn as an **iteration timeline**;
# 4. a **memory meter** shows the KV cache its plan needs climbing past what the GPU can hold.
#
# Exercise 1.1 states a **contract** (what must be true when your code returns), not the statements to
# write; run `check("1.1")` after it. Stuck? `hint("1.1")` nudges, `hint("1.1", level=2)` gives the
# approach in words, and `solution("1.1")` shows the reference. Twice you are asked to **predict**
# before the cell that shows the answer: `answer("1.a", None)` says what is asked; replace `None` with
# your guess and run it (it is graded on the scoreboard, beside the exercises). Notebook 02 fixes the
# blind spot.

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
import inspect

import matplotlib.pyplot as plt

from kvcourse import answer, check, hint, solution, toy, viz  # noqa: F401  (hint, solution: for you)
from kvcourse.viz import diagrams

# %% [markdown]
# ## 1. A toy model that remembers everything
#
# A real model predicts the next token from the keys and values of **every** earlier token: that is
# exactly what the KV cache stores. Our toy model keeps that property and drops the arithmetic: its
# next token is a hash of the whole context, modulo a vocabulary of 1,000 ids.
#
# * The same context always gives the same token, so any scheduler, however it slices the work, must
#   produce the same outputs as generating each request alone (`toy.toy_generate`).
# * The executor (`toy.ToyExecutor`) stores each fed token in a simulated cache at the position the
#   scheduler gives it, and samples from what it has stored. Feed a wrong token or a wrong position
#   and the outputs change, or it stops with an error that says what went wrong.

# %%
prompt = [17, 4, 256, 9]
print("next token after", prompt, "->", toy.toy_next_token(prompt))
print("again, same context ->", toy.toy_next_token(prompt))
print("one token changed    ->", toy.toy_next_token([17, 4, 255, 9]))
print("5 tokens, generated alone:", toy.toy_generate(prompt, max_new_tokens=5))

# %% [markdown]
# ## 2. The memory-blind scheduler
#
# Each iteration, `BlindStallFreeScheduler.schedule_next_batch` fills the token budget in a fixed
# order:
#
# 1. **decodes first**: every running request whose prompt is done feeds its newest token (1 token);
# 2. **the prefill in progress**: a running request whose prompt is not fully processed gets the next
#    chunk, as big as the remaining budget;
# 3. **admissions**: waiting requests join, head of the queue first, while the budget and the batch
#    size allow; the last one admitted may get only a first chunk of its prompt.
#
# The prefill chunk that reaches the end of the prompt **samples the first output token**, and every
# sequence's positions start at the number of tokens already processed (`num_computed_tokens`). Here is
# the whole planner: notice that nothing in it mentions memory.

# %%
print(inspect.getsource(toy.BlindStallFreeScheduler.schedule_next_batch))

# %% [markdown]
# One iteration's batch, for a budget of 32 tokens: three decodes, the rest of a chunked prompt, and
# the first chunk of a newcomer.

# %%
# Figure: One iteration's batch for a budget of 32 tokens: three decodes, the rest of a chunked prompt and a newcomer's first chunk.
diagrams.iteration_batch()

# %% [markdown]
# ## 3. The loop every engine runs
#
# A scheduler only plans. Something has to turn plans into tokens, iteration after iteration: the
# engine's **step**. vLLM's `EngineCore.step` and nano-vllm's `LLMEngine.step` are the same three calls:
#
# 1. **schedule**: the scheduler plans this iteration's batch (and, from notebook 02 on, secures the
#    KV-cache blocks for it);
# 2. **execute**: the executor (the model) runs the batch and samples one token for each sequence that
#    asks for one;
# 3. **update**: the scheduler takes those tokens in, and says which requests just finished.
#
# Everything else is bookkeeping, and the course's `EngineCore` (`kvcourse/engine/llm_engine.py`) does it for you:
# it records each step (the timelines below are drawn from those records), times each phase, and if a
# phase fails it fails only the requests that phase touched, gives their memory back and keeps the
# engine alive. The same step drives the toy world here, the GPT-2 engine of notebook 05 and the server
# of notebook 08.

# %%
# Figure: The engine's step loop: schedule, execute, update; a failing phase fails only the requests it touched.
diagrams.engine_step_loop()

# %% [markdown]
# ### Exercise 1.1: the engine's step
#
# Write `engine_step(core)` in `kvcourse/step.py`. Its comment is the contract: one plan (the
# scheduler's `SchedulerOutput`), that plan run whole by the executor, exactly its tokens handed back to
# the update, and the update's answer (the finished requests) returned; each call inside its own
# `core.phase(...)`; an empty plan is a `Deadlock`, not an endless loop. Everything the executor needs
# travels in the plan: the tokens and positions, each request's block table, the block copies to make
# first (notebook 04), so the step never goes back to ask the KV-cache manager.

# %%
check("1.1")

# %% [markdown]
# ## 4. A workload, and its timeline
#
# Eight requests with prompts of 40 to 200 tokens want 24 to 80 new tokens each. The scheduler may feed
# 128 tokens per iteration and run 6 requests at a time.

# %%
PROMPT_LENGTHS = [120, 40, 200, 90, 150, 60, 180, 100]
MAX_NEW_TOKENS = [64, 24, 48, 80, 32, 64, 40, 56]

requests = toy.toy_requests(PROMPT_LENGTHS, max_new_tokens=MAX_NEW_TOKENS, seed=0)
scheduler = toy.BlindStallFreeScheduler(token_budget=128, max_batch_size=6)
for request in requests:
    scheduler.add_request(request)

trace = toy.run(scheduler)
print(f"{len(trace.steps)} iterations. First ones (Rn = request n, @ = positions, * = samples a token):")
print(trace.format(limit=8))

# %% [markdown]
# **Predict.** The scheduler cut long prompts into chunks and interleaved eight requests. Are the outputs
# the same as generating each request alone, with nothing else running? Answer `"yes"` or `"no"`.

# %%
answer("1.a", None)

# %% [markdown]
# Every request finished, and the outputs are exactly those of generating each request alone:
# slicing prompts into chunks and interleaving requests changes nothing, because every token is
# computed from the full context in the cache.

# %% collapsed=true jupyter={"outputs_hidden": true} tags=["hide-output"]
same = all(r.output_tokens == toy.toy_generate(r.prompt_tokens, r.max_new_tokens) for r in requests)
print("outputs equal to generating each request alone:", same)

# %% [markdown]
# The timeline shows who runs in each iteration: tall bars are prefill chunks, thin bars decodes, a
# black tick the iteration where a request finished. New requests start as soon as a seat in the batch
# is free (continuous batching), and long prompts are spread over several iterations while the others
# keep decoding (chunked prefill).

# %%
# Figure: Timeline of the toy run: each row a request, prefill and decode iterations, a tick where it finished.
viz.plot_timeline(trace)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 5. The blind spot: the plan needs more memory than there is
#
# Every token a running request has processed keeps its keys and values in the KV cache until the
# request finishes. For GPT-2 small in fp16 that is 36,864 bytes per token (notebook 00). Suppose our
# GPU slice can hold **768 tokens** of KV cache (48 blocks of 16 tokens, about 27 MiB). The scheduler
# does not know this number.
#
# **Predict.** Six requests run at once, with prompts of 40 to 200 tokens that grow by one token per
# decode. At its peak, the plan needs (a) less than 768 tokens of KV cache, (b) up to 10% more,
# (c) 10 to 50% more, or (d) over 50% more?

# %%
answer("1.b", None)

# %% [markdown]
# Here is what the plan needs at each iteration.

# %% collapsed=true jupyter={"outputs_hidden": true} tags=["hide-output"]
CAPACITY_TOKENS = 48 * 16

for step in trace.steps[:70:6]:
    print(f"iteration {step.iteration:>3}  {viz.memory_meter(step.resident_tokens, CAPACITY_TOKENS)}")

# %%
# Figure: KV tokens the plan holds at each iteration, against the cache's capacity.
viz.plot_memory(trace, CAPACITY_TOKENS)
plt.tight_layout()
plt.show()

over = [step for step in trace.steps if step.resident_tokens > CAPACITY_TOKENS]
print(
    f"The plan does not fit in {len(over)} of {len(trace.steps)} iterations, first at iteration "
    f"{over[0].iteration}; at its peak it needs {trace.peak_resident_tokens} tokens of KV cache "
    f"({trace.peak_resident_tokens - CAPACITY_TOKENS} more than there is)."
)

# %% [markdown]
# On a real GPU the red region is an out-of-memory error, or worse, keys and values written over
# another request's. The scheduler admitted six requests because the **token budget** and the **batch
# size** allowed it; both say nothing about how long each request will grow. Decodes make it worse:
# every decode adds one token per running request, so a plan that fits at admission stops fitting a
# few dozen iterations later.
#
# ### Try it
#
# Change the numbers in the workload cell and rerun the cells below it:
#
# * a smaller `max_batch_size` keeps the plan under the line, but leaves memory idle when prompts are short;
# * larger `MAX_NEW_TOKENS` push the peak higher, long after admission.
#
# No fixed budget or batch size is right for every workload. The scheduler has to **ask** for memory
# before it schedules a token, and give it back when a request finishes. That conversation is the
# **scheduler–cache contract**, and it is notebook 02.
