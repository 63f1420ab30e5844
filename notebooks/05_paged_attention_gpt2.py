# %% [markdown]
# # 05 · Paged attention on real models
#
# > **What to expect.** The outputs stored in this notebook come from the reference solutions; running a
# > cell replaces its output with your code's. Run All stops at your first unwritten exercise (its
# > `NotImplementedError`) and leaves the cells below it empty, so run the notebook cell by cell.
#
# Notebooks 02 to 04 built the *control plane*: a scheduler that never runs a token it has no memory
# for, and a KV-cache manager that hands out fixed-size blocks and shares them. Each request ends up
# with a **block table**, a list of physical block ids. Nothing has stored a single key or value yet.
#
# This notebook builds the *data plane*, the part that touches tensors:
#
# 1. the paged storage and the **cache write** by slot (exercise 5.1);
# 2. **paged attention** that reads keys and values back through a block table: for decodes (5.2) and
#    for batches that mix prefill chunks with decodes (5.3);
# 3. the same decode attention as a **Triton kernel** (5.4);
# 4. the **model runner**, which turns a scheduler batch into GPT-2's inputs (5.5);
#
# and then runs real models through your scheduler, your allocator and your attention: **SmolLM2**, a
# modern chat model (grouped-query attention, RoPE), answers questions in plain English, and **GPT-2**,
# the lesson's model, shows the scheduler's trace. Every token must equal what Hugging Face's
# `model.generate(do_sample=False)` produces, also when memory is tight enough to force preemptions and
# when prefix caching shares blocks.

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
import os

import torch

if not torch.cuda.is_available():
    # Triton runs CPU tensors in its interpreter, which it picks when it is first imported: say so now.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import matplotlib.pyplot as plt

from kvcourse import attention, check
from kvcourse.engine.llm_engine import LLMEngine, hf_greedy
from kvcourse.model_runner import prepare_inputs
from kvcourse.models.gpt2 import LESSON_PROMPTS, load_gpt2, load_tokenizer
from kvcourse.models.registry import chat_prompt, load_model, stop_token_id
from kvcourse.scheduler import ScheduledSequence
from kvcourse.viz import diagrams

torch.manual_seed(0)
torch.set_num_threads(1)  # the tensors here are small: one thread is faster, and results never depend on the core count
print("CUDA available:", torch.cuda.is_available())

# %% [markdown]
# ## 1. The paged layout
#
# For every layer, the engine allocates two tensors up front, once:
#
#     key_cache, value_cache : [num_blocks, block_size, n_head, head_dim]
#
# A block holds `block_size` consecutive tokens of **one** request. Request *r*'s token at position
# *p* lives in its logical block `p // block_size`, which the block table maps to a physical block,
# at offset `p % block_size`. Flattening the first two dimensions gives every token a **slot**:
#
#     slot = block_table[p // block_size] * block_size + p % block_size
#
# The picture shows one layer's cache seen from above (each cell is one token's `[n_head, head_dim]`
# vectors) holding three requests. Their blocks are scattered, and that is fine: only the block
# table knows the order. A request wastes at most the unused tail of its last block.
#
# Before you run the cell, **predict**: request B's block table is `[0, 5, 10]` and blocks hold 4
# tokens. In which slot does B's token at position 6 live?

# %%
from kvcourse import answer

answer("5.a", None)

# %% collapsed=true jupyter={"outputs_hidden": true} tags=["hide-output"]
# Figure: The paged KV cache from above: requests A, B and C's blocks scattered in a pool of 12 blocks of 4 tokens.
block_size, num_blocks = 4, 12
tables = {"A": [3, 8], "B": [0, 5, 10], "C": [6]}  # block tables, from the KV-cache manager
lengths = {"A": 7, "B": 10, "C": 3}  # tokens each request has in the cache
diagrams.paged_cache_from_above(tables, lengths, block_size, num_blocks)

