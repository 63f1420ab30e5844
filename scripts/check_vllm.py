"""Check every vLLM path and symbol the course names against the source of one vLLM release.

    python scripts/check_vllm.py                      # downloads the wheel (pip download --no-deps; never installed)
    python scripts/check_vllm.py --wheel WHEEL.whl    # or reads a wheel you already have

The course compares itself with vLLM on almost every page; this script keeps those comparisons honest.
It collects every vLLM path the course's text names (`vllm/...` in the notebooks' sources, README,
CONTRIBUTING, and the comments of `kvcourse/` and `solutions/`), every symbol written next to one
(`vllm/v1/core/block_pool.py` · `BlockPool`, or `BlockPool` (`vllm/v1/core/block_pool.py`)), every
`vllm:` metric name, and the prose claims listed in CLAIMS below; it opens the wheel's Python files
(a wheel is a zip: nothing is installed or imported) and writes a verdict for each, with the version
and the date, to REPORT. `tests/test_vllm_facts.py` fails when the course names a vLLM path the
report does not list as found. Not run by CI (the wheel is hundreds of MB): CONTRIBUTING says when.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VLLM_VERSION = "0.33.0"  # the release the course compares itself with (README, "Reading vLLM")
REPORT = ROOT / "notebooks" / "data" / "vllm_checked.json"

# The course's own text: where a vLLM path or symbol may be named.
SOURCE_GLOBS = (
    "README.md",
    "CONTRIBUTING.md",
    "notebooks/[0-9][0-9]_*.py",
    "kvcourse/**/*.py",
    "solutions/*.py",
    "docs/**/*.md",
)
_SKIP_DIRS = {".git", ".venv", "node_modules", "__pycache__", "build", "backups", ".ipynb_checkpoints"}

# vLLM's own subpackages: a path starting with one of these (and no `vllm/` before it) is a vLLM path
# written so that a reader cannot open it from the repository root.
VLLM_SUBPACKAGES = (
    "v1|entrypoints|config|model_executor|distributed|engine|attention|core|sched|worker|metrics|"
    "compilation|executor|spec_decode|kv_offload|multimodal|platforms|lora|transformers_utils"
)
_SYMBOL = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*(?:\(\))?"
_PATH = r"vllm/(?:[\w-]+/)*(?:\{[\w,-]+\}\.py|[\w-]+\.py)|vllm/(?:[\w-]+/)+(?![\w{])"
PATH_RE = re.compile(rf"(?<![\w/.-])(?:{_PATH})")
URL_RE = re.compile(r"github\.com/vllm-project/vllm/(?:blob|tree)/[^/\s)]+/(vllm/[\w/.-]*[\w/])")  # a link to a file
PARTIAL_RE = re.compile(rf"(?<![\w/.-])(?:{VLLM_SUBPACKAGES})/(?:[\w-]+/)*(?:\{{[\w,-]+\}}\.py|[\w-]+\.py)")
BARE_RE = re.compile(r"`([\w-]+\.py)`")
METRIC_RE = re.compile(r"(?<![\w-])vllm:[a-z][a-z0-9_:]*[a-z0-9]")
# `PATH` · `Sym`, `Sym2` (`method`, ...)   and   `Sym` (`PATH`)   and   `Sym` in `PATH`
AFTER_PATH_RE = re.compile(
    rf"`(?P<path>{_PATH})`\s*(?:·|::)\s*(?P<symbols>`{_SYMBOL}`(?:\s*(?:,|and|\(|\)|;)\s*`{_SYMBOL}`)*)"
)
BEFORE_PATH_RE = re.compile(rf"`(?P<symbol>{_SYMBOL})`\s*(?:\(|in\s)\s*`(?P<path>{_PATH})`")
_METRIC_SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")


@dataclass(frozen=True)
class Claim:
    """A fact the course's prose states about vLLM, checked in the named file."""

    path: str
    symbol: str  # "" for the file alone; "Class.member" or a top-level name
    contains: tuple[str, ...] = ()  # text the symbol's own source must hold
    says: str = ""  # the course's sentence, in short


