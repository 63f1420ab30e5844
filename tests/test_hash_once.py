"""Issue 11: under memory pressure, prefix caching hashes each full block at most once per request."""

from __future__ import annotations

import random

from reference import load_reference

from kvcourse import toy
from kvcourse.core.request import Request

kv_cache = load_reference("kv_cache")
scheduler_module = load_reference("scheduler")


def shared_prompt_requests(seed: int = 0) -> list[Request]:
    """Notebook 04's workload: 24 requests behind one 64-token system prompt."""
    rng = random.Random(seed)
    system_prompt = [rng.randrange(toy.TOY_VOCAB_SIZE) for _ in range(64)]
    return [
        Request(
            id=i,
            prompt_tokens=system_prompt + [rng.randrange(toy.TOY_VOCAB_SIZE) for _ in range(rng.randint(8, 24))],
            max_new_tokens=rng.randint(8, 16),
        )
        for i in range(24)
    ]


def test_a_pressured_prefix_caching_run_hashes_each_full_block_once(monkeypatch):
    calls = []
    real = kv_cache.hash_block_tokens
    monkeypatch.setattr(kv_cache, "hash_block_tokens", lambda parent, tokens: calls.append(1) or real(parent, tokens))
    requests = shared_prompt_requests()
    manager = kv_cache.KVCacheManager(num_blocks=30, block_size=4, enable_prefix_caching=True)
    scheduler = scheduler_module.StallFreeScheduler(token_budget=128, max_batch_size=8, kv_cache_manager=manager)
    for request in requests:
        scheduler.add_request(request)
    trace = toy.run(scheduler)
    assert trace.num_preemptions > 0, "the run should be under memory pressure (it preempts)"
    full_blocks = sum(request.num_tokens // 4 for request in requests)
    assert 0 < len(calls) <= full_blocks, (
        f"{len(calls)} hash calls for {full_blocks} full blocks (per request): each should be hashed at most once"
    )
    assert all(r.output_tokens == toy.toy_generate(r.prompt_tokens, r.max_new_tokens) for r in requests)
