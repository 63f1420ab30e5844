# %% [markdown]
# # 08 · Serve it
#
# > **What to expect.** The outputs stored in this notebook come from the reference solutions; running a
# > cell replaces its output with your code's. Run All stops at your first unwritten exercise (its
# > `NotImplementedError`) and leaves the cells below it empty, so run the notebook cell by cell.
#
# Seven notebooks built an engine that runs a Python list of prompts to completion. Real users do not
# arrive as a list: they open connections, one at a time, whenever they like, and some of them hang up
# halfway. This capstone puts your engine behind the same kind of server vLLM runs (`vllm serve`):
#
# - an **OpenAI-compatible API** (`POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`),
#   so the official `openai` client talks to it, with the parameters real tools send: `temperature`,
#   `top_p`, `seed`, `n`, `stop`, `logprobs`...;
# - **streaming**: each token leaves as a server-sent event the step it is sampled;
# - **one engine loop** that steps while any request is unfinished: continuous batching, now with
#   requests that come and go while it runs;
# - **`/metrics`** for Prometheus, and `/debug/blocks` so the block-table widget can watch the cache.
#
# Nothing to fill in: the server (`kvcourse/serve/`) drives *your* `scheduler.py`, `kv_cache.py`,
# `attention.py` and `model_runner.py`. If they pass their checks, everything below works; if one does
# not, this is where you will see it under real load. Six times you are asked to **predict** before the
# cell that shows the answer: `answer("8.a", None)` says what is asked; replace `None` with your guess
# and run it (it is graded on the scoreboard, beside the exercises).

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
import textwrap
import threading
import time

import httpx
import ipywidgets as widgets
import matplotlib.pyplot as plt
import openai
import torch
from IPython.display import display

from kvcourse import answer
from kvcourse.bench import serving
from kvcourse.engine.llm_engine import hf_greedy
from kvcourse.models.registry import chat_prompt
from kvcourse.serve import ServerThread, build_app
from kvcourse.serve.blocks import snapshot_from_json, take_snapshot
from kvcourse.serve.detokenize import decode
from kvcourse.serve.loadgen import format_summary, request_times, run_load, summarize
from kvcourse.serve.metrics import metric, parse_metrics
from kvcourse.viz.widgets import BlockTableWidget, render_html

torch.set_num_threads(1)  # the tiny model's matrices are small: one thread is fastest on a shared CPU

# %% [markdown]
# ## 1. The shape of a server
#
# ```
#  clients ──HTTP──▶ event loop (FastAPI on uvicorn)          engine thread (owns the LLMEngine)
#                    ─ parse, validate, tokenize              ─ run commands: add, abort
#                    ─ post "add request" ───── inbox ──────▶ ─ step(): schedule → execute → update
#                    ─ read the request's queue ◀── tokens ── ─ hand each request its new tokens
#                    ─ send `data: {...}` chunks, then `data: [DONE]`
# ```
#
# Two rules keep it correct. **Only the engine thread touches the engine**: handlers post commands to
# its inbox and it runs them between steps, so the scheduler never sees a half-added request. And
# **a request's life ends in exactly one place**: finished (its length, or end of text), aborted
# (its client left) or failed (a step raised); in each case its blocks go back before the next step.
# vLLM draws the same line with a process boundary: `AsyncLLM` in the API server, `EngineCore` in its
# own process, talking over sockets.
#
# Start one. `build_app` makes an `LLMEngine` from your modules; `ServerThread` runs uvicorn in a
# background thread on a free port of 127.0.0.1 (the command line, `./course serve`, does the same in
# the foreground). The cache is kept small on purpose, 12 blocks of 16 tokens, so that sixteen clients
# must share it.
#
# This first server runs the course's **tiny** model: GPT-2's shape with 2 layers and random weights. Its
# steps take about a millisecond, so the load, the metrics and the timings below run in seconds; its text
# is gibberish, so this notebook never shows it: it compares its token ids with Hugging Face's instead.
# Where you read text (the end of section 2, the chat section and section 6), a second server serves
# the real chat model, **SmolLM2**.

# %%
NUM_BLOCKS, BLOCK_SIZE = 12, 16
app = build_app("tiny", num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, token_budget=64, max_batch_size=6)
server = ServerThread(app).start()
engine = server.engine_loop.engine  # in-process, so we may also look at the engine object itself
client = openai.OpenAI(base_url=server.url + "/v1", api_key="not-needed", max_retries=0, timeout=60)
print("serving", [m.id for m in client.models.list().data], "on 127.0.0.1, port chosen by the OS")
health = httpx.get(server.url + "/health").json()  # what GET /health answers (a load balancer polls it)
print(
    f"health: {health['status']}; requests running {health['num_running']}, waiting {health['num_waiting']}; "
    f"KV blocks free {health['num_free_blocks']} of {health['num_blocks']} ({health['block_size']} tokens each, "
    f"{health['kv_cache_usage']:.0%} in use); preemptions {health['num_preemptions']}, engine steps {health['steps']}; "
    f"engine loop alive: {health['loop_alive']}, last error: {health['last_error']}"
)