# Facts the prose states without a path next to them (each notebook names its file once).
CLAIMS = (
    Claim(
        "vllm/config/scheduler.py", "SchedulerConfig.watermark", ("default=0.0",), "v1 has a watermark, off by default"
    ),
    Claim(
        "vllm/config/watermarking.py",
        "WatermarkConfig",
        ("text watermark",),
        "vllm:watermark_requests counts text-watermarked outputs, not KV headroom",
    ),
    Claim(
        "vllm/v1/metrics/loggers.py",
        "PrometheusStatLogger",
        ('"vllm:watermark_requests"', "watermark_config"),
        "the watermark metric exists only with a watermark_config",
    ),
    Claim(
        "vllm/v1/core/kv_cache_manager.py",
        "KVCacheManager.allocate_slots",
        ("watermark_blocks", "full_sequence_must_fit", "num_lookahead_tokens"),
        "admission applies the watermark and the whole-prompt gate; lookahead slots are reserved",
    ),
    Claim(
        "vllm/config/scheduler.py",
        "SchedulerConfig.scheduler_reserve_full_isl",
        ("= True",),
        "admission checks that the whole prompt fits, on by default",
    ),
    Claim(
        "vllm/config/scheduler.py",
        "SchedulerConfig.long_prefill_token_threshold",
        (),
        "a cap on one long prompt's chunk",
    ),
    Claim("vllm/config/scheduler.py", "SchedulerConfig.max_num_batched_tokens", (), "the token budget"),
    Claim("vllm/config/scheduler.py", "SchedulerConfig.policy", (), "scheduling_policy fcfs or priority"),
    Claim(
        "vllm/config/scheduler.py", "SchedulerConfig.async_scheduling", (), "async scheduling (on unless unsupported)"
    ),
    Claim(
        "vllm/config/vllm.py", "VllmConfig", ("async_scheduling = True",), "async scheduling is turned on by default"
    ),
    Claim("vllm/config/cache.py", "CacheConfig.gpu_memory_utilization", ("default=0.92",), "KV memory sizing's share"),
    Claim("vllm/config/cache.py", "CacheConfig.prefix_caching_hash_algo", ('"sha256"',), "SHA-256 is the default hash"),
    Claim(
        "vllm/v1/core/block_pool.py",
        "BlockPool.free_blocks",
        ("prepend_n(blocks_to_evict_first)", "append_n(blocks_to_evict_last)", "block.block_hash is None"),
        "unhashed blocks go to the front of the free queue, hashed ones to the back",
    ),
    Claim(
        "vllm/v1/core/kv_cache_utils.py",
        "FreeKVCacheBlockQueue",
        ("fake_free_list_head", "fake_free_list_tail", "def popleft", "def remove", "def append_n", "def prepend_n"),
        "the free queue: a doubly linked list between two sentinels",
    ),
    Claim(
        "vllm/v1/core/block_pool.py",
        "BlockPool",
        ("self.null_block = self.free_block_queue.popleft()",),
        "block 0 is the null block, taken before anyone allocates",
    ),
    Claim(
        "vllm/v1/core/block_pool.py",
        "BlockPool.get_cached_block",
        ("get_one_block",),
        "the lookup compares hashes, no tokens",
    ),
    Claim(
        "vllm/v1/core/block_pool.py",
        "BlockHashToBlockMap",
        ("don't de-duplicate",),
        "several blocks may be cached under one hash",
    ),
    Claim("vllm/v1/core/block_pool.py", "BlockPool.reset_prefix_cache", (), "reset_prefix_cache"),
    Claim("vllm/v1/core/block_pool.py", "BlockPool.touch", (), "touch: a prefix hit takes a free block back"),
    Claim("vllm/v1/core/block_pool.py", "BlockPool.cache_full_blocks", (), "publishing full blocks"),
    Claim("vllm/v1/core/block_pool.py", "BlockPool.get_new_blocks", (), "allocation from the free queue's front"),
    Claim("vllm/v1/core/kv_cache_utils.py", "NONE_HASH", (), "the hash chain's root"),
    Claim("vllm/v1/core/kv_cache_utils.py", "hash_block_tokens", ("NONE_HASH", "extra_keys"), "the hash chain"),
    Claim(
        "vllm/v1/core/kv_cache_utils.py",
        "generate_block_hash_extra_keys",
        ("lora_extra_keys", "mm_extra_keys", "cache_salt", "prompt_embeds_keys"),
        "extra keys: LoRA, multimodal, cache_salt, prompt embeddings",
    ),
    Claim("vllm/v1/core/kv_cache_utils.py", "get_request_block_hasher", (), "a request's hashes, computed once"),
    Claim("vllm/v1/request.py", "Request.block_hashes", (), "the hashes live on the request"),
    Claim("vllm/v1/request.py", "RequestStatus.FINISHED_ABORTED", (), "an abort's status"),
    Claim("vllm/v1/request.py", "RequestStatus.PREEMPTED", (), "a preempted request's status"),
    Claim(
        "vllm/v1/core/kv_cache_manager.py",
        "KVCacheManager.get_computed_blocks",
        ("tuple[KVCacheBlocks, int, int]",),
        "get_computed_blocks returns three values",
    ),
    Claim(
        "vllm/v1/core/kv_cache_manager.py",
        "KVCacheManager.take_kv_cache_block_copies",
        ("take_pending_cow_copies",),
        "copy-on-write for prefix hits that end inside a block",
    ),
    Claim(
        "vllm/v1/core/single_type_kv_cache_manager.py",
        "SingleTypeKVCacheManager._apply_cow",
        ("_pending_cow_copies",),
        "a partial hit is redirected to a private copy",
    ),
    Claim("vllm/v1/core/kv_cache_manager.py", "KVCacheManager.free", ("coordinator.free",), "free"),
    Claim(
        "vllm/v1/core/single_type_kv_cache_manager.py",
        "SingleTypeKVCacheManager.free",
        ("reversed(",),
        "a request's blocks are freed tail first",
    ),
    Claim("vllm/v1/core/kv_cache_manager.py", "KVCacheManager.reset_prefix_cache", (), "reset_prefix_cache"),
    Claim(
        "vllm/v1/core/sched/scheduler.py",
        "Scheduler.finish_requests",
        ("finished_status: RequestStatus",),
        "finish_requests(request_ids, finished_status): no reason",
    ),
    Claim(
        "vllm/v1/core/sched/scheduler.py",
        "Scheduler.schedule",
        ('no "decoding phase" nor "prefill phase"', "First, schedule the RUNNING", "schedule the WAITING"),
        "schedule() has no phases: running requests in order, then waiting ones",
    ),
    Claim(
        "vllm/v1/core/sched/scheduler.py",
        "Scheduler.schedule",
        ("if new_blocks is None:", "break", "self.running[-1]"),
        "FCFS admission stops at the head; the newest running request is preempted",
    ),
    Claim(
        "vllm/v1/core/sched/scheduler.py",
        "Scheduler.reset_prefix_cache",
        ("reset_running_requests",),
        "a forced reset preempts the running requests first",
    ),
    Claim("vllm/v1/core/sched/scheduler.py", "Scheduler.update_from_output", (), "the step's update"),
    Claim("vllm/v1/core/sched/async_scheduler.py", "AsyncScheduler", (), "async scheduling"),
    Claim(
        "vllm/v1/core/sched/scheduler.py",
        "Scheduler._update_after_schedule",
        (),
        "the plan's token counts applied once, after planning",
    ),
    Claim(
        "vllm/v1/core/sched/output.py", "SchedulerOutput.finished_req_ids", (), "requests settled since the last step"
    ),
    Claim(
        "vllm/v1/core/kv_cache_manager.py",
        "KVCacheManager",
        ("self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)",),
        "watermark blocks: int(watermark * num_blocks)",
    ),
    Claim(
        "vllm/entrypoints/serve/dev/cache/api_router.py",
        "reset_prefix_cache",
        ('router.post("/reset_prefix_cache")', "reset_running_requests"),
        "POST /reset_prefix_cache, with a force option",
    ),
    Claim(
        "vllm/entrypoints/launchers/api_server/routers.py",
        "register_api_routers",
        ("envs.VLLM_SERVER_DEV_MODE", "register_vllm_dev_api_routers"),
        "the dev routes exist only with VLLM_SERVER_DEV_MODE=1",
    ),
    Claim("vllm/entrypoints/llm.py", "LLM.reset_prefix_cache", (), "LLM.reset_prefix_cache()"),
    Claim("vllm/entrypoints/openai/api_server.py", "", ("is deprecated",), "api_server.py is a deprecation shim"),
    Claim("vllm/entrypoints/launchers/api_server/entry.py", "run_server", (), "the API server's start"),
    Claim("vllm/entrypoints/openai/completion/serving.py", "OpenAIServingCompletion", (), "completions"),
    Claim("vllm/entrypoints/openai/completion/protocol.py", "CompletionRequest", (), "the completion request"),
    Claim("vllm/entrypoints/openai/completion/api_router.py", "create_completion", (), "POST /v1/completions"),
    Claim("vllm/envs.py", "VLLM_USE_V2_MODEL_RUNNER", (), "the model-runner switch"),
    Claim(
        "vllm/config/vllm.py",
        "VllmConfig.use_v2_model_runner",
        ("using the V1 model runner instead", "return True"),
        "Model Runner V2 is the default, the V1 runner the fallback",
    ),
    Claim("vllm/v1/worker/gpu/model_runner.py", "GPUModelRunner.execute_model", (), "Model Runner V2"),
    Claim("vllm/v1/worker/gpu/model_runner.py", "GPUModelRunner.prepare_inputs", (), "Model Runner V2's inputs"),
    Claim("vllm/v1/worker/gpu/model_runner.py", "GPUModelRunner.initialize_kv_cache", (), "KV tensors"),
    Claim("vllm/v1/worker/gpu_model_runner.py", "GPUModelRunner._prepare_inputs", (), "the V1 runner's inputs"),
    Claim("vllm/v1/worker/gpu/input_batch.py", "InputBatch", (), "Model Runner V2's batch"),
    Claim("vllm/v1/worker/gpu/states.py", "RequestState", (), "Model Runner V2's persistent request state"),
    Claim("vllm/v1/worker/gpu/block_table.py", "BlockTables", (), "Model Runner V2's block tables"),
    Claim("vllm/v1/worker/gpu_input_batch.py", "InputBatch", (), "the V1 runner's persistent batch"),
    Claim("vllm/v1/worker/gpu/cudagraph_utils.py", "CudaGraphManager", (), "CUDA graphs"),
    Claim("vllm/v1/worker/gpu_worker.py", "Worker.determine_available_memory", (), "KV memory sizing: profiling"),
    Claim("vllm/v1/core/kv_cache_planning.py", "get_kv_cache_configs", (), "KV memory sizing: blocks per group"),
    Claim(
        "vllm/v1/core/kv_cache_planning.py", "check_enough_kv_cache_memory", (), "KV memory sizing: max_model_len fits"
    ),
    Claim("vllm/v1/kv_cache_interface.py", "KVCacheSpec", (), "a layer's KV layout"),
    Claim("vllm/v1/kv_cache_interface.py", "FullAttentionSpec", (), "full attention's spec"),
    Claim("vllm/v1/kv_cache_interface.py", "KVCacheConfig", (), "the KV cache's plan"),
    Claim("vllm/v1/core/kv_cache_coordinator.py", "HybridKVCacheCoordinator", (), "the hybrid allocator"),
    Claim("vllm/v1/core/kv_cache_coordinator.py", "get_kv_cache_coordinator", (), "the coordinator's factory"),
    Claim("vllm/v1/core/single_type_kv_cache_manager.py", "FullAttentionManager", (), "one manager per group"),
    Claim("vllm/v1/core/single_type_kv_cache_manager.py", "SlidingWindowManager", (), "sliding window's manager"),
    Claim("vllm/v1/core/single_type_kv_cache_manager.py", "MambaManager", (), "Mamba's manager"),
    Claim(
        "vllm/v1/core/kv_cache_manager.py", "KVCacheBlocks", ("tuple[Sequence[KVCacheBlock], ...]",), "blocks per group"
    ),
    Claim("vllm/v1/metrics/stats.py", "PrefixCacheStats", (), "prefix-cache statistics"),
    Claim("vllm/distributed/kv_events.py", "BlockStored", (), "KV-cache events"),
    Claim("vllm/distributed/kv_events.py", "BlockRemoved", (), "KV-cache events"),
    Claim(
        "vllm/distributed/kv_transfer/kv_connector/v1/base.py",
        "KVConnectorBase_V1",
        ("get_num_new_matched_tokens",),
        "KV connectors",
    ),
    Claim(
        "vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py",
        "OffloadingConnector",
        (),
        "CPU KV offload",
    ),
    Claim(
        "vllm/distributed/kv_transfer/kv_connector/v1/nixl/connector.py",
        "NixlPullConnector",
        (),
        "disaggregated prefill: KV moved between machines",
    ),
    Claim("vllm/distributed/kv_transfer/kv_connector/factory.py", "", ('"NixlConnector"',), "the connectors by name"),
    Claim("vllm/_custom_ops.py", "reshape_and_cache_flash", (), "the cache write of this layout"),
    Claim(
        "vllm/v1/attention/backends/flash_attn.py", "", ("reshape_and_cache_flash(",), "FlashAttention writes the cache"
    ),
    Claim(
        "vllm/v1/attention/backends/triton_attn.py",
        "",
        ("triton_reshape_and_cache_flash",),
        "the Triton backend writes it with a Triton kernel",
    ),
    Claim("vllm/v1/attention/selector.py", "get_attn_backend", (), "a backend chosen per device and model"),
    Claim("vllm/v1/attention/backends/flashinfer.py", "FlashInferBackend", (), "FlashInfer"),
    Claim("vllm/v1/request.py", "Request.spec_token_ids", (), "draft tokens on the request"),
    Claim("vllm/v1/request.py", "Request.num_output_placeholders", (), "async scheduling's placeholders"),
    Claim("vllm/v1/request.py", "Request.cache_salt", (), "the request's salt"),
    Claim("vllm/v1/request.py", "Request.priority", (), "priority"),
    Claim("vllm/v1/request.py", "Request.arrival_time", (), "arrival time"),
    Claim("vllm/v1/request.py", "Request.lora_request", (), "a LoRA adapter"),
    Claim("vllm/v1/request.py", "RequestStatus.WAITING_FOR_REMOTE_KVS", (), "waiting for a connector's K/V"),
    Claim("vllm/v1/request.py", "RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR", (), "waiting for a grammar"),
    Claim("vllm/v1/request.py", "RequestStatus.FINISHED_STOPPED", (), "finished statuses"),
    Claim("vllm/v1/request.py", "RequestStatus.FINISHED_LENGTH_CAPPED", (), "finished statuses"),
    Claim("vllm/v1/core/kv_cache_utils.py", "FreeKVCacheBlockQueue.popleft_n", (), "batch pops"),
    Claim("vllm/v1/core/kv_cache_utils.py", "KVCacheBlock.prev_free_block", (), "the list's links"),
    Claim("vllm/v1/core/block_pool.py", "BlockPool._maybe_evict_cached_block", (), "eviction on hand-out"),
    Claim("vllm/v1/core/block_pool.py", "BlockPool.null_block", (), "the null block"),
    Claim("vllm/v1/core/block_pool.py", "BlockPool.kv_event_queue", (), "the pool queues KV events"),
    Claim("vllm/distributed/kv_events.py", "AllBlocksCleared", (), "KV-cache events"),
    Claim("vllm/config/kv_events.py", "KVEventsConfig.enable_kv_cache_events", ("= False",), "events off by default"),
    Claim("vllm/config/scheduler.py", "SchedulerConfig.max_num_seqs", (), "a cap on running requests"),
    Claim("vllm/v1/core/kv_cache_coordinator.py", "UnitaryKVCacheCoordinator", (), "one group"),
    Claim("vllm/v1/kv_cache_interface.py", "SlidingWindowSpec", (), "sliding window's spec"),
    Claim("vllm/v1/kv_cache_interface.py", "MambaSpec", (), "Mamba's spec"),
    Claim(
        "vllm/v1/core/single_type_kv_cache_manager.py",
        "SingleTypeKVCacheManager",
        (),
        "one manager per KV-cache group",
    ),
    Claim(
        "vllm/distributed/kv_transfer/kv_connector/v1/base.py",
        "KVConnectorBase_V1.save_kv_layer",
        (),
        "the worker saves K/V layer by layer",
    ),
    Claim("vllm/distributed/kv_transfer/kv_connector/v1/base.py", "KVConnectorBase_V1.start_load_kv", (), "and loads"),
    # notebook 10 (issue 40): the course's CPU tier follows the connector's scheduler-side shape
    Claim(
        "vllm/distributed/kv_transfer/kv_connector/v1/base.py",
        "KVConnectorBase_V1.get_num_new_matched_tokens",
        ("num_computed_tokens", "tuple[int | None, bool]"),
        "asked after the local hits for tokens beyond them; vLLM's also says whether the load is async",
    ),
    Claim(
        "vllm/distributed/kv_transfer/kv_connector/v1/base.py",
        "KVConnectorBase_V1.update_state_after_alloc",
        ("num_external_tokens",),
        "told the blocks allocated for the external tokens",
    ),
    Claim(
        "vllm/v1/core/sched/scheduler.py",
        "",
        ("request.status = RequestStatus.WAITING_FOR_REMOTE_KVS",),
        "an async load puts the request in WAITING_FOR_REMOTE_KVS",
    ),
    Claim("vllm/v1/kv_offload/cpu/manager.py", "CPUOffloadingManager", (), "the CPU offloading tier's manager"),
    Claim("vllm/v1/kv_offload/cpu/policies/lru.py", "LRUCachePolicy", (), "the CPU tier evicts least recently used"),
    Claim("vllm/v1/sample/rejection_sampler.py", "RejectionSampler", (), "drafts checked in one pass"),
    Claim("vllm/v1/spec_decode/ngram_proposer.py", "NgramProposer", (), "an n-gram drafter"),
    Claim("vllm/v1/spec_decode/eagle.py", "EagleProposer", (), "EAGLE"),
    Claim("vllm/v1/spec_decode/draft_model.py", "", (), "a draft model"),
    Claim(
        "vllm/v1/core/sched/scheduler.py",
        "Scheduler.update_from_output",
        ("request.num_computed_tokens -= num_rejected",),
        "rejected drafts roll num_computed_tokens back",
    ),
    Claim(
        "vllm/v1/engine/core.py",
        "EngineCore.step_with_batch_queue",
        (),
        "the overlapped loop (async scheduling)",
    ),
    Claim("vllm/v1/engine/core.py", "EngineCore._initialize_kv_caches", ("get_kv_cache_configs",), "start-up sizing"),
    Claim("vllm/config/vllm.py", "VllmConfig.max_concurrent_batches", ("async_scheduling",), "two batches in flight"),
    Claim("vllm/v1/engine/input_processor.py", "InputProcessor._validate_prompt_len", ("max_model_len",), "too long"),
    Claim("vllm/v1/worker/gpu_input_batch.py", "CachedRequestState", (), "the V1 runner's request state"),
    Claim("vllm/v1/core/sched/output.py", "NewRequestData", (), "a new request, in full"),
    Claim("vllm/v1/core/sched/output.py", "CachedRequestData", ("new_block_ids",), "a running one: what changed"),
    Claim("vllm/v1/attention/backends/utils.py", "PAD_SLOT_ID", ("= -1",), "padding slots are -1"),
    Claim(
        "vllm/v1/cudagraph_dispatcher.py",
        "CudagraphDispatcher._compute_bs_to_padded_graph_size",
        (),
        "token counts padded to a captured CUDA-graph size",
    ),
    Claim("vllm/v1/attention/backends/flash_attn.py", "FlashAttentionBackend", (), "the attention backends"),
    Claim("vllm/v1/attention/backends/triton_attn.py", "TritonAttentionImpl", (), "Triton attention"),
    Claim("vllm/v1/attention/ops/triton_unified_attention.py", "unified_attention", (), "the Triton kernel"),
    Claim("vllm/v1/spec_decode/eagle.py", "", (), "speculative decoding's drafter"),
    Claim(
        "vllm/v1/engine/core.py",
        "EngineCore.step",
        ("self.scheduler.schedule(", "execute_model(", "sample_tokens(", "update_from_output("),
        "the engine's step: schedule, execute (then sample), update",
    ),
    Claim("vllm/v1/engine/async_llm.py", "AsyncLLM", (), "the API server's engine client"),
    Claim("vllm/v1/engine/llm_engine.py", "LLMEngine", (), "the offline engine"),
    Claim("vllm/v1/engine/detokenizer.py", "IncrementalDetokenizer", (), "streaming detokenisation"),
    Claim("vllm/v1/engine/parallel_sampling.py", "ParentRequest", (), "n > 1 as child requests"),
    Claim("vllm/v1/metrics/loggers.py", "PrometheusStatLogger", (), "Prometheus metrics"),
    Claim(
        "vllm/model_executor/layers/quantization/base_config.py",
        "QuantizeMethodBase.process_weights_after_loading",
        (),
        "weights converted once after loading",
    ),
)


