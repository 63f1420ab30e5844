"""How the paged KV cache plugs into a Hugging Face model (GPT-2, Llama/SmolLM2), through transformers' own extension points.

Two hooks, no monkeypatching:

* a `Cache` subclass, `PagedKVCache`: the model calls `cache.update(key, value, layer_idx, kwargs=...)`
  in every layer; our layer writes the new keys and values into its paged storage at the slots the
  model runner computed (`write_to_cache`) and hands back the whole storage;
* an attention function registered with `AttentionInterface.register`: the model calls it with the
  query and what `update` returned, plus every extra keyword argument given to the model's forward
  (`block_tables`, `seq_lens`, `query_start_loc`), and it runs paged attention.

The model runner flattens a scheduler batch into one row of T tokens (batch dimension 1, the
"packed" layout of vLLM and nano-vllm), so the model needs no padding. The storage's shapes come from
the model's config (`kv_cache_spec`): a Llama model stores its KV heads only (grouped-query attention),
and its keys arrive in `update` already rotated by RoPE at their true positions (the runner passes
position_ids), so they are cached rotated and never touched again.
"""

from __future__ import annotations

import functools
import time

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

from kvcourse import attention
from kvcourse.backends.fast import FastAttentionMetadata, fast_paged_attention
from kvcourse.models.spec import kv_cache_spec

# The names under which our attention functions are registered with transformers.
ATTENTION_IMPLEMENTATIONS = {
    "reference": "kvcourse_paged",  # the learner's attention (exercises 5.2 and 5.3): readable, one sequence at a time
    "triton": "kvcourse_paged_triton",  # the learner's Triton decode kernel (exercise 5.4) for decode-only steps
    "fast": "kvcourse_paged_fast",  # one gather for the whole batch, then PyTorch's fused SDPA (kvcourse.backends)
}
DEFAULT_ATTENTION = "fast"  # what the engine and the server use unless told otherwise


class AttentionTimer:
    """Wall seconds spent in attention, summed over layers and steps (the runner reads it per step)."""

    def __init__(self, synchronize: bool = False) -> None:
        self.seconds = 0.0
        self.synchronize = synchronize  # on a GPU, wait for the kernels so the time is theirs, not the launch's

    def start(self, device: torch.device) -> float:
        """A timestamp, after the work already queued on the device (when synchronizing)."""
        if self.synchronize and device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def stop(self, started: float, device: torch.device) -> None:
        """Add the time since `started`."""
        if self.synchronize and device.type == "cuda":
            torch.cuda.synchronize(device)
        self.seconds += time.perf_counter() - started