# %% [markdown]
# ## 2. One client, one request
#
# The official `openai` package, pointed at our server. Like OpenAI's API (and vLLM), the server
# *samples* at temperature 1 when a request says nothing; `temperature=0` asks for greedy decoding, and
# then the answer must be exactly what Hugging Face's `generate` gives for this prompt alone.
# `return_token_ids` (a vLLM extra field) lets us compare token ids, not only text (the tiny model's text
# is gibberish, reproducible gibberish: we count it, we do not print it). `ignore_eos` keeps going past
# end-of-text, as benchmarks do; without it, generation stops at the end-of-text token with
# `finish_reason="stop"`.

# %%
prompt = "The KV cache of a serving engine"
reply = client.completions.create(
    model="tiny",
    prompt=prompt,
    max_tokens=12,
    temperature=0,
    extra_body={"ignore_eos": True, "return_token_ids": True},
)
choice = reply.choices[0]
expected = hf_greedy(engine.model, engine.tokenizer.encode(prompt), 12)
print("new tokens:   ", len(choice.model_extra["token_ids"]), "| characters of text:", len(choice.text))
print("finish_reason:", choice.finish_reason, "| usage:", reply.usage.prompt_tokens, "+", reply.usage.completion_tokens)
print("token ids equal HF greedy:", choice.model_extra["token_ids"] == expected)
print("text equals the decoded HF tokens:", choice.text == decode(engine.tokenizer, expected))

# %% [markdown]
# Now streamed. Each chunk is one engine step's worth of this request's tokens: the first comes from
# the prefill step, then one per decode step. Text is sent only once it is whole: byte-level tokens
# (GPT-2's, SmolLM2's) can split a character in two, and the server holds the first half back
# (`kvcourse/serve/detokenize.py`); a chunk may then carry no text at all.

# %%
stream = client.completions.create(
    model="tiny",
    prompt=prompt,
    max_tokens=8,
    temperature=0,
    stream=True,
    extra_body={"ignore_eos": True, "return_token_ids": True},
)
for chunk in stream:
    c = chunk.choices[0]
    print(
        f"chunk: token ids {c.model_extra['token_ids']!s:<9} characters {len(c.text):>2}   finish_reason {c.finish_reason}"
    )

# %% [markdown]
# On the wire that is plain server-sent events, one `data:` line per chunk, and `data: [DONE]` at the end:

# %%
body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True, "ignore_eos": True}
with httpx.stream("POST", server.url + "/v1/completions", json=body) as response:
    print("content-type:", response.headers["content-type"])
    for line in response.iter_lines():
        if line:
            print(line if line == "data: [DONE]" else line[:60] + " ...")

# %% [markdown]
# ### The same API on a real model: SmolLM2
#
# A second server, the same code, serving **SmolLM2-135M-Instruct** (`build_app("smollm2")`: notebook
# 05's chat model). It is an instruct model: a question goes through its chat template, and it answers
# until its end-of-turn token `<|im_end|>`, where the server stops the request (`finish_reason="stop"`)
# unless `ignore_eos` says otherwise. `/v1/completions` takes the templated prompt as token ids; the
# next subsection lets the server apply the template itself. Greedy, the answer must again be exactly
# Hugging Face's `generate`, end-of-turn token included.

# %%
smol_server = ServerThread(
    build_app("smollm2", num_blocks=64, block_size=BLOCK_SIZE, token_budget=256, max_batch_size=8)
).start()
smol_engine = smol_server.engine_loop.engine
smol = openai.OpenAI(base_url=smol_server.url + "/v1", api_key="not-needed", max_retries=0, timeout=120)
print("serving", [m.id for m in smol.models.list().data])


def ask(question: str) -> list[int]:
    """A user's question through SmolLM2's chat template: the prompt's token ids."""
    return chat_prompt(smol_engine.tokenizer, [{"role": "user", "content": question}])


question = ask("What is the capital of France?")
reply = smol.completions.create(
    model="smollm2", prompt=question, max_tokens=32, temperature=0, extra_body={"return_token_ids": True}
)
choice = reply.choices[0]
with torch.inference_mode():
    expected = smol_engine.model.generate(torch.tensor([question]), do_sample=False, max_new_tokens=32)
print("text:         ", repr(choice.text))
print("finish_reason:", choice.finish_reason, "| usage:", reply.usage.prompt_tokens, "+", reply.usage.completion_tokens)
print("token ids equal HF generate:", choice.model_extra["token_ids"] == expected[0, len(question) :].tolist())

# %% [markdown]
# Streamed, a chunk per step, each with the text its tokens completed:

# %%
stream = smol.completions.create(
    model="smollm2", prompt=ask("Name three primary colors."), max_tokens=32, temperature=0, stream=True
)
for chunk in stream:
    c = chunk.choices[0]
    print(f"chunk: {c.text!r:<12} finish_reason {c.finish_reason}")

