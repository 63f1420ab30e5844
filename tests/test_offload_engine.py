"""The CPU tier through the engine (issue 40): real K/V copies, bit-identical blocks, the same greedy tokens.

Off by default (num_cpu_tier_blocks=0): every other test runs the engine exactly as before. On, a
prompt whose blocks were evicted from the device comes back from the CPU pool instead of being
recomputed; its tokens must equal those with the tier off and Hugging Face's, under preemption too.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvcourse.course.solutions_switch import solutions_enabled

if not solutions_enabled():
    pytest.skip(
        "the maintainers' tests run against the reference: set KVCOURSE_SOLUTIONS=1 (./course test does)",
        allow_module_level=True,
    )

from kvcourse.engine.llm_engine import LLMEngine, hf_greedy
from kvcourse.models.gpt2 import load_gpt2

torch.set_num_threads(1)
NEW_TOKENS = 5
rng = random.Random(40)


def _prompts(count: int, lo: int, hi: int, prefix: list[int] | None = None) -> list[list[int]]:
    return [(prefix or []) + [rng.randrange(1000) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


PREFIX = _prompts(1, 21, 21)[0]
SHARED = _prompts(6, 1, 9, PREFIX)
OTHER = _prompts(5, 10, 30)
ROUNDS = [SHARED, OTHER, SHARED, OTHER[:3] + SHARED[:3]]  # the second SHARED round finds its prefix in the tier
TIGHT = dict(num_blocks=12, block_size=4, token_budget=24, max_batch_size=6, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def gpt2():
    return load_gpt2("tiny", verbose=False)


def run(model, tier_blocks: int, **knobs) -> tuple[LLMEngine, list[list[list[int]]]]:
    """Every round through one engine; engine.total_preemptions sums them (stats restart with each generate)."""
    engine = LLMEngine(model, **{**TIGHT, **knobs}, num_cpu_tier_blocks=tier_blocks)
    outputs, engine.total_preemptions = [], 0
    for prompts in ROUNDS:
        outputs.append(engine.generate(prompts, NEW_TOKENS))
        engine.total_preemptions += engine.stats.preemptions
    return engine, outputs


def test_the_tier_is_off_by_default(gpt2):
    engine = LLMEngine(gpt2, **TIGHT)
    assert engine.tier is None and engine.runner.cpu_kv_cache is None, "no tier unless num_cpu_tier_blocks > 0"
    assert engine.kv_cache_manager.block_pool.on_evict is None, "without a tier nothing is offered on eviction"


def test_tier_on_and_off_give_the_same_tokens_under_preemption(gpt2):
    off_engine, off = run(gpt2, 0)
    on_engine, on = run(gpt2, 32)
    tier = on_engine.tier.stats
    assert tier.loaded > 0, "the rounds were built so that the second SHARED round loads from the tier"
    assert on_engine.total_preemptions > 0 and off_engine.total_preemptions > 0, (
        "the cache was meant to force preemptions"
    )
    assert on == off, "greedy tokens must be identical with the tier on and off"
    assert on == [[hf_greedy(gpt2, p, NEW_TOKENS) for p in prompts] for prompts in ROUNDS], "and equal to HF's"
    assert on_engine.kv_cache_manager.get_num_free_blocks() == TIGHT["num_blocks"], "device blocks leaked"
    assert not on_engine.scheduler.loading and not on_engine.scheduler.loaded, "a request was left loading"


def test_a_small_tier_drops_blocks_and_failed_loads_fall_back_to_recompute(gpt2):
    _, off = run(gpt2, 0)
    engine, on = run(gpt2, 3)
    assert engine.tier.stats.dropped > 0, "a 3-block tier must drop blocks"
    assert on == off, "loads that fall short are recomputed: the same tokens"


def test_a_loaded_block_is_bit_identical_to_the_evicted_one(gpt2):
    engine = LLMEngine(gpt2, **TIGHT, num_cpu_tier_blocks=32)
    engine.generate(SHARED[:1], NEW_TOKENS)
    pool, layers = engine.kv_cache_manager.block_pool, engine.runner.kv_cache.layers
    snapshot = {
        h: [(layer.keys[b.block_id].clone(), layer.values[b.block_id].clone()) for layer in layers]
        for h, b in pool.cached_block_hash_to_block.items()
    }
    engine.generate(OTHER, NEW_TOKENS)  # evicts SHARED[0]'s blocks into the tier
    loaded_before = engine.tier.stats.loaded
    engine.generate(SHARED[:1], NEW_TOKENS)
    assert engine.tier.stats.loaded > loaded_before, "the prompt's blocks should come back from the tier"
    compared = 0
    for h, kv in snapshot.items():
        block = pool.cached_block_hash_to_block.get(h)
        if block is None:
            continue
        for layer, (keys, values) in zip(layers, kv):
            assert torch.equal(layer.keys[block.block_id], keys), "a loaded block's keys must be bit-identical"
            assert torch.equal(layer.values[block.block_id], values), "a loaded block's values must be bit-identical"
        compared += 1
    assert compared > 0, "some blocks of the first run should be on the device again"


def test_the_loaded_kv_is_really_read(gpt2, monkeypatch):
    """Corrupt the CPU pool after each save: if the tier's K/V were not used, the tokens would not change."""
    engine = LLMEngine(gpt2, **TIGHT, num_cpu_tier_blocks=32)
    real = engine.runner.transfer_blocks

    def corrupting(saves, loads):
        real(saves, [])
        for layer in engine.runner.cpu_kv_cache.layers:
            layer.keys.mul_(-1.0)
        real([], loads)
        for layer in engine.runner.cpu_kv_cache.layers:
            layer.keys.mul_(-1.0)  # undo for the slots not loaded yet; loaded ones went in negated

    monkeypatch.setattr(engine.runner, "transfer_blocks", corrupting)
    outputs = [engine.generate(prompts, NEW_TOKENS) for prompts in ROUNDS]
    assert engine.tier.stats.loaded > 0, "the rounds should load from the tier"
    _, honest = run(gpt2, 32)
    assert outputs != honest, "negated keys loaded from the tier must change the tokens: the loads are read"