# ---------------------------------------------------------------- what the course names


def course_files(root: Path = ROOT) -> list[Path]:
    """The course's own text files (sources, docs, comments), this script left out."""
    files = {p for pattern in SOURCE_GLOBS for p in root.glob(pattern) if p.is_file()}
    skipped = {Path(__file__).resolve()}
    return sorted(p for p in files if p.resolve() not in skipped and not _SKIP_DIRS & set(p.relative_to(root).parts))


def expand(path: str) -> list[str]:
    """`a/{b,c}.py` -> `a/b.py`, `a/c.py`: one path per file a reader opens."""
    match = re.search(r"\{([^}]*)\}", path)
    if not match:
        return [path]
    return [path[: match.start()] + part + path[match.end() :] for part in match.group(1).split(",")]


def _where(file: Path, root: Path, text: str, index: int) -> str:
    """file:line of a character offset, for a reader to find the sentence."""
    return f"{file.relative_to(root).as_posix()}:{text.count(chr(10), 0, index) + 1}"


def _symbols_in(group: str) -> list[str]:
    """`A`, `B` (`m`) -> ["A", "B", "B.m"]: names in a run of backticked symbols, methods under their class."""
    names: list[str] = []
    owner, depth = None, 0
    for token in re.finditer(rf"`({_SYMBOL})`|\(|\)", group):
        if token.group(0) == "(":
            depth += 1
        elif token.group(0) == ")":
            depth = max(0, depth - 1)
        else:
            name = token.group(1).removesuffix("()")
            if depth and owner and "." not in name:
                names.append(f"{owner}.{name}")
            else:
                names.append(name)
                owner = name
    return names


