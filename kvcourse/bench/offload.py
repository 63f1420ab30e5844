"""Lesson 10's measurements: what a CPU tier costs (copy bandwidth) and buys (Mooncake hits, prefill and TTFT saved).

* `copy_bandwidth(model)`: bytes per second of the runner's real block copies, device -> CPU and back;
* `prefill_tokens_per_s(model)`: the engine's prefill speed on this machine (what a load saves);
* `load_or_recompute(...)`: when loading a prompt's K/V is cheaper than recomputing it, and from what length;
* `two_tier_study()`: the Mooncake conversation trace through a device cache and a CPU tier (a pure replay,
  trace.replay, the code 4.7's numbers come from), stored in notebooks/data/two_tier_mooncake.json;
* `ttft_slice(model)`: the time to first token of a slice of that trace through the engine, tier on and off.
Run `python -m kvcourse.bench.offload` to redo the replay study and store it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

DATA = Path(__file__).resolve().parents[2] / "notebooks" / "data" / "two_tier_mooncake.json"
DEVICE_CAPACITIES = (10**6, 3 * 10**6, 10**7)  # tokens: about one GPU's worth up to ten
TIER_CAPACITIES = (0, 10**7, 2 * 10**7, 5 * 10**7)  # tokens of CPU memory (0: the device cache alone)


@dataclass
class CopyCost:
    """Measured block copies between the runner's device pool and its CPU pool."""

    device: str
    bytes_per_block: int
    save_bytes_per_s: float  # device -> CPU
    load_bytes_per_s: float  # CPU -> device
    seconds_per_copy_call: float  # the fixed part: one transfer_blocks call of one block


def copy_bandwidth(model: torch.nn.Module, num_blocks: int = 64, block_size: int = 16, repeats: int = 5) -> CopyCost:
    """Time the runner's own transfer_blocks (every layer, keys and values) for num_blocks blocks, best of `repeats`."""
    from kvcourse.worker.model_runner import ModelRunner

    runner = ModelRunner(model, num_blocks, block_size, num_cpu_tier_blocks=num_blocks, pack_weights=False)
    pairs = [(i, i) for i in range(num_blocks)]
    bytes_per_block = runner.kv_cache.nbytes // num_blocks
    _timed(runner, pairs, pairs)  # warm-up
    save = min(_timed(runner, pairs, []) for _ in range(repeats))
    load = min(_timed(runner, [], pairs) for _ in range(repeats))
    one = min(_timed(runner, [(0, 0)], []) for _ in range(repeats))
    total = bytes_per_block * num_blocks
    return CopyCost(str(runner.device), bytes_per_block, total / save, total / load, one)


def _timed(runner: object, saves: list[tuple[int, int]], loads: list[tuple[int, int]]) -> float:
    """Seconds of one transfer_blocks call, the device's queue drained before and after."""
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    runner.transfer_blocks(saves, loads)
    sync()
    return time.perf_counter() - start