# %% [markdown]
# ### Chat: messages in, the assistant's message out
#
# Chat clients do not template prompts themselves: they send **messages** to `POST /v1/chat/completions`,
# and the server applies the model's chat template (`kvcourse/serve/chat.py`; vLLM's `serving_chat` does
# the same). Everything else (sampling, `n`, `stop`, `logprobs`, streaming) is the completions machinery
# unchanged; only the reply's shape differs: a `message`, or streamed `delta`s whose first one carries the
# role. `GET /v1/models` lists what a server serves; `openai`'s `client.models.list()` reads it.

# %%
print("GET /v1/models:", [(m.id, m.owned_by) for m in smol.models.list().data])
messages = [{"role": "user", "content": "Write one sentence about a cat."}]
chat = smol.chat.completions.create(model="smollm2", messages=messages, max_tokens=32, temperature=0)
print(f"{chat.choices[0].message.role}: {chat.choices[0].message.content}")
print(
    "finish_reason:",
    chat.choices[0].finish_reason,
    "| usage:",
    chat.usage.prompt_tokens,
    "+",
    chat.usage.completion_tokens,
)

# %%
stream = smol.chat.completions.create(
    model="smollm2",
    messages=[{"role": "user", "content": "What is the capital of France?"}],
    max_tokens=32,
    temperature=0,
    stream=True,
)
for chunk in stream:
    delta = chunk.choices[0].delta
    print(f"delta: role {delta.role!s:<9} content {delta.content!r:<12} finish_reason {chunk.choices[0].finish_reason}")

# %% [markdown]
# ## 3. Many clients: watch the running set and the block table
#
# Sixteen clients arrive at once, each streaming its own completion. The cache holds 12 blocks, the
# batch 6 requests: some wait, some run, and a request that needs one more block when none is free
# preempts the most recent one (lesson 02). The engine thread calls `on_step` after every step, and we
# record a snapshot of the cache there; meanwhile the cell polls `GET /debug/blocks`, as any client
# could, and redraws the grid live.
#
# **Predict first.** Sixteen requests of up to 62 tokens each, at most 6 running at a time, in 12 blocks:
# requests will wait, and some will be preempted and recomputed. The grid at the end of the next cell
# shows the answers, so guess before you run it.
#
# *8.a* Of the sixteen completions, how many equal Hugging Face's greedy answer for their prompt alone?

# %%
answer("8.a", None)

# %% [markdown]
# *8.b* Once all sixteen clients have finished, how many of the 12 blocks are free?

# %%
answer("8.b", None)

# %% [markdown]
# Now the sixteen clients.

# %% collapsed=true jupyter={"outputs_hidden": true} tags=["nbval-ignore-output", "hide-output"]
prompts = [engine.tokenizer.encode(f"Request {i} asks the server for a story about block {i * 7}.") for i in range(16)]
lengths = [12 + (7 * i) % 37 for i in range(16)]
snapshots, running_sizes = [], []


def record(engine) -> None:
    """Called by the engine thread after each step: keep the cache's picture and the running set."""
    running = list(engine.scheduler.active_pool)
    snapshots.append(take_snapshot(engine, f"step {len(snapshots) + 1}: running {running}"))
    running_sizes.append((len(running), len(engine.scheduler.waiting_queue)))


server.engine_loop.on_step = record
live = widgets.HTML()
display(live)
results_box = {}
load = threading.Thread(target=lambda: results_box.update(out=run_load(server.url + "/v1", prompts, lengths, "tiny")))
load.start()
deadline = time.monotonic() + 120
while load.is_alive() and time.monotonic() < deadline:
    live.value = render_html(snapshot_from_json(httpx.get(server.url + "/debug/blocks").json()))
    time.sleep(0.05)
load.join()
server.engine_loop.on_step = None
live.value = render_html(snapshot_from_json(httpx.get(server.url + "/debug/blocks").json()))
results, seconds = results_box["out"]
print(f"{len(results)} requests finished in {seconds:.2f} s over {len(snapshots)} engine steps")
print("preemptions so far:", engine.scheduler.num_preemptions)

# %% [markdown]
# The answers: every completion against Hugging Face greedy for its prompt alone, and the cache
# afterwards.

# %%
same = [r.token_ids == hf_greedy(engine.model, prompts[r.index], lengths[r.index]) for r in results]
state = httpx.get(server.url + "/health").json()
print(f"{sum(same)} of {len(same)} completions equal HF greedy for their prompt alone")
print(f"free blocks after: {state['num_free_blocks']} of {state['num_blocks']}; running {state['num_running']}")

# %% [markdown]
# Replay it step by step (the widget from lesson 03, fed by the server's engine thread). Colours are
# requests; watch a finished request's blocks turn free and a waiting one take them the next step.

# %% tags=["nbval-ignore-output"]
BlockTableWidget(snapshots, step=min(10, len(snapshots) - 1), interval_ms=300)

# %% tags=["nbval-ignore-output"]
# Figure: Continuous batching through the server: the running set, step by step, as clients come and go.
fig, ax = plt.subplots(figsize=(8, 2.8))
ax.stackplot(
    range(1, len(running_sizes) + 1),
    [r for r, _ in running_sizes],
    [w for _, w in running_sizes],
    labels=["running", "waiting"],
)
ax.set(xlabel="engine step", ylabel="requests", title="Continuous batching: the running set as clients come and go")
ax.legend(loc="upper right")
plt.show()