def named_references(files: list[Path], root: Path = ROOT) -> dict[str, dict]:
    """Every vLLM path, symbol (next to a path), metric and mis-written path in the course, with where."""
    paths: dict[str, list[str]] = {}
    symbols: dict[tuple[str, str], list[str]] = {}
    metrics: dict[str, list[str]] = {}
    partial: list[str] = []
    bare: list[str] = []
    course_names = _course_file_names(root)
    for file in files:
        text = file.read_text(encoding="utf-8")
        for match in PATH_RE.finditer(text):
            for path in expand(match.group(0)):
                paths.setdefault(path, []).append(_where(file, root, text, match.start()))
        for match in URL_RE.finditer(text):
            paths.setdefault(match.group(1), []).append(_where(file, root, text, match.start()))
        for match in AFTER_PATH_RE.finditer(text):
            for path in expand(match.group("path")):
                for name in _symbols_in(match.group("symbols")):
                    symbols.setdefault((path, name), []).append(_where(file, root, text, match.start()))
        for match in BEFORE_PATH_RE.finditer(text):
            for path in expand(match.group("path")):
                name = match.group("symbol").removesuffix("()")
                symbols.setdefault((path, name), []).append(_where(file, root, text, match.start()))
        for match in METRIC_RE.finditer(text):
            metrics.setdefault(match.group(0), []).append(_where(file, root, text, match.start()))
        for match in PARTIAL_RE.finditer(text):
            partial.append(f"{_where(file, root, text, match.start())}: {match.group(0)}")
        for match in BARE_RE.finditer(text):
            if match.group(1) not in course_names:
                bare.append(f"{_where(file, root, text, match.start())}: {match.group(1)}")
    return {"paths": paths, "symbols": symbols, "metrics": metrics, "partial": partial, "bare": bare}