p = 6
slot = tables["B"][p // block_size] * block_size + p % block_size
print(
    f"B's token at position {p}: logical block {p // block_size} -> physical block "
    f"{tables['B'][p // block_size]}, offset {p % block_size}, slot {slot}"
)

# %% [markdown]
# ## 2. Writing into the cache (exercise 5.1)
#
# In every layer, at every step, the model computes keys and values for the tokens it is fed. Before
# attention runs, they are stored at their slots; the model runner (section 6) computes a
# `slot_mapping` with one slot per fed token. For this layout (`[num_blocks, block_size, H, D]`) vLLM's
# kernel is `reshape_and_cache_flash` (in `vllm/_custom_ops.py`, a CUDA kernel); in PyTorch it is one
# indexed assignment into the cache viewed as
# `[num_blocks * block_size, H, D]`.
#
# **Exercise 5.1.** Write `write_to_cache(key, value, key_cache, value_cache, slot_mapping)` in
# `kvcourse/attention.py`: `key` and `value` are `[T, H, D]`, and the caches must change **in place**.
#
# Below, request B's ten tokens are written with the key of position *p* set to *p + 1*, so the
# printed cache shows where each one landed (0 = empty).

# %%
key_cache = torch.zeros(num_blocks, block_size, 1, 1)
value_cache = torch.zeros_like(key_cache)
positions = torch.arange(lengths["B"])
slot_mapping = torch.tensor([tables["B"][p // block_size] * block_size + p % block_size for p in positions])
keys = (positions + 1.0).view(-1, 1, 1)

attention.write_to_cache(keys, -keys, key_cache, value_cache, slot_mapping)
print("slot_mapping:", slot_mapping.tolist())
print("key_cache[:, :, 0, 0] (rows: blocks, columns: offsets):")
print(key_cache[:, :, 0, 0].int())

# %%
check("5.1")

# %% [markdown]
# ## 3. Paged decode attention (exercise 5.2)
#
# In a decode step every running request feeds one token, so the query is `[B, H, D]`: one row per
# sequence. Sequence *b* attends over its `seq_lens[b]` cached tokens (the new one included: its K/V
# were written just before). The reference implementation is the plain one:
#
# 1. **gather**: index the cache with the first `ceil(seq_len / block_size)` ids of the block table,
#    flatten the blocks into one run of tokens, keep the first `seq_len`: `[S, H, D]`;
# 2. **attend**: `softmax(q · kᵀ × scale) · v`, per head.
#
# Gathering copies every key and value once more; a real kernel (section 5) reads them in place.
#
# **Exercise 5.2.** Write `gather_kv` and the loop in `paged_decode_attention` in
# `kvcourse/attention.py`. The cell below checks it against PyTorch's own attention
# (`scaled_dot_product_attention`) on the same keys and values stored contiguously.

# %%
H, D = 2, 8
key_cache = torch.randn(num_blocks, block_size, H, D)
value_cache = torch.randn(num_blocks, block_size, H, D)
names = list(tables)
width = max(len(t) for t in tables.values())
block_tables = torch.tensor([tables[n] + [0] * (width - len(tables[n])) for n in names], dtype=torch.int32)
seq_lens = torch.tensor([lengths[n] for n in names])
decode_query = torch.randn(len(names), H, D)  # one new token per request

paged = attention.paged_decode_attention(decode_query, key_cache, value_cache, block_tables, seq_lens)

for b, name in enumerate(names):  # the same attention on contiguous copies, with PyTorch's SDPA
    k = attention.gather_kv(key_cache, block_tables[b], int(seq_lens[b])).transpose(0, 1)  # [H, S, D]
    v = attention.gather_kv(value_cache, block_tables[b], int(seq_lens[b])).transpose(0, 1)
    dense = torch.nn.functional.scaled_dot_product_attention(decode_query[b][:, None], k, v)[:, 0]
    print(f"request {name}: {int(seq_lens[b]):>2} tokens, paged == dense: {torch.allclose(paged[b], dense, atol=1e-5)}")

# %%
check("5.2")

# %% [markdown]
# ## 4. Prefill chunks and decodes in one batch (exercise 5.3)
#
# The scheduler mixes decodes with prefill chunks, and a chunk may continue a prompt whose first part
# is already cached (an earlier chunk, or a prefix-cache hit). The model runner packs all fed tokens
# into one row `query [T, H, D]`; `query_start_loc` (`[B + 1]`) says where each sequence's queries
# start, and `seq_lens[b]` counts its tokens in the cache *including* this chunk. A chunk of `L`
# queries is the sequence's **last** `L` tokens, so query *i* sits at position `seq_len - L + i` and
# may see every key up to that position: the cached prefix in full, and the chunk causally. A decode
# is a chunk of one; a fresh prompt is a chunk with no prefix.
#
# The picture shows which keys each query may see for a chunk of 4 tokens after a cached prefix of 6.
# Before you run it, **predict**: how many keys may query 2 of that chunk see?

# %%
answer("5.b", None)

# %% collapsed=true jupyter={"outputs_hidden": true} tags=["hide-output"]
# Figure: Which keys each query of a 4-token chunk may see after a cached prefix of 6: the prefix fully, the chunk causally.
seq_len, chunk = 10, 4
query_pos = torch.arange(seq_len - chunk, seq_len)[:, None]
allowed = torch.arange(seq_len)[None, :] <= query_pos
fig, ax = plt.subplots(figsize=(6, 2.4))
ax.imshow(allowed, cmap="Blues", vmin=0, vmax=1.4)
ax.axvline(seq_len - chunk - 0.5, color="black", ls="--")
ax.set_xticks(range(seq_len))
ax.set_yticks(range(chunk), [f"query {i} (pos {int(p)})" for i, p in enumerate(query_pos[:, 0])])
ax.set_xlabel("key position (left of the dashed line: cached prefix)")
ax.set_title("a chunk sees its prefix fully and itself causally")
plt.show()


# %% [markdown]
# **Exercise 5.3.** Write `_chunk_attention` in `kvcourse/attention.py` (the per-sequence step of
# `paged_attention`): gather the sequence's keys and values, mask the future with `-inf`, softmax,
# weight the values. The cell checks a batch holding a chunk that continues a cached prefix, a
# decode and a fresh prompt against dense causal attention.


# %%
def dense_causal(q, k, v, offset):
    """softmax(q k^T / sqrt(D)) v with query i at position offset + i seeing keys 0..offset + i."""
    scores = torch.einsum("lhd,shd->hls", q, k) / D**0.5
    future = torch.arange(k.shape[0])[None, :] > torch.arange(q.shape[0])[:, None] + offset
    return torch.einsum("hls,shd->lhd", scores.masked_fill(future, float("-inf")).softmax(-1), v)


chunks = {"A": 3, "B": 1, "C": 3}  # A continues a cached prefix, B decodes, C is a fresh prompt
query = torch.randn(sum(chunks.values()), H, D)
query_start_loc = torch.tensor([0, 3, 4, 7], dtype=torch.int32)
mixed = attention.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)

for b, name in enumerate(names):
    start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
    k = attention.gather_kv(key_cache, block_tables[b], int(seq_lens[b]))
    v = attention.gather_kv(value_cache, block_tables[b], int(seq_lens[b]))
    expected = dense_causal(query[start:end], k, v, int(seq_lens[b]) - (end - start))
    print(
        f"request {name}: {end - start} quer{'y' if end - start == 1 else 'ies'} over {int(seq_lens[b]):>2} tokens, "
        f"paged == dense: {torch.allclose(mixed[start:end], expected, atol=1e-5)}"
    )

# %%
check("5.3")

# %% [markdown]
# ## 5. A Triton kernel for decode attention (exercise 5.4)
#
# The reference gathers (copies) every key and value before attending. A GPU kernel reads them where
# they are. `triton_paged_decode_attention` launches one **program per (sequence, head)**. Each
# program loads its query row, then walks the sequence's block table one block at a time: it loads
# that block's keys `[block_size, D]`, scores them, and folds them into running statistics with the
# **online softmax** (the trick behind FlashAttention), so the whole row of scores never exists at once:
#
#     m_new = max(m, max(scores))          running maximum, for numerical safety
#     alpha = exp(m - m_new)               how much the old sums shrink
#     p     = exp(scores - m_new)
#     l     = l * alpha + sum(p)           running softmax denominator
#     acc   = acc * alpha + p @ values     running numerator
#     ... and at the end: out = acc / l
#
# Decode attention is **memory-bound**: each key and value is read once and used for a few
# multiply-adds, so the kernel's speed is the bandwidth at which it reads the cache (section 10).
#
# **Exercise 5.4.** Write the body of `_paged_decode_kernel` in `kvcourse/attention.py`; the Python
# launcher below it is written for you. On a CPU, Triton runs the kernel in its *interpreter*
# (`TRITON_INTERPRET=1`, set at the top of this notebook): slow, but exact, so it checks the logic.

# %%
triton_out = attention.triton_paged_decode_attention(decode_query, key_cache, value_cache, block_tables, seq_lens)
reference = attention.paged_decode_attention(decode_query, key_cache, value_cache, block_tables, seq_lens)
print("Triton kernel == reference:", torch.allclose(triton_out, reference, atol=1e-5))

# %%
check("5.4")

# %% [markdown]
# ## 6. The model runner: from a scheduler batch to GPT-2's inputs (exercise 5.5)
#
# The scheduler hands over a list of `ScheduledSequence(request_id, tokens, is_decode,
# position_ids_start)`. Like vLLM and nano-vllm, the model runner packs every fed token of every
# sequence into **one row** (no padding between sequences) and describes it with a few small tensors.
# (vLLM pads in two places the course does not: it rounds the row's length up to a size it captured a
# CUDA graph for (`vllm/v1/cudagraph_dispatcher.py` · `CudagraphDispatcher`), the extra tokens' slots set
# to `PAD_SLOT_ID` (-1, `vllm/v1/attention/backends/utils.py`) so nothing is written, and its block tables' unused entries
# are 0, which in vLLM is the **null block**, a block the pool sets aside at start-up and never hands
# out. Our 0 is an ordinary block that padding merely never reads.)
#
# | tensor | shape | what |
# |---|---|---|
# | `input_ids`, `positions`, `slot_mapping` | `[T]` | the token, its position in its sequence, where its K/V go |
# | `block_tables` | `[B, max_blocks]` | each sequence's table, padded with 0 (never read) |
# | `seq_lens` | `[B]` | tokens in the cache once this step has run |
# | `query_start_loc` | `[B + 1]` | where each sequence's tokens start in the row |
# | `logits_indices` | `[B]` | each sequence's last token: where the next token is sampled |
#
# Positions come from the cache, not from the batch: a chunk starting at `position_ids_start = 6`
# feeds positions 6, 7, ... . Getting this wrong is the lesson's placeholder-token bug in another form.
#
# **Exercise 5.5.** In `token_layout` (`kvcourse/model_runner.py`; `prepare_inputs`, written for you,
# calls it with each sequence's block table, first position and token count as tensors), compute every
# token's position and slot and each sequence's `seq_len`, with tensor operations, no loop over tokens.
# The cell below runs the whole `prepare_inputs` on a three-sequence batch.

# %%
batch = [
    ScheduledSequence(request_id=0, tokens=[318], is_decode=True, position_ids_start=9),  # a decode
    ScheduledSequence(request_id=1, tokens=[257, 1748, 1900, 329], is_decode=False, position_ids_start=2),  # a chunk
    ScheduledSequence(request_id=2, tokens=[464, 3139], is_decode=False, position_ids_start=0),  # a new prompt
]
block_ids = {0: [7, 2, 9], 1: [4, 6], 2: [11]}
inputs = prepare_inputs(batch, block_ids, block_size=4)
for field in ["input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc", "logits_indices"]:
    print(f"{field:<16} {getattr(inputs, field).tolist()}")
print("block_tables    ", inputs.block_tables.tolist())

# %%
check("5.5")

# %% [markdown]
# ## 7. Plugging the paged cache into a Hugging Face model, without patching it
#
# Hugging Face models offer two extension points, and the engine uses exactly those
# (`kvcourse/worker/paged_cache.py`):
#
# * **A `Cache` subclass.** In every layer the model (GPT-2, SmolLM2) calls `cache.update(key, value, layer_idx, kwargs)`.
#   Our `PagedKVCache` holds one `PagedCacheLayer` per layer; its `update` calls *your*
#   `write_to_cache` with the `slot_mapping` and returns the layer's whole paged storage.
# * **An attention function**, registered with `AttentionInterface.register("kvcourse_paged", fn)`
#   and selected with `model.set_attn_implementation("kvcourse_paged")`. The model calls it with the
#   query and what `update` returned, plus every extra keyword argument given to the model's forward:
#   the runner passes `block_tables`, `seq_lens` and `query_start_loc`. A step that is all decodes
#   uses `paged_decode_attention` (or the Triton kernel, with `attention="triton"`); a step with a
#   prefill chunk uses `paged_attention`.
#
# The runner passes `position_ids` explicitly (a paged cache has no single length to count from) and
# `logits_to_keep=logits_indices`, so the language-model head runs only where a token is sampled.
# `LLMEngine` ties it together: each step it asks the scheduler for a batch, looks up the block tables
# in the KV-cache manager, runs the model once, and hands the greedy tokens back to the scheduler.
#
# **End of sequence.** A request whose `eos_token_id` is set ends when it samples that token, as
# Hugging Face's `generate` does: a chat model stops at its end-of-turn token. `engine.generate(...)`
# leaves it unset and ignores EOS, like vLLM's `ignore_eos=True` in benchmarks: every request then gets
# exactly `max_new_tokens` tokens, and the reference is
# `model.generate(ids, do_sample=False, max_new_tokens=n, eos_token_id=None)`, one prompt at a time
# (`hf_greedy`).

# %% [markdown]
# ## 8. SmolLM2 answers through your paged engine
#
# **SmolLM2-135M-Instruct** (notebook 00 asked it its first question) is a Llama: 30 layers, 9 query
# heads sharing 3 KV heads (grouped-query attention), rotary positions. The engine runs it through the
# same two extension points as any Hugging Face model, so your cache write, your paged attention and
# your model runner are what compute its answers. Each question goes through the model's **chat
# template** (an instruct model answers a conversation, not raw text), and each request stops at the
# model's end-of-turn token, `<|im_end|>`, as Hugging Face's `generate` does. Greedy decoding, blocks
# of 16 tokens; `attention="reference"` runs YOUR attention (Exercises 5.1–5.3); the engine's default,
# `"fast"`, is the vectorised backend that benchmarks and the server use (notebook 06 compares the two).

# %%
smollm2, smol_tokenizer = load_model("smollm2")
questions = ["What is the capital of France?", "Name three primary colors.", "Write one sentence about a cat."]
chats = [chat_prompt(smol_tokenizer, [{"role": "user", "content": q}]) for q in questions]
smol_engine = LLMEngine(smollm2, num_blocks=32, block_size=16, tokenizer=smol_tokenizer, attention="reference")
requests = [smol_engine.add_request(ids, max_new_tokens=32) for ids in chats]
for request in requests:
    request.eos_token_id = stop_token_id(smollm2)  # <|im_end|>: the request ends there, as generate() would
while smol_engine.has_unfinished_requests():
    smol_engine.step()
answers = [list(r.output_tokens) for r in requests]
for question, tokens in zip(questions, answers):
    print(f"{question:<36} -> {smol_tokenizer.decode(tokens, skip_special_tokens=True)}")
print(f"\nprompt tokens (chat template included): {[len(c) for c in chats]}; steps: {smol_engine.stats.iterations}")

# %% [markdown]
# **The proof.** Hugging Face's own greedy `generate`, one question at a time, with its own attention and
# its own cache, stopping at the same end-of-turn token, must give the same tokens, that token included.

# %%
with torch.inference_mode():
    hf_answers = [
        smollm2.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32)[0, len(ids) :].tolist()
        for ids in chats
    ]
for question, mine, theirs in zip(questions, answers, hf_answers):
    print(f"{question:<36} {len(mine):>2} tokens, same as model.generate(do_sample=False): {mine == theirs}")

# %% [markdown]
# ### The lesson's four prompts on GPT-2: the scheduler's trace
#
# GPT-2 is the model the source lesson used, and its settings come along: 100 blocks of 16 tokens, a
# token budget of 1024, at most 8 sequences per step, 5 new tokens per request, EOS ignored.
# `load_gpt2()` gives pretrained GPT-2 (124M parameters) when the Hugging Face Hub answers, else the
# same architecture with seeded random weights (it says which). This run and section 9 are about shapes,
# steps and memory, not text: the claim tested, *the paged engine computes exactly what Hugging Face
# computes*, holds for any weights, so no text is printed from GPT-2 here (SmolLM2 spoke above).

# %% tags=["nbval-ignore-output"]
# (pretrained online, random offline: load_gpt2's line about the weights differs)
tokenizer = load_tokenizer()
gpt2 = load_gpt2("gpt2")
prompts = [tokenizer.encode(p) for p in LESSON_PROMPTS]
engine = LLMEngine(
    gpt2, num_blocks=100, block_size=16, token_budget=1024, max_batch_size=8, tokenizer=tokenizer, attention="reference"
)
outputs = engine.generate(prompts, max_new_tokens=5, trace=True)
print("new tokens per prompt:", [len(o) for o in outputs])

# %% [markdown]
# The scheduler's trace reads like the toy world's (the same loop records both): one step prefills all
# four prompts (`R0 prefill 15 @0-14*`: request 0 is fed 15 tokens at positions 0-14, and `*` marks a
# chunk that samples a token), then every step decodes one token per request; the blocks come back when
# the requests finish.

# %%
print("prompt lengths:", [len(p) for p in prompts])
print(*engine.trace, sep="\n")

# %% [markdown]
# The same proof for GPT-2: Hugging Face's greedy `generate`, EOS ignored like the engine (`hf_greedy`).

# %%
reference_tokens = [hf_greedy(gpt2, p, 5) for p in prompts]
print("engine == model.generate(do_sample=False), one prompt at a time:", outputs == reference_tokens)

# %% [markdown]
# ## 9. Tight memory and prefix caching
#
# **Tight memory.** With 8 blocks of 8 tokens (64 token slots for four requests of up to 36 tokens)
# and a budget of 24 tokens per step, the scheduler must chunk prompts and, when a running request
# needs a block and none is free, **preempt** the most recently admitted request: its blocks are
# freed and it is recomputed later from its prompt and the tokens it already generated. The output
# must not change.

# %%
tight = LLMEngine(
    gpt2, num_blocks=8, block_size=8, token_budget=24, max_batch_size=8, tokenizer=tokenizer, attention="reference"
)
tight_outputs = tight.generate(prompts, max_new_tokens=5, trace=True)
print(*tight.trace, sep="\n")
print(
    f"\npreemptions: {tight.stats.preemptions}, steps: {tight.stats.iterations}, "
    f"tokens fed: {tight.stats.scheduled_tokens} (roomy run: {engine.stats.scheduled_tokens})"
)
print("same tokens as Hugging Face:", tight_outputs == reference_tokens)

# %% [markdown]
# **Prefix caching.** Chat requests often start with the same system prompt. With prefix caching on
# (notebook 04), a request's full blocks that hash like blocks already in the cache are *shared*: their
# keys and values are not computed again, and the request's first chunk starts past them. Below, the
# four lesson prompts follow a shared system prompt. Even requests admitted in the same step share:
# within a forward pass each layer writes every fed token's K/V before any attention reads them.

# %%
system = (
    "You are a careful assistant who answers questions about history, science and programming. "
    "Keep every answer short, accurate and polite, and say so when you are unsure.\n\n"
)
chat_prompts = [tokenizer.encode(system + p) for p in LESSON_PROMPTS]
print("system prompt:", len(tokenizer.encode(system)), "tokens; prompts:", [len(p) for p in chat_prompts])

runs = {}
for caching in (False, True):
    chat = LLMEngine(
        gpt2, num_blocks=64, block_size=8, enable_prefix_caching=caching, tokenizer=tokenizer, attention="reference"
    )
    runs[caching] = (chat.generate(chat_prompts, max_new_tokens=5), chat.stats)
    print(
        f"prefix caching {'on ' if caching else 'off'}: {runs[caching][1].prefix_hit_tokens:>3} prompt tokens "
        f"from the cache, {runs[caching][1].scheduled_tokens} tokens fed to the model"
    )
print("same tokens with and without caching:", runs[True][0] == runs[False][0])
print("same tokens as Hugging Face:", runs[True][0] == [hf_greedy(gpt2, p, 5) for p in chat_prompts])

# %% [markdown]
# **A harder test.** Randomly initialised GPT-2 attends almost uniformly (its init scale is 0.02),
# and its greedy outputs repeat, so a subtly broken cache might still match. The course's tiny GPT-2
# (2 layers, width 64) uses an init scale of 0.3: its attention is sharp and its outputs vary, so any
# misplaced key shows. A dozen prompts of mixed lengths, three memory regimes:

# %%
import random

tiny = load_gpt2("tiny")
rng = random.Random(0)
shared = [rng.randrange(50257) for _ in range(21)]
mixed_prompts = [[rng.randrange(50257) for _ in range(rng.randint(1, 45))] for _ in range(8)]
mixed_prompts += [shared + [rng.randrange(50257) for _ in range(rng.randint(1, 9))] for _ in range(4)]
expected = [hf_greedy(tiny, p, 8) for p in mixed_prompts]

settings = {
    "roomy cache": dict(num_blocks=256, block_size=16),
    "tight cache, block size 4": dict(num_blocks=16, block_size=4, token_budget=32, max_batch_size=8),
    "prefix caching, block size 3": dict(num_blocks=80, block_size=3, token_budget=48, enable_prefix_caching=True),
}
for name, kwargs in settings.items():
    run = LLMEngine(tiny, attention="reference", **kwargs)
    same = run.generate(mixed_prompts, max_new_tokens=8) == expected
    s = run.stats
    print(
        f"{name:<30} matches HF: {same}  steps {s.iterations:>3}  preemptions {s.preemptions:>2}  "
        f"prefix-hit tokens {s.prefix_hit_tokens:>3}"
    )


# %% [markdown]
# ## 10. On a GPU: the Triton kernel against the reference and SDPA
#
# Where CUDA exists, this section times decode attention in fp16 for a batch of sequences of about a
# thousand tokens, GPT-2-small-shaped heads (12 × 64) and blocks of 16:
#
# * **Triton**: your kernel, reading the paged cache in place;
# * **reference**: `paged_decode_attention` (gather, then attend: extra copies);
# * **SDPA**: PyTorch's `scaled_dot_product_attention` on a *contiguous* cache, the un-paged baseline.
#
# Decode attention is memory-bound, so the figure of merit is bandwidth: bytes of K and V read per
# second. Without CUDA the cell prints one line and skips. Figures, with the device and the date,
# are recorded in the table below after a GPU run.
#
# | device | date | Triton | reference | SDPA (contiguous) |
# |---|---|---|---|---|
# | (no GPU run recorded yet) | | | | |


# %% tags=["nbval-ignore-output"]
# (timings; and the device differs between machines)
def time_ms(fn, repeats=20):
    """Median time of fn() in milliseconds, measured with CUDA events."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


if not torch.cuda.is_available():
    print("GPU section skipped: no CUDA device on this machine (the kernel was checked above in Triton's interpreter).")
else:
    B, H, D, bs, S = 32, 12, 64, 16, 1000
    dev, dt = "cuda", torch.float16
    per_seq = -(-S // bs)
    kc = torch.randn(B * per_seq + 8, bs, H, D, device=dev, dtype=dt)
    vc = torch.randn_like(kc)
    tables_gpu = torch.randperm(kc.shape[0], device=dev)[: B * per_seq].view(B, per_seq).int()
    lens = torch.full((B,), S, device=dev, dtype=torch.int32)
    q = torch.randn(B, H, D, device=dev, dtype=dt)
    k_contig = torch.stack([attention.gather_kv(kc, tables_gpu[b], S) for b in range(B)]).transpose(
        1, 2
    )  # [B, H, S, D]
    v_contig = torch.stack([attention.gather_kv(vc, tables_gpu[b], S) for b in range(B)]).transpose(1, 2)
    runs_gpu = {
        "Triton": lambda: attention.triton_paged_decode_attention(q, kc, vc, tables_gpu, lens),
        "reference": lambda: attention.paged_decode_attention(q, kc, vc, tables_gpu, lens),
        "SDPA (contiguous)": lambda: torch.nn.functional.scaled_dot_product_attention(
            q[:, :, None], k_contig, v_contig
        ),
    }
    sdpa = runs_gpu["SDPA (contiguous)"]()[:, :, 0].float()
    print(f"{torch.cuda.get_device_name(0)}, fp16, B={B}, seq_len={S}, H={H}, D={D}, block_size={bs}")
    print(
        f"max |Triton - SDPA| = {(runs_gpu['Triton']().float() - sdpa).abs().max():.2e}, "
        f"max |reference - SDPA| = {(runs_gpu['reference']().float() - sdpa).abs().max():.2e}"
    )
    kv_bytes = 2 * B * S * H * D * kc.element_size()
    for name, fn in runs_gpu.items():
        ms = time_ms(fn)
        print(f"{name:<18} {ms:8.3f} ms   {kv_bytes / ms / 1e6:8.1f} GB/s of K and V")

# %% [markdown]
# ## 11. Your kernel as a GPU compiles it (no GPU needed)
#
# Triton's interpreter ran your kernel above as Python: it checks your logic, not the rules of the GPU
# compiler. Those rules are real: change `l_i = 0.0` to `l_i = 0` and the interpreter still matches the
# reference, but no GPU would run the kernel (*"Loop-carried variable l_i has initial type int32 but is
# re-assigned to fp32 in loop"*: a value carried through a loop lives in one register of one type).
# The Triton wheel ships the whole compiler, down to NVIDIA's assembler `ptxas`, so `check("5.4")`
# compiled your kernel for an **A100 (sm_80)** and an **H100/H200 (sm_90)**, in fp16, bf16 and fp32,
# right here, and would have told you in plain words which line a GPU rejects.
#
# The compiler also says what one program of your kernel occupies on the chip. The numbers below come
# from the compiled binary (the *cubin*), read by `cuobjdump` and `ptxas`, the tools a CUDA developer uses,
# for GPT-2's shapes (block size 16, head size 64).

# %%
from kvcourse.course import kernel_compile

try:
    compiled = kernel_compile.assert_decode_kernel_compiles(attention._paged_decode_kernel)
except (AssertionError, NotImplementedError) as problem:
    compiled = []
    print("Your kernel does not compile yet:", str(problem).splitlines()[0])
table = [f"{'target':<20}{'dtype':<7}{'warps':>6}{'registers':>11}{'spills':>8}{'shared (B)':>12}{'local (B)':>11}"]
for kernel_code in compiled:
    usage = kernel_compile.resource_usage(kernel_code)
    table.append(
        f"{kernel_compile.ARCHS[kernel_code.arch]:<20}{kernel_code.dtype:<7}{kernel_code.num_warps:>6}"
        f"{usage.registers:>11}{usage.spill_stores + usage.spill_loads:>8}{kernel_code.shared:>12}{usage.local:>11}"
    )
print("\n".join(table))

# %% [markdown]
# What each column means for a **memory-bound** decode kernel, whose speed is the rate at which it
# streams keys and values from memory:
#
# * **warps**: one program (one sequence × head) runs as this many warps of 32 threads. The grid has
#   B × H programs: for section 10's batch, 32 × 12 = 384, about three per SM on an H200's 132 SMs. A
#   decode batch that small leaves most of the chip idle, which is why production kernels also split
#   long sequences across programs ("flash-decoding").
# * **registers** per thread: an SM has 65,536. They bound how many programs an SM can hold at once
#   (computed below); more resident warps means more loads in flight, which is what hides memory latency.
# * **spills**: bytes the register allocator pushed out to *local* memory, which lives in DRAM. Zero is the
#   goal: every spill is extra memory traffic in a kernel whose whole cost *is* memory traffic.
# * **shared**: scratch for the reductions across warps (the `tl.sum` / `tl.max` over a block). Tiny next to
#   the 164 KB (A100) or 228 KB (H100/H200) an SM has: it limits nothing here.

# %%
REGISTERS_PER_SM, THREADS_PER_SM = 65_536, 2_048
occupancy = []
for kernel_code in compiled[:1] + compiled[3:4]:
    usage = kernel_compile.resource_usage(kernel_code)
    per_warp = -(-usage.registers // 8) * 8 * 32  # registers are granted per warp, in steps of 8 per thread
    by_registers = REGISTERS_PER_SM // per_warp // kernel_code.num_warps
    by_threads = THREADS_PER_SM // (32 * kernel_code.num_warps)
    occupancy.append(
        f"{kernel_compile.ARCHS[kernel_code.arch]}, {kernel_code.dtype}: at most {min(by_registers, by_threads)} "
        f"programs per SM ({by_registers} by registers, {by_threads} by threads)"
    )
print("\n".join(occupancy))

# %% [markdown]
# The compiler's output for the loop over blocks, in PTX (NVIDIA's portable assembly), sm_90 and fp16.
# Read it for three things: `ld.global.b32` fetches the next **block id** from the block table, a load
# that the key and value loads must wait for (paging's price: one dependent read per block);
# `ld.global.v4.b32` are **16-byte vector loads** of keys and values (eight fp16 numbers per thread per
# instruction: the widest load there is, which is what a memory-bound kernel wants); `shfl.sync.bfly` and
# `bar.sync` are the **reductions** (within a warp, then across warps through shared memory), and
# `ex2.approx.f32` is the online softmax's exponential.

# %%
if compiled:
    loop = kernel_compile.inner_loop_ptx(compiled[3].ptx)
    print("\n".join(line for line in loop if "ld.global" in line))
    print("... and in all, per iteration of the loop over blocks:")
    counts = kernel_compile.opcode_counts(loop)
    shown = ("ld.global.b32", "ld.global.v4.b32", "fma.rn.f32", "shfl.sync.bfly.b32", "bar.sync", "ex2.approx.f32")
    for opcode in shown:
        print(f"  {opcode:<20}{counts.get(opcode, 0):>4}")

# %% [markdown]
# ### A roofline estimate
#
# Every decode step, each sequence's query must meet every cached key and value once. Those bytes set
# a floor on the kernel's time: bytes read ÷ memory bandwidth. For section 10's batch (32 sequences of
# 1,000 tokens, GPT-2's 12 heads of 64, fp16) and the H200 SXM's spec-sheet bandwidth of about 4.8 TB/s:

# %%
B, S, H, D, bytes_per_element = 32, 1000, 12, 64, 2
kv_bytes = 2 * B * S * H * D * bytes_per_element  # keys and values, one layer
flops = B * H * S * 4 * D  # per token and head: q·k and p·v, D multiply-adds each, so 2D FLOPs each
# spec sheet, H200 SXM: HBM3e bandwidth and FP32 (non-tensor) throughput (the H200 NVL card: 4.8 TB/s, 60 TFLOP/s)
H200_BYTES_PER_S, H200_FP32_FLOPS = 4.8e12, 67e12
print(f"K and V read per decode step, one layer: {kv_bytes / 1e6:.1f} MB; all 12 layers: {12 * kv_bytes / 1e6:.0f} MB")
balance = H200_FP32_FLOPS / H200_BYTES_PER_S
print(f"arithmetic intensity: {flops / kv_bytes:.2f} FLOP per byte (the H200 balances at {balance:.0f})")
print(f"best-case kernel time on an H200, one layer: {kv_bytes / H200_BYTES_PER_S * 1e6:.1f} µs")

# %% [markdown]
# At about one floating-point operation per byte, against a chip that can do fourteen per byte it reads,
# the kernel is bound by memory, not arithmetic: its best possible time is the bytes' time, about 20 µs
# per layer here. Section 10 measures the real time where a GPU exists, and its bandwidth column is the
# fraction of this bound the kernel reaches. GPU figures for this notebook are still due: no GPU run has
# been recorded yet, so how close your kernel comes to this bound is an open question until one is.
#
# ### Precision: what the interpreter cannot tell you
#
# The interpreter computes in fp32 whatever the tensors' dtypes say. A GPU does not: an fp16 output is
# rounded to 11 significant bits, bf16 to 8, and its `exp` is a fast approximation. Had the kernel used
# `tl.dot` on fp32 inputs, a GPU would run it in **TF32** (10-bit mantissa, errors near 1e-3) unless it
# passes `input_precision="ieee"`; this kernel multiplies and sums in fp32 (`tl.sum`), so it does not
# depend on that. The course's GPU tests compare the kernel with the fp32 reference on the same inputs
# within these tolerances (absolute and relative), each a few times the rounding of the output dtype:

# %%
for dtype, tolerance in kernel_compile.GPU_TOLERANCES.items():
    print(f"{dtype}: {tolerance:g}")

# %% [markdown]
# ## What you built
#
# * a paged KV storage and its cache write by slot;
# * paged attention for decodes and for mixed prefill/decode batches, and a Triton decode kernel;
# * the model runner's packed inputs, and an engine that drives real models (SmolLM2, GPT-2) through
#   transformers' own extension points (`Cache`, `AttentionInterface`) and reproduces Hugging Face's
#   greedy tokens exactly, under memory pressure and with shared prefixes.
#
# `python -m kvcourse.course.demo` runs the four lesson prompts from the command line and prints the same
# trace. Notebook 06 measures what paging buys: memory waste, throughput against Hugging Face, block
# sizes, and the kernel's bandwidth.