def test_tier_on_and_off_give_the_same_tokens_on_llama():
    from kvcourse.models.llama import random_llama, tiny_llama_config

    model = random_llama(tiny_llama_config(vocab_size=1000))  # the prompts' ids run to 999
    off_engine, off = run(model, 0)
    on_engine, on = run(model, 32)
    assert on_engine.tier.stats.loaded > 0, "the second SHARED round should load from the tier"
    assert on == off, "greedy tokens must be identical with the tier on and off (Llama)"


def test_the_widget_records_the_steps_that_move_blocks(gpt2):
    from kvcourse.viz.tier import record_tier_run

    engine = LLMEngine(gpt2, **TIGHT, num_cpu_tier_blocks=32)
    frames = record_tier_run(engine, ROUNDS, NEW_TOKENS)
    assert frames.frames and all(f.saves or f.loads for f in frames.frames), "each frame is a step that moved blocks"
    assert sum(len(f.loads) for f in frames.frames) == engine.tier.stats.loaded, "every load appears in a frame"
    assert any(f.waiting_for_kvs for f in frames.frames), "a frame shows the requests waiting for their K/V"
    page = frames._repr_html_()
    assert page.count("<b>step") == len(frames.frames) and "loaded (blue)" in page, "one drawing per frame"
    with pytest.raises(ValueError, match="num_cpu_tier_blocks"):
        record_tier_run(LLMEngine(gpt2, **TIGHT), ROUNDS, NEW_TOKENS)


def test_a_failed_step_with_copies_planned_leaves_no_stale_tier_entry(gpt2):
    engine = LLMEngine(gpt2, **TIGHT, num_cpu_tier_blocks=32)
    engine.generate(SHARED, NEW_TOKENS)
    engine.generate(OTHER, NEW_TOKENS)
    real, failed = engine.runner.execute, []

    def failing_once(output):
        if (output.kv_saves or output.kv_loads) and not failed:
            failed.append(output)
            raise RuntimeError("a device error while copying")
        return real(output)

    engine.runner.execute = failing_once
    with pytest.raises(RuntimeError):
        engine.generate(SHARED, NEW_TOKENS)
    assert failed, "the step that failed planned copies"
    assert not engine.scheduler.loading and not engine.tier.pending_saves, "nothing of the failed step is left planned"
    assert engine.kv_cache_manager.get_num_free_blocks() == TIGHT["num_blocks"], "every device block came back"
    again = engine.generate(SHARED + OTHER, NEW_TOKENS)
    assert again == [hf_greedy(gpt2, p, NEW_TOKENS) for p in SHARED + OTHER], "after the fault, the same tokens as HF"