# %% [markdown]
# ## 4. What `/metrics` says
#
# Prometheus scrapes `GET /metrics` as text. Where a series means what vLLM's means, it has vLLM's
# name, type and labels (checked against vLLM 0.33's `PrometheusStatLogger`): `vllm:num_requests_running`,
# `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (gauges); `vllm:num_preemptions`,
# `vllm:prompt_tokens`, `vllm:generation_tokens`, `vllm:prefix_cache_queries`, `vllm:prefix_cache_hits`
# and `vllm:request_success{finished_reason=...}` (counters); `vllm:time_to_first_token_seconds`,
# `vllm:inter_token_latency_seconds`, `vllm:request_time_per_output_token_seconds` and
# `vllm:e2e_request_latency_seconds` (histograms, with our own bucket edges). A panel built on those
# reads either server. vLLM has no free-block count and no hit-rate gauge, so `kvcourse:num_free_blocks`
# and `kvcourse:num_blocks` are ours, and the hit rate is hits / queries, computed as on vLLM's dashboards.
# Counters only ever grow: they count everything since the server started.
#
# *8.c* How many requests does `vllm:request_success_total{finished_reason="length"}` count now,
# after sections 2 and 3?

# %%
answer("8.c", None)

# %% [markdown]
# The counters add up: the two single requests, the two-token SSE request and the sixteen clients (this
# is the tiny model's server; SmolLM2's server keeps its own counters).

# %% collapsed=true jupyter={"outputs_hidden": true} tags=["hide-output"]
values = parse_metrics(httpx.get(server.url + "/metrics").text)
for name, labels in (
    ("vllm:num_requests_running", {}),
    ("vllm:num_requests_waiting", {}),
    ("vllm:kv_cache_usage_perc", {}),
    ("kvcourse:num_free_blocks", {}),
    ("vllm:request_success_total", {"finished_reason": "length"}),
    ("vllm:generation_tokens_total", {}),
    ("vllm:time_to_first_token_seconds_count", {}),
):
    shown = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    print(f"{shown:<62} {metric(values, name, **labels):g}")
print("every series is labelled like vLLM's:", next(k for k in values if k.startswith("vllm:num_requests_running")))

# %% tags=["nbval-ignore-output"]
print(f"{'vllm:num_preemptions_total':<62} {metric(values, 'vllm:num_preemptions_total'):g}")
ttft_sum = metric(values, "vllm:time_to_first_token_seconds_sum")
print(f"mean TTFT so far: {1000 * ttft_sum / metric(values, 'vllm:time_to_first_token_seconds_count'):.0f} ms")

# %% [markdown]
# ## 5. A client that hangs up
#
# A user closes the tab mid-answer. The server notices the connection close (it watches the ASGI
# `http.disconnect` message, not only failed sends: a request still waiting in the queue sends
# nothing), aborts the request, and its blocks go back before the next step. Without that, every
# abandoned request would keep its blocks until it had generated all its tokens for nobody.

# %%
body = {"model": "tiny", "prompt": prompt, "max_tokens": 150, "temperature": 0, "stream": True, "ignore_eos": True}
engine_step = engine.step


def slow_step(*args, **kwargs):
    """20 ms more per step, so that the request is surely still mid-answer when the client leaves."""
    time.sleep(0.02)
    return engine_step(*args, **kwargs)


engine.step = slow_step
with httpx.stream("POST", server.url + "/v1/completions", json=body) as response:
    lines = response.iter_lines()
    for _ in range(4):
        next(lines)  # two chunks (each is followed by an empty line)
    held = NUM_BLOCKS - httpx.get(server.url + "/health").json()["num_free_blocks"]
    print("mid-stream, the request holds blocks:", held > 0)
deadline = time.monotonic() + 30
while httpx.get(server.url + "/health").json()["num_free_blocks"] < NUM_BLOCKS and time.monotonic() < deadline:
    time.sleep(0.02)
del engine.step  # the engine's own step again
values = parse_metrics(httpx.get(server.url + "/metrics").text)
print(
    "after the client left: free blocks", httpx.get(server.url + "/health").json()["num_free_blocks"], "of", NUM_BLOCKS
)
print("aborted requests:", metric(values, "vllm:request_success_total", finished_reason="abort"))

# %% [markdown]
# ## 6. Sampling, and n completions through the prefix cache
#
# A sampled request draws its next token instead of taking the most likely one. The engine's sampler
# (`kvcourse/worker/sampler.py`, after vLLM's `vllm/v1/sample/sampler.py`) does it for the whole batch at
# once, row by row with each request's `SamplingParams`: presence, frequency and repetition penalties,
# then temperature, the top-k and top-p masks, and one draw per row. Each request draws from its own
# `torch.Generator`, seeded from `seed`, so the same seed gives the same tokens whatever else shares
# the batch: below, on the SmolLM2 server, the third run shares its steps with four other sampled clients.