def is_prose(where: str) -> bool:
    """Whether a `file:line` is in the lessons' text (notebooks, README, CONTRIBUTING, docs), not a code comment."""
    return where.startswith(("notebooks/", "README.md", "CONTRIBUTING.md", "docs/"))


def _course_file_names(root: Path) -> set[str]:
    """Names of the Python files in this repository: a bare `name.py` in the text must be one of them."""
    names = set()
    for _folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.startswith(".")]
        names.update(f for f in files if f.endswith(".py"))
    return names


# ---------------------------------------------------------------- what the wheel holds


class Wheel:
    """A vLLM wheel read as a zip: its Python files and folders, parsed on demand (nothing imported)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.zip = zipfile.ZipFile(path)
        self.files = {n for n in self.zip.namelist() if n.startswith("vllm/")}
        self.dirs = {str(Path(n).parent) + "/" for n in self.files} | {
            "/".join(n.split("/")[:i]) + "/" for n in self.files for i in range(1, n.count("/") + 1)
        }
        self._trees: dict[str, ast.Module | None] = {}

    def has(self, path: str) -> str | None:
        """'file', 'directory', or None."""
        if path in self.files:
            return "file"
        if path.rstrip("/") + "/" in self.dirs:
            return "directory"
        return None

    def text(self, path: str) -> str:
        return self.zip.read(path).decode("utf-8")

    def tree(self, path: str) -> ast.Module | None:
        if path not in self._trees:
            self._trees[path] = ast.parse(self.text(path)) if path.endswith(".py") and path in self.files else None
        return self._trees[path]

    def mentions(self, needle: str) -> bool:
        """Whether any Python file of the package holds the string (metric names are spelled whole)."""
        return any(needle in self.text(n) for n in sorted(self.files) if n.endswith(".py"))


def _members(node: ast.ClassDef) -> dict[str, ast.AST]:
    """A class's methods, class attributes, fields and the attributes its methods set on self."""
    found: dict[str, ast.AST] = {}
    for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.setdefault(item.name, item)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            found.setdefault(item.target.id, item)
        elif isinstance(item, ast.Assign):
            for target in item.targets:
                if isinstance(target, ast.Name):
                    found.setdefault(target.id, item)
    for item in ast.walk(node):
        if isinstance(item, ast.Assign | ast.AnnAssign):
            targets = item.targets if isinstance(item, ast.Assign) else [item.target]
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                ):
                    found.setdefault(target.attr, item)
    return found