class PagedCacheLayer(CacheLayerMixin):
    """One layer's paged K/V storage, [num_blocks, block_size, KVH, D] each, shared by every request."""

    is_sliding = False

    def __init__(self, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values = key_cache, value_cache
        self.device = key_cache.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the storage is allocated up front, like vLLM's."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, kwargs: dict | None = None, **_: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's K/V ([1, KVH, T, D]) at their slots; return the whole paged storage for attention."""
        if not kwargs or "slot_mapping" not in kwargs:
            raise ValueError(
                "PagedKVCache needs the forward keyword slot_mapping (and block_tables, seq_lens, "
                "query_start_loc): run the model through kvcourse's ModelRunner, not model.generate()."
            )
        new_keys, new_values = (x[0].transpose(0, 1) for x in (key_states, value_states))  # [T, KVH, D]
        attention.write_to_cache(new_keys, new_values, self.keys, self.values, kwargs["slot_mapping"])
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """Unused: our attention applies causality itself, so transformers builds no mask."""
        return query_length, 0

    def get_seq_length(self) -> int:
        """A paged cache holds many sequences of different lengths, so it has no single length."""
        raise ValueError("a paged cache has no single sequence length: pass position_ids to the model.")

    def get_max_length(self) -> int:
        """Tokens the storage can hold in all (every block full)."""
        return self.keys.shape[0] * self.keys.shape[1]


class PagedKVCache(Cache):
    """transformers' Cache over one PagedCacheLayer per model layer."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if min(num_layers, num_blocks, block_size, num_kv_heads, head_dim) <= 0:
            raise ValueError("num_layers, num_blocks, block_size, num_kv_heads and head_dim must all be positive.")
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        layers = [
            PagedCacheLayer(
                torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
            )
            for _ in range(num_layers)
        ]
        super().__init__(layers=layers)
        self.num_blocks, self.block_size = num_blocks, block_size

    @classmethod
    def for_model(
        cls, model: torch.nn.Module, num_blocks: int, block_size: int, device: torch.device | str | None = None
    ) -> PagedKVCache:
        """Storage shaped for the model's config (layers, KV heads, head size), on its device or on `device` (a CPU tier's)."""
        spec = kv_cache_spec(model.config)
        parameter = next(model.parameters())
        return cls(
            spec.num_layers,
            num_blocks,
            block_size,
            spec.num_kv_heads,
            spec.head_dim,
            dtype=parameter.dtype,
            device=parameter.device if device is None else device,
        )

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """See PagedCacheLayer.get_seq_length: positions must come from position_ids."""
        return self.layers[layer_idx].get_seq_length()

    @property
    def nbytes(self) -> int:
        """Bytes held by all keys and values, every layer."""
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.layers)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    block_tables: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    scaling: float | None = None,
    backend: str = "reference",
    fast_metadata: FastAttentionMetadata | None = None,
    attention_timer: AttentionTimer | None = None,
    cache: PagedKVCache | None = None,
    slot_mapping: torch.Tensor | None = None,
    **_: object,
) -> tuple[torch.Tensor, None]:
    """The model's attention over the paged cache: decode-only steps take the decode kernel, mixed ones the varlen form.

    query is [1, H, T, D]; key and value are the layer's paged storage, [num_blocks, block_size, KVH, D]
    (what PagedCacheLayer.update returned; KVH < H under grouped-query attention). Returns [1, T, H, D],
    as transformers expects. The fast backend reads the step's
    FastAttentionMetadata (built once per step by the runner; here when it did not).
    Before transformers 5.24, the models knew no `cache` argument: `cache` then arrives here as a plain
    keyword, key and value are this step's own, and this function writes them into the paged storage.
    """
    if isinstance(cache, PagedKVCache):  # transformers < 5.24: the model did not call our update(); do it here
        key, value = cache.layers[module.layer_idx].update(key, value, kwargs={"slot_mapping": slot_mapping})
    if key.dim() != 4 or block_tables is None or seq_lens is None or query_start_loc is None:
        raise ValueError(
            "the kvcourse_paged attention needs the PagedKVCache and the forward keywords block_tables, "
            "seq_lens and query_start_loc: run the model through kvcourse's ModelRunner."
        )
    started = attention_timer.start(query.device) if attention_timer else 0.0
    queries = query[0].transpose(0, 1)  # [T, H, D]
    if backend == "fast":
        if fast_metadata is None:
            fast_metadata = FastAttentionMetadata.build(block_tables, seq_lens, query_start_loc, key.shape[1])
        out = fast_paged_attention(queries, key, value, fast_metadata, scale=scaling)
    elif queries.shape[0] == block_tables.shape[0]:  # T == B: one query per sequence, a pure decode step
        decode = attention.triton_paged_decode_attention if backend == "triton" else attention.paged_decode_attention
        out = decode(queries, key, value, block_tables, seq_lens, scale=scaling)
    else:
        out = attention.paged_attention(queries, key, value, block_tables, seq_lens, query_start_loc, scale=scaling)
    if attention_timer:
        attention_timer.stop(started, query.device)
    return out.unsqueeze(0), None


def register_paged_attention() -> None:
    """Make our attention functions known to transformers under ATTENTION_IMPLEMENTATIONS' names."""
    for backend, name in ATTENTION_IMPLEMENTATIONS.items():
        AttentionInterface.register(name, functools.partial(paged_attention_forward, backend=backend))


register_paged_attention()