# %%
story = ask("Write one sentence about a dog.")
sampled = {"model": "smollm2", "prompt": story, "max_tokens": 24, "temperature": 0.8, "top_p": 0.9, "seed": 7}
first = smol.completions.create(**sampled).choices[0].text
again = smol.completions.create(**sampled).choices[0].text
crowd_prompts = [ask(f"Tell me a fact about the number {i}.") for i in range(4)]
crowd = threading.Thread(
    target=run_load,
    args=(smol_server.url + "/v1", crowd_prompts, 24, "smollm2"),
    kwargs={"sampling": {"temperature": 1.0}},
)
crowd.start()
deadline = time.monotonic() + 60
while smol_server.engine_loop.state.num_running == 0 and time.monotonic() < deadline:
    time.sleep(0.002)  # until the crowd is in the engine
crowded = smol.completions.create(**sampled).choices[0].text
crowd.join()
other = smol.completions.create(**{**sampled, "seed": 8}).choices[0].text
print(f"seed 7:             {first!r}")
print(f"seed 7 again:       {again!r}  equal: {again == first}")
print(f"seed 7 in a crowd:  {crowded!r}  equal: {crowded == first}")
print(f"seed 8:             {other!r}")

# %% [markdown]
# `n=4` asks for four completions of one prompt. vLLM v1 fans such a request out into four child
# requests (`vllm/v1/engine/parallel_sampling.py` · `ParentRequest`; child *i* samples with seed + *i*),
# and so does this server: the children are added in one command, so they are scheduled in the same
# step, and with prefix caching on (the server's default, as in vLLM v1) the other three find the first
# child's full prompt blocks in the cache. The prompt below (on the SmolLM2 server, which also uses blocks
# of 16) is 40 tokens: two full blocks of 16, and 8 tokens in a third.
#
# *8.e* How many prompt tokens will the prefix cache count as hits for this one request?

# %%
answer("8.e", None)

# %% [markdown]
# *8.f* Notebook 04's fork shares a parent's blocks, its partly filled last block too, and copies that
# block only when a child first writes into it (copy-on-write). Through the prefix cache, how many
# physical blocks hold the 40 prompt tokens across the four children: (a) 3, as with a fork; (b) 6: the
# two full blocks shared, and each child's own third block; (c) 12: nothing is shared?

# %%
answer("8.f", None)

# %% [markdown]
# The request, streamed, with a snapshot of the cache taken while its four children run.

# %% collapsed=true jupyter={"outputs_hidden": true} tags=["hide-output"]
poet = [  # its own system prompt: no earlier request on this server began like it, so no block is cached yet
    {"role": "system", "content": "You are a poet who writes very short poems about nature."},
    {"role": "user", "content": "Write me a short poem about the sea and the moon, please."},
]
shared_prompt = chat_prompt(smol_engine.tokenizer, poet)  # 40 tokens through the chat template
assert len(shared_prompt) == 40, len(shared_prompt)
smol_metrics = smol_server.url + "/metrics"
hits_before = metric(parse_metrics(httpx.get(smol_metrics).text), "vllm:prefix_cache_hits_total")
body = {"model": "smollm2", "prompt": shared_prompt, "max_tokens": 24, "n": 4, "seed": 3, "stream": True}
smol_step = smol_engine.step


def slow_smol_step(*args, **kwargs):
    """20 ms more per step, so that the snapshot surely finds the four children running."""
    time.sleep(0.02)
    return smol_step(*args, **kwargs)