def _top_level(tree: ast.Module) -> dict[str, ast.AST]:
    """A module's classes, functions, assigned and annotated names, and names it imports (re-exports)."""
    found: dict[str, ast.AST] = {}
    body = list(tree.body)
    for item in body:
        if isinstance(item, ast.If | ast.Try):  # `if TYPE_CHECKING:` and try/except imports define names too
            body.extend(
                item.body + getattr(item, "orelse", []) + [h for x in getattr(item, "handlers", []) for h in x.body]
            )
        elif isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.setdefault(item.name, item)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            found.setdefault(item.target.id, item)
        elif isinstance(item, ast.Assign):
            for target in item.targets:
                if isinstance(target, ast.Name):
                    found.setdefault(target.id, item)
        elif isinstance(item, ast.ImportFrom | ast.Import):
            for alias in item.names:
                found.setdefault((alias.asname or alias.name).split(".")[0], item)
    return found


def find_symbol(tree: ast.Module, symbol: str) -> ast.AST | None:
    """The definition of `name`, `Class.member` (also inherited names are not followed), or None.

    A bare name is looked up at the top level first, then among every class's members (a method
    named alone, `free_blocks`, is found in the class that defines it).
    """
    head, *rest = symbol.split(".")
    top = _top_level(tree)
    node = top.get(head)
    if node is None and not rest:
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            if head in (members := _members(cls)):
                return members[head]
        return None
    for part in rest:
        if not isinstance(node, ast.ClassDef):
            return None
        node = _members(node).get(part)
    return node