def prefill_tokens_per_s(model: torch.nn.Module, prompt_len: int = 256, repeats: int = 3) -> float:
    """Prompt tokens per second through the engine (one prompt, one generated token: all prefill), best of repeats."""
    from kvcourse.engine.llm_engine import LLMEngine

    prompt_len = min(prompt_len, _max_positions(model) - 1)
    prompt = [(7 * i) % 1000 for i in range(prompt_len)]
    best = float("inf")
    for _ in range(repeats):
        engine = LLMEngine(model, num_blocks=prompt_len // 16 + 4, block_size=16, token_budget=prompt_len)
        start = time.perf_counter()
        engine.generate([prompt], 1, progress=False)
        best = min(best, time.perf_counter() - start)
    return prompt_len / best


def _max_positions(model: torch.nn.Module) -> int:
    """The model's context length (GPT-2's n_positions, Llama's max_position_embeddings)."""
    config = model.config
    return int(getattr(config, "n_positions", None) or config.max_position_embeddings)


def load_or_recompute(
    cost: CopyCost, tokens_per_s: float, block_size: int, lengths: Sequence[int] = (16, 64, 256, 1024)
) -> list[dict]:
    """For each prompt length: seconds to load its K/V from the CPU tier vs to recompute it, and which wins."""
    rows = []
    for n in lengths:
        blocks = -(-n // block_size)
        load = cost.seconds_per_copy_call + blocks * cost.bytes_per_block / cost.load_bytes_per_s
        recompute = n / tokens_per_s
        rows.append({"tokens": n, "load_s": load, "recompute_s": recompute, "load_wins": load < recompute})
    return rows


# ---------------------------------------------------------------------------------------------- Mooncake
def two_tier_study(
    device_capacities: Sequence[int] = DEVICE_CAPACITIES, tier_capacities: Sequence[int] = TIER_CAPACITIES
) -> dict:
    """Hit rate and prefill tokens saved on the conversation trace, per device size and CPU tier size (a pure replay)."""
    from kvcourse.bench.trace import capacity_blocks, replay, trace_requests
    from kvcourse.bench.traces import load_trace

    chat = load_trace("conversation")
    requests = trace_requests(chat)
    rows = []
    for device in device_capacities:
        for tier in tier_capacities:
            result = replay(chat, requests, capacity_blocks(device), tier_blocks=capacity_blocks(tier) if tier else 0)
            rows.append(
                {
                    "device_tokens": device,
                    "tier_tokens": tier,
                    "hit_rate": result.hit_rate,
                    "tier_hit_rate": result.tier_hit_tokens / result.prompt_tokens,
                    "prefill_tokens_saved": result.hit_tokens,
                    "prompt_tokens": result.prompt_tokens,
                }
            )
    single = replay(chat, requests, capacity_blocks(6 * 10**7))
    return {
        "trace": "conversation",
        "requests": len(chat),
        "rows": rows,
        "single_cache_6e7_hit_rate": single.hit_rate,
        "note": "pure replay (request order only, no model): trace.replay with lesson 10's tier (kvcourse/offload.py)",
    }


def store(result: dict, path: Path = DATA) -> Path:
    """Write the study where notebook 10 and tests/test_offload_bench.py read it."""
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def stored(path: Path = DATA) -> dict:
    """The stored study (notebook 10 plots it without replaying)."""
    return json.loads(path.read_text())


def ttft_slice(
    model: torch.nn.Module, start: int = 2000, num_requests: int = 120, tier_blocks: int = 512, **engine: int
) -> dict:
    """Total time to first token of a slice of the conversation trace, one request at a time, tier off and on.

    The trace's 512-token blocks become 16 stand-in tokens each (a tiny model's context is short), cut to
    the model's context; the device cache is kept small so that a conversation's earlier turns are evicted.
    """
    from kvcourse.bench.traces import load_trace, prompt_tokens, truncated
    from kvcourse.engine.llm_engine import LLMEngine

    knobs = {"num_blocks": 16, "block_size": 16, "token_budget": 512, **engine}
    max_blocks = min(
        12, (_max_positions(model) - 2) // 16
    )  # up to 12 trace blocks: a conversation outgrows 16 device blocks
    trace = load_trace("conversation", start + num_requests)[
        start:
    ]  # a slice where a few turns come back after the device forgot them
    prompts = [prompt_tokens(truncated(r, max_blocks), 16, 1000) for r in trace]
    LLMEngine(model, **knobs).generate(prompts[:2], 1, progress=False)  # warm-up: the first run pays for setup
    result = {}
    for label, blocks in (("off", 0), ("on", tier_blocks)):
        engine = LLMEngine(model, enable_prefix_caching=True, num_cpu_tier_blocks=blocks, **knobs)
        began, engine.stats_computed = time.perf_counter(), 0
        for prompt in prompts:
            engine.generate([prompt], 1, progress=False)
            engine.stats_computed += engine.stats.scheduled_tokens
        loaded = engine.tier.stats.loaded if engine.tier is not None else 0
        result[label] = {
            "ttft_total_s": time.perf_counter() - began,
            "blocks_loaded": loaded,
            "prompt_tokens_computed": engine.stats_computed,
        }
    result["prompt_tokens"] = sum(map(len, prompts))
    return result


def main() -> None:
    """Redo the replay study and store it (about 30 s of CPU)."""
    result = two_tier_study()
    print(f"stored {store(result)}")
    for row in result["rows"]:
        print(f"device {row['device_tokens']:>10,}  tier {row['tier_tokens']:>10,}  hit rate {row['hit_rate']:.4f}")


if __name__ == "__main__":
    main()


__all__ = [
    "CopyCost",
    "copy_bandwidth",
    "load_or_recompute",
    "prefill_tokens_per_s",
    "stored",
    "ttft_slice",
    "two_tier_study",
]