smol_engine.step = slow_smol_step
with httpx.stream("POST", smol_server.url + "/v1/completions", json=body, timeout=120) as response:
    events = (json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {"))
    first_chunk = next(events)
    shared_snapshot = snapshot_from_json(httpx.get(smol_server.url + "/debug/blocks").json())
    chunks = [first_chunk, *events]
del smol_engine.step
hits = metric(parse_metrics(httpx.get(smol_metrics).text), "vllm:prefix_cache_hits_total") - hits_before
parent = int(first_chunk["id"].removeprefix("cmpl-"))
children = range(parent, parent + 4)
in_all = set.intersection(*(set(shared_snapshot.tables[rid]) for rid in children))
for rid in children:  # which physical block each is depends on the cache's history; whether it is shared does not
    prompt_part = shared_snapshot.tables[rid][:3]  # the blocks that hold the 40 prompt tokens
    print(f"child R{rid}, prompt blocks:", ["shared by all 4" if b in in_all else "its own" for b in prompt_part])
print("reference counts of the shared blocks:", [shared_snapshot.blocks[b].ref_cnt for b in sorted(in_all)])
prompt_blocks = {b for rid in children for b in shared_snapshot.tables[rid][:3]}
print(f"physical blocks holding the 40 prompt tokens: {len(prompt_blocks)}")
print(f"prefix-cache hits for this request: {hits:g} tokens")
texts: dict[int, str] = {}
for chunk in chunks:
    texts[chunk["choices"][0]["index"]] = texts.get(chunk["choices"][0]["index"], "") + chunk["choices"][0]["text"]
for index, text in sorted(texts.items()):
    print(f"choice {index}: {text!r}")

# %% tags=["nbval-ignore-output"]
display(widgets.HTML(render_html(shared_snapshot)))  # the block-table widget: the shared blocks are in four rows

# %% [markdown]
# The first two blocks are in all four block tables (their reference count is 4); each child has its
# own third block (the children's answers differ: each samples with its own seed). That is where the
# prefix cache and notebook 04's fork differ. A block's hash covers
# all of its tokens, so only *full* blocks can be found in the cache: each child recomputes the
# 8-token tail itself (3 × 8 tokens of prefill a fork would not spend) and holds that block from the
# start, where a fork shares it and copies it at the first write. vLLM v1 chose the prefix cache for
# `n`: one mechanism for every kind of sharing, at the price of at most `block_size - 1` tokens of
# recompute per child.
#
# ### Stop strings and logprobs
#
# `stop` (up to four strings) ends a completion where the first of them appears in the detokenized
# text; the stop string is not returned, `finish_reason` is `"stop"`, and the request ends in the
# engine too, so its blocks go back. While streaming, the server holds back the last few characters,
# so a stop string split over two chunks is never half sent. `logprobs=k` returns each token's
# log-probability and its k most likely alternatives in OpenAI's shape (`tokens`, `token_logprobs`,
# `top_logprobs`, `text_offset`), taken from the model's raw distribution, before temperature and
# penalties, as vLLM does by default.

# %%
colors = ask("Name three primary colors.")
greedy = smol.completions.create(model="smollm2", prompt=colors, max_tokens=32, temperature=0)
greedy_text = greedy.choices[0].text
stop = greedy_text.split()[3]  # the answer's fourth word
cut = smol.completions.create(model="smollm2", prompt=colors, max_tokens=32, temperature=0, stop=[stop]).choices[0]
print(f"greedy:      {greedy_text!r}  finish_reason={greedy.choices[0].finish_reason}")
print(f"stop={stop!r}: {cut.text!r}  finish_reason={cut.finish_reason}")
lp = (
    smol.completions.create(model="smollm2", prompt=colors, max_tokens=4, temperature=0, logprobs=2).choices[0].logprobs
)
for token, chosen, top, offset in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset):
    alternatives = ", ".join(f"{t!r} {v:.3f}" for t, v in top.items())  # the 2 likeliest tokens and their logprobs
    print(f"offset {offset:>2} {token!r:<14} logprob {chosen:7.3f}   top 2: {alternatives}")
print(f"log-likelihood of the 4 tokens (the sum): {sum(lp.token_logprobs):.3f}")

# %% [markdown]
# ## 7. Bad input gets words, not a stack trace
#
# Every request the engine could never serve is refused before it reaches the engine, with a 400 and
# OpenAI's error body, saying what to change. The server keeps serving.
#
# *8.d* This server's model holds 256 tokens of context, and its cache 12 blocks of 16 tokens. A client
# sends a 200-token prompt with `max_tokens=8`. Is it (a) served, (b) refused because it is longer than
# the 256-token context, or (c) refused because it needs more blocks than the whole cache holds?

# %%
answer("8.d", None)

# %% [markdown]
# Ten bad requests, that one among them:

# %% collapsed=true jupyter={"outputs_hidden": true} tags=["hide-output"]
for bad in (
    {"prompt": prompt, "temperature": -1},
    {"prompt": prompt, "max_tokens": 0},
    {"prompt": "", "max_tokens": 4},
    {"prompt": [11] * 250, "max_tokens": 16},
    {"prompt": [11] * 200, "max_tokens": 8},
    {"prompt": prompt, "model": "gpt-4"},
    {"prompt": prompt, "stop": ["a", "b", "c", "d", "e"]},
    {"prompt": prompt, "max_tokens": True},
    {"prompt": prompt, "stream": "yes"},
    {"prompt": [5, 6, True]},
):
    error = httpx.post(server.url + "/v1/completions", json=bad).json()["error"]
    print(f"400 {error['param']}: {error['message'][:150]}")
try:
    client.completions.create(model="tiny", prompt=prompt, n=17)
except openai.BadRequestError as exc:
    print("openai raises BadRequestError:", exc.body["message"][:80])

# %% [markdown]
# ### Nothing a client sends can freeze the server
#
# One event loop serves every client, so anything slow done *on* it stalls every stream and `/health`
# at once. The server therefore reads a body only up to a limit (1 MiB; a whole context of token ids is
# about 10 KB): a larger one gets a 413 as soon as its `Content-Length` says so, or as soon as the
# bytes read pass the limit, and the rest is never read. Parsing, checking and tokenizing run in a
# worker thread, and a string prompt longer than the context could ever hold (32 characters per token
# of context) is refused before the tokenizer sees it. Only `application/json` is accepted: a web page
# you visit may POST `text/plain` to `127.0.0.1` without asking you, but not JSON. Malformed bodies
# (a lone surrogate, JSON nested 100,000 deep) are 400s, and an error quotes at most a short excerpt
# of what was sent. Run it bound beyond loopback (`--host 0.0.0.0`) and it warns you, and turns
# `/debug/blocks` off unless you pass `--enable-debug-blocks`.

# %%
url = server.url + "/v1/completions"
json_header = {"content-type": "application/json"}
for label, content, headers in (
    ("lone surrogate", b'{"prompt": "a\\ud800b"}', json_header),
    ("nested 100,000 deep", b"[" * 100_000 + b"]" * 100_000, json_header),
    ("text/plain", b'{"prompt": "Hi"}', {"content-type": "text/plain"}),
    ("unknown route", None, None),
):
    response = httpx.post(url, content=content, headers=headers) if content else httpx.get(server.url + "/v1/chat")
    error = response.json()["error"]
    print(f"{label:<20} {response.status_code} ({len(response.content)} bytes): {error['message'][:90]}")

# %% tags=["nbval-ignore-output"]
waits, outcome = [], {}
fifty_mb = b'{"prompt": "' + b"x" * (50 << 20) + b'"}'
sender = threading.Thread(target=lambda: outcome.update(r=httpx.post(url, content=fifty_mb, headers=json_header)))
sender.start()
while sender.is_alive() or len(waits) < 20:
    start = time.monotonic()
    httpx.get(server.url + "/health")
    waits.append(time.monotonic() - start)
    time.sleep(0.02)
sender.join()
print(f"50 MB body: HTTP {outcome['r'].status_code}")
print(textwrap.fill(f"the server's message: {outcome['r'].json()['error']['message']}", 100, subsequent_indent="  "))
print(f"/health meanwhile: {len(waits)} calls, the slowest answered in {1000 * max(waits):.0f} ms")

# %% [markdown]
# ## 8. Measuring TTFT and TPOT against the server
#
# The load generator (`kvcourse/serve/loadgen.py`) is a small `vllm bench serve`: N clients at once,
# each timing its own stream. **TTFT** is send → first token (queueing plus prefill), **TPOT** is the
# time per output token after that. It speaks only the OpenAI API, so it measures any server.
#
# Sweep how many clients arrive at once, sampling as real clients do (temperature 0.8, top-p 0.95, a
# seed per request). While the batch is filling (fewer clients than the engine's `max_batch_size`),
# throughput rises and each added request makes every step a little longer, so TPOT grows with it. Once
# the batch is full, further clients queue: TTFT grows while TPOT barely moves — the latency-throughput
# knee of lesson 07, measured over HTTP this time.

# %% tags=["nbval-ignore-output"]
SAMPLING = {"temperature": 0.8, "top_p": 0.95, "seed": 0}  # run_load gives request i the seed 0 + i
sweep = {}
for clients in (1, 4, 16, 64):
    work = [[(17 * i + j) % 50000 + 1 for j in range(8 + i % 24)] for i in range(clients)]
    res, secs = run_load(server.url + "/v1", work, 16, "tiny", sampling=SAMPLING)
    sweep[clients] = summarize(res, secs)
    print(f"{clients:>3} clients: {format_summary(sweep[clients])}")

# %% tags=["nbval-ignore-output"]
# Figure: Load test over HTTP: throughput (left) and TTFT and TPOT (right) against the number of concurrent clients.
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.2))
xs = list(sweep)
ax1.plot(xs, [sweep[c]["tokens_per_s"] for c in xs], "o-")
ax1.set(xscale="log", xlabel="concurrent clients", ylabel="output tokens / s", title="Throughput")
ax2.plot(xs, [sweep[c]["ttft_p50_ms"] for c in xs], "o-", label="TTFT p50")
ax2.plot(xs, [sweep[c]["ttft_p99_ms"] for c in xs], "o--", label="TTFT p99")
ax2.plot(xs, [sweep[c]["tpot_p50_ms"] for c in xs], "s-", label="TPOT p50")
ax2.set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="ms", title="Latency")
ax2.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# ### Requests that arrive over time
#
# A burst is the worst case. Lesson 07 let requests arrive as a Poisson process and simulated the
# engine on a step clock; here the same arrivals (`poisson_arrivals`, inside `make_workload`, keeping the
# short prompts of its mix) go over HTTP on the wall clock, and the study's own `summarize` reads them:
# TTFT, TPOT, inter-token latency (ITL) and end-to-end percentiles, throughput, and goodput, the
# requests per second that met both latency targets. Below capacity, TTFT is about one prefill; above
# it, requests queue and TTFT grows with the queue while TPOT stays near one step.