def check_symbol(wheel: Wheel, path: str, symbol: str, contains: tuple[str, ...] = ()) -> dict:
    """Verdict for one symbol in one file: found, its line, and whether its source holds `contains`."""
    verdict: dict = {"path": path, "symbol": symbol, "found": False}
    if wheel.has(path) != "file":
        verdict["problem"] = "no such file in the wheel"
        return verdict
    source = wheel.text(path)
    segment = source
    if symbol:
        tree = wheel.tree(path)
        node = find_symbol(tree, symbol) if tree else None
        if node is None:
            verdict["problem"] = f"{symbol} is not defined in {path}"
            return verdict
        verdict["line"] = node.lineno
        segment = ast.get_source_segment(source, node) or ""
        for decorator in getattr(node, "decorator_list", []):  # a route's decorator says what it serves
            segment = (ast.get_source_segment(source, decorator) or "") + "\n" + segment
        if isinstance(node, ast.AnnAssign | ast.Assign):  # a field's docstring follows it
            segment += "\n" + "\n".join(source.splitlines()[node.end_lineno : node.end_lineno + 6])
    missing = [needle for needle in contains if needle not in segment]
    if missing:
        verdict["problem"] = f"its source does not contain {missing}"
        return verdict
    verdict["found"] = True
    if contains:
        verdict["contains"] = list(contains)
    return verdict


def _metric_found(wheel: Wheel, name: str) -> bool:
    """A Prometheus name as the course writes it, with or without the suffix the client adds."""
    stems = {name} | {name.removesuffix(s) for s in _METRIC_SUFFIXES if name.endswith(s)}
    return any(wheel.mentions(f'"{stem}"') for stem in stems)


def build_report(wheel: Wheel, refs: dict, version: str, checked_on: str) -> dict:
    """Every verdict, with the version, the wheel's digest and the date."""
    paths = [
        {"path": path, "found": wheel.has(path) is not None, "kind": wheel.has(path), "named_in": sorted(set(where))}
        for path, where in sorted(refs["paths"].items())
    ]
    symbols = [
        check_symbol(wheel, path, symbol) | {"named_in": sorted(set(where))}
        for (path, symbol), where in sorted(refs["symbols"].items())
    ]
    claims = [check_symbol(wheel, c.path, c.symbol, c.contains) | {"says": c.says} for c in CLAIMS]
    metrics = [
        {"metric": name, "found": _metric_found(wheel, name), "named_in": sorted(set(where))}
        for name, where in sorted(refs["metrics"].items())
    ]
    everything = itertools.chain(paths, symbols, claims, metrics)
    in_prose = [line for line in refs["partial"] + refs["bare"] if is_prose(line)]
    return {
        "vllm_version": version,
        "wheel": wheel.path.name,
        "wheel_sha256": _sha256(wheel.path),
        "checked_on": checked_on,
        "command": "python scripts/check_vllm.py",
        "all_found": all(v["found"] for v in everything),
        "prose_names_a_path_a_reader_cannot_open": in_prose,
        "paths": paths,
        "symbols": symbols,
        "claims": claims,
        "metrics": metrics,
        "paths_not_from_the_package_root": refs["partial"],
        "bare_file_names_not_in_the_course": refs["bare"],
    }


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download(version: str, into: Path) -> Path:
    """`pip download vllm==VERSION --no-deps`: the wheel only, never installed."""
    command = [sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps", "--only-binary=:all:", "-d"]
    subprocess.run([*command, str(into)], check=True)
    wheels = sorted(into.glob(f"vllm-{version}-*.whl"))
    if not wheels:
        raise SystemExit(f"pip download gave no vllm-{version} wheel in {into}")
    return wheels[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", type=Path, help="a vllm wheel already downloaded (default: download it)")
    parser.add_argument("--version", default=VLLM_VERSION, help=f"the release to check against ({VLLM_VERSION})")
    parser.add_argument("--report", type=Path, default=REPORT, help="where the verdicts go")
    args = parser.parse_args(argv)
    if args.wheel is not None and not args.wheel.is_file():
        parser.error(f"--wheel {args.wheel}: no such file (download one with `pip download vllm==X --no-deps`)")
    with tempfile.TemporaryDirectory() as scratch:
        wheel_path = args.wheel or download(args.version, Path(scratch))
        if f"vllm-{args.version}-" not in wheel_path.name:
            parser.error(f"{wheel_path.name} is not a vllm {args.version} wheel (pass --version to match it)")
        wheel = Wheel(wheel_path)
        refs = named_references(course_files())
        report = build_report(wheel, refs, args.version, datetime.date.today().isoformat())
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    _print_summary(report, args.report)
    return 0 if report["all_found"] and not report["prose_names_a_path_a_reader_cannot_open"] else 1


def _print_summary(report: dict, where: Path) -> None:
    """One line per problem, then the totals."""
    for kind in ("paths", "symbols", "claims", "metrics"):
        for verdict in report[kind]:
            if not verdict["found"]:
                name = verdict.get("path", verdict.get("metric"))
                print(f"NOT FOUND ({kind}): {name} {verdict.get('symbol', '')} {verdict.get('problem', '')}")
    for line in report["paths_not_from_the_package_root"]:
        note = "" if is_prose(line) else " (a code comment: a warning)"
        print(f"write it from the package root (vllm/...){note}: {line}")
    for line in report["bare_file_names_not_in_the_course"]:
        note = "" if is_prose(line) else " (a code comment: a warning)"
        print(f"not a course file; if it is vLLM's, give its path (vllm/...){note}: {line}")
    counts = ", ".join(f"{len(report[k])} {k}" for k in ("paths", "symbols", "claims", "metrics"))
    clean = report["all_found"] and not report["prose_names_a_path_a_reader_cannot_open"]
    verdict = "all found" if clean else "PROBLEMS above"
    print(f"vLLM {report['vllm_version']} ({report['wheel']}): {counts}: {verdict}. Written to {where}")


if __name__ == "__main__":
    sys.exit(main())