# %% tags=["nbval-ignore-output"]
for rate in (5.0, 20.0):  # requests per second: below what this server sustains, then above it
    work = serving.make_workload(32, rate=rate, seed=0, long_every=10**6)  # the short requests of lesson 07's mix
    arriving = [[(31 * i + j) % 50000 + 1 for j in range(n)] for i, n in enumerate(work.prompt_lens)]
    res, secs = run_load(
        server.url + "/v1", arriving, list(work.output_lens), "tiny", arrivals=work.arrivals, sampling=SAMPLING
    )
    study = serving.summarize(request_times(res, work.prompt_lens), slo_ttft_s=0.5, slo_tpot_s=0.05)
    print(f"{rate:>4.0f} requests/s: {study['requests']} requests, {study['output_tokens_per_s']:.0f} output tok/s")
    for key in ("ttft", "tpot", "itl", "e2e"):
        p50, p90, p99 = (1000 * study[f"{key}_p{p}"] for p in (50, 90, 99))
        print(f"    {key.upper():>4}: p50 {p50:7.1f} ms   p90 {p90:7.1f} ms   p99 {p99:7.1f} ms")
    print(f"    goodput {study['goodput']:.1f} requests/s within TTFT <= 0.5 s and TPOT <= 50 ms")

# %% [markdown]
# Stop the servers: uvicorn closes its socket, the engine loop finishes its step and ends.

# %%
for running_server in (server, smol_server):
    running_server.stop()
    try:
        httpx.get(running_server.url + "/health", timeout=2)
        print("still answering?!")
    except httpx.ConnectError:
        print("server stopped; engine loop alive:", running_server.engine_loop.alive)

# %% [markdown]
# ## 9. The way out: the same client against vLLM
#
# Everything above used only the OpenAI API, so it runs unchanged against vLLM. On a machine with a GPU:
#
# ```bash
# pip install vllm
# vllm serve HuggingFaceTB/SmolLM2-135M-Instruct      # OpenAI-compatible server on port 8000
# ```
#
# then, from here, point the same code at it: `client = openai.OpenAI(base_url="http://HOST:8000/v1",
# api_key="none")` and `model="HuggingFaceTB/SmolLM2-135M-Instruct"`, for completions and chat alike;
# `run_load("http://HOST:8000/v1", texts, 16, "HuggingFaceTB/SmolLM2-135M-Instruct")` measures it, with
# the prompts as text (each model has its own token ids). (vLLM accepts `ignore_eos` and
# `return_token_ids` too.) Set `VLLM_URL` (and `VLLM_MODEL` if it serves another model) before starting
# Jupyter and the cell below does it.

# %%
VLLM_URL = os.environ.get("VLLM_URL")  # e.g. http://gpu-box:8000/v1
if VLLM_URL:
    texts = [engine.tokenizer.decode(p) for p in prompts]  # section 3's prompts, as text
    res, secs = run_load(VLLM_URL, texts, lengths, os.environ.get("VLLM_MODEL", "HuggingFaceTB/SmolLM2-135M-Instruct"))
    print("vLLM:", format_summary(summarize(res, secs)))
else:
    print("VLLM_URL is not set: no vLLM server to measure here (set it to http://HOST:8000/v1 and rerun).")

# %% [markdown]
# Which piece of yours each vLLM component replaces:
#
# | vLLM (v1) | kvcourse |
# |---|---|
# | `vllm serve`: the app in `vllm/entrypoints/launchers/api_server/entry.py` · `run_server` (the old `vllm/entrypoints/openai/api_server.py` is a deprecation shim that re-exports it); completions in `vllm/entrypoints/openai/completion/serving.py` · `OpenAIServingCompletion` and `vllm/entrypoints/openai/completion/protocol.py` · `CompletionRequest` | `kvcourse/serve/app.py`, `kvcourse/serve/protocol.py` |
# | `AsyncLLM` (`vllm/v1/engine/async_llm.py`): output queues per request, abort on disconnect | `kvcourse/serve/loop.py` |
# | `EngineCore` busy loop (`vllm/v1/engine/core.py`): schedule, execute, update | `EngineLoop` around `LLMEngine.step` |
# | `Scheduler` (`vllm/v1/core/sched/scheduler.py`) | `kvcourse/scheduler.py`: **yours** (lesson 02) |
# | `KVCacheManager` (`vllm/v1/core/kv_cache_manager.py`), `BlockPool` (`vllm/v1/core/block_pool.py`), `FreeKVCacheBlockQueue` (`vllm/v1/core/kv_cache_utils.py`) | `kvcourse/kv_cache.py`: **yours** (03, 04) |
# | `GPUModelRunner` (`vllm/v1/worker/gpu/model_runner.py`: Model Runner V2, the default; `vllm/v1/worker/gpu_model_runner.py` is the fallback) | `kvcourse/model_runner.py`: **yours** (05) |
# | attention backends (`vllm/v1/attention/backends/`: FlashAttention, FlashInfer, Triton) | `kvcourse/attention.py`: **yours** (05) |
# | `IncrementalDetokenizer` (`vllm/v1/engine/detokenizer.py`) | `kvcourse/serve/detokenize.py` |
# | `PrometheusStatLogger` (`vllm/v1/metrics/loggers.py`) | `kvcourse/serve/metrics.py` |
# | `vllm bench serve` | `kvcourse/serve/loadgen.py` |
#
# What vLLM adds on top is mostly speed and breadth: CUDA graphs, fused kernels, more sampling
# (min-p, logit bias, structured output, speculative decoding), many model families, tensor and pipeline parallelism, and the engine core in its own process so Python's
# HTTP work never waits behind a forward pass. The memory side, the part you built, is the same idea.
# Notebook 09 maps each piece to the file and symbol to open in vLLM, and what vLLM adds there.
