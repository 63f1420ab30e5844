"""Mooncake's traces: the loader, the block-to-token mapping, and the trace study checked against a replay of its own."""

from __future__ import annotations

import gzip
import json
from collections import OrderedDict
from pathlib import Path

import pytest

from kvcourse.bench.traces import (
    TRACE_BLOCK_SIZE,
    TRACE_DIR,
    TraceRequest,
    block_tokens,
    iter_trace,
    load_trace,
    prompt_tokens,
    to_request,
)
from kvcourse.course.solutions_switch import solutions_enabled

needs_reference = pytest.mark.skipif(
    not solutions_enabled(),
    reason="the maintainers' tests run against the reference: set KVCOURSE_SOLUTIONS=1 (./course test does)",
)
SLICE = 1500  # requests of the conversation trace replayed in the tests (the full trace is the benchmark's)


@pytest.fixture(scope="module")
def conversation() -> list[TraceRequest]:
    return load_trace("conversation")


# ---- the loader ---------------------------------------------------------------------------------


def test_both_traces_ship_with_their_license_and_the_documented_counts(conversation):
    assert (TRACE_DIR / "LICENSE-APACHE").read_text().startswith("\n                                 Apache License")
    synthetic = load_trace("synthetic")
    assert (len(conversation), len(synthetic)) == (12_031, 3_993)
    mean_input = sum(r.input_length for r in conversation) / len(conversation)
    mean_output = sum(r.output_length for r in conversation) / len(conversation)
    assert (round(mean_input), round(mean_output)) == (12_035, 343)
    assert round(sum(r.input_length for r in synthetic) / len(synthetic)) == 15_325


def test_requests_come_in_arrival_order_with_one_id_per_block(conversation):
    first = conversation[0]
    assert first == TraceRequest(0, 6758, 500, tuple(range(14)))
    times = [r.timestamp_ms for r in conversation]
    assert times == sorted(times) and times[-1] > 3_000_000, "one hour of arrivals, in order, in milliseconds"
    assert all(len(r.hash_ids) == -(-r.input_length // TRACE_BLOCK_SIZE) for r in conversation)
    assert [r.input_length for r in iter_trace("conversation", limit=3)] == [6758, 7322, 7236]


def _write(path: Path, lines: list[str]) -> Path:
    with gzip.open(path, "wt") as out:
        out.write("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    "line, words",
    [
        ('{"timestamp": 0, "input_length": 10}', "must be a JSON object with timestamp, input_length"),
        ("not json", "not a trace request"),
        ('{"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [1, 2]}', "needs 3 hash ids"),
    ],
)
def test_a_bad_line_is_refused_with_its_line_number(tmp_path, line, words):
    good = json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]})
    path = _write(tmp_path / "bad.jsonl.gz", [good, line])
    with pytest.raises(ValueError, match="line 2") as error:
        load_trace(path)
    assert words in str(error.value)


def test_a_missing_trace_names_the_shipped_ones(tmp_path):
    with pytest.raises(FileNotFoundError, match="conversation, synthetic"):
        load_trace(tmp_path / "nowhere.jsonl.gz")


# ---- block ids -> tokens ----------------------------------------------------------------------


@needs_reference
def test_equal_ids_share_their_hash_chain_and_different_ids_do_not():
    from kvcourse.kv_cache import hash_request_tokens

    a = TraceRequest(0, 3 * 512, 1, (7, 8, 9))
    b = TraceRequest(0, 3 * 512, 1, (7, 8, 10))
    c = TraceRequest(0, 3 * 512, 1, (6, 8, 9))
    for block_size in (2, 4, 512):
        chain_a, chain_b, chain_c = (hash_request_tokens(block_size, prompt_tokens(r, block_size)) for r in (a, b, c))
        assert chain_a[:2] == chain_b[:2] and chain_a[2] != chain_b[2]
        assert not set(chain_a) & set(chain_c), "a different first block changes every later hash"
    assert block_tokens(3, 4) != block_tokens(4, 4) and block_tokens(3, 4) == block_tokens(3, 4)


def test_a_partial_last_block_stays_partial():
    request = TraceRequest(0, 2 * 512 + 100, 1, (1, 2, 3))
    assert prompt_tokens(request, 2) == [2, 3, 4, 5, 6]  # two full blocks, and one token for the partial one
    assert len(prompt_tokens(request, 8)) == 2 * 8 + 2  # 100 of 512 tokens: about 2 of 8
    assert len(prompt_tokens(TraceRequest(0, 2 * 512 + 511, 1, (1, 2, 3)), 8)) == 2 * 8 + 7  # never a full block
    assert len(prompt_tokens(TraceRequest(0, 1024, 1, (1, 2)), 2)) == 4  # a whole number of blocks
    with pytest.raises(ValueError, match="cannot show a partial block"):
        prompt_tokens(request, 1)
    made = to_request(request, 5, 2)
    assert made.is_complete() and made.max_new_tokens == 1


# ---- the study against a replay of its own ---------------------------------------------------------


def independent_replay(trace: list[TraceRequest], num_blocks: int) -> int:
    """Prefix-hit tokens of an LRU cache of trace block ids, in plain Python (no course code).

    The same definition as the study: each request finds the longest run of its leading full blocks in
    the cache (never the block of its last token), then its full blocks (as many as fit) become the most
    recently used, its head the most recent of all (the manager frees a request tail first).
    """
    cache: OrderedDict[int, None] = OrderedDict()
    hit_tokens = 0
    for request in trace:
        full = list(request.hash_ids[: request.num_full_blocks])
        found = 0
        for hash_id in full[: (request.input_length - 1) // TRACE_BLOCK_SIZE]:
            if hash_id not in cache:
                break
            found += 1
        hit_tokens += found * TRACE_BLOCK_SIZE
        for hash_id in reversed(full[:num_blocks]):
            cache[hash_id] = None
            cache.move_to_end(hash_id)
        while len(cache) > num_blocks:
            cache.popitem(last=False)
    return hit_tokens


@needs_reference
def test_the_replay_through_the_manager_equals_an_independent_one(conversation):
    from kvcourse.bench.trace import distinct_blocks, replay, trace_requests

    trace = conversation[:SLICE]
    requests = trace_requests(trace)
    for num_blocks in (8, 60, 400, 2000, distinct_blocks(trace)):
        assert replay(trace, requests, num_blocks).hit_tokens == independent_replay(trace, num_blocks), num_blocks


@needs_reference
def test_the_stand_in_block_size_changes_no_hit(conversation):
    from kvcourse.bench.trace import replay, trace_requests

    trace = conversation[:60]
    for num_blocks in (30, 3000):
        hits = {size: replay(trace, trace_requests(trace, size), num_blocks, size).hit_tokens for size in (2, 16, 512)}
        assert len(set(hits.values())) == 1, hits


@needs_reference
def test_the_study_on_a_slice(monkeypatch, capsys, conversation):
    from kvcourse.bench import trace as study

    monkeypatch.setattr(study, "load_trace", lambda name: conversation[:600])  # both "traces": the same slice
    assert study.main(["--quick", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    text = "\n".join(lines[:-1])
    assert "the paper's first claim" in text and "second claim" in text and "one full replay" in text
    assert "the reference" in result["manager"] and set(result["traces"]) == {"conversation", "synthetic"}
    found = result["traces"]["conversation"]
    rates = {int(c): r for c, r in found["hit_rate"].items()}
    assert set(rates) == set(study.QUICK_CAPACITIES) and found["requests"] == 600
    assert 0 < found["max_hit_rate"] < 1 and all(rate <= found["max_hit_rate"] for rate in rates.values())
    fits = [rates[c] for c in sorted(rates) if c >= 10**6]  # every request fits: LRU's hit rate cannot fall
    assert fits == sorted(fits)
    assert rates[10**9] == found["max_hit_rate"], "a cache larger than the trace is the infinite one"
    assert found["paper"] == study.paper_statements(rates, found["max_hit_rate"])
    independent = independent_replay(conversation[:600], 3 * 10**6 // 512) / found["prompt_tokens"]
    assert rates[3 * 10**6] == round(independent, study.RATE_DIGITS)
    assert set(result["eviction"]["hit_rate"]) == {"LRU", "FIFO", "LFU"}
    assert result["eviction"]["hit_rate"]["LRU"]["3000000"] == rates[3 * 10**6], "LRU is the curve's own replay"


@needs_reference
def test_the_lru_policy_pool_replays_like_the_block_pool(conversation):
    from kvcourse.bench.trace import replay, trace_requests
    from kvcourse.eviction import FIFOBlockPool, LRUBlockPool

    trace = conversation[:SLICE]
    requests = trace_requests(trace)
    for num_blocks in (60, 2000):
        plain = replay(trace, requests, num_blocks).hit_tokens
        assert replay(trace, requests, num_blocks, pool_class=LRUBlockPool).hit_tokens == plain
    assert replay(trace, requests, 2000, pool_class=FIFOBlockPool).hit_tokens != plain, "FIFO is another policy"


# ---- real arrivals for the serving study ------------------------------------------------------


def test_trace_arrivals_scale_time_and_length(conversation):
    from kvcourse.bench.serving import trace_arrivals

    pairs = trace_arrivals(conversation[:50], time_scale=0.5)
    first_time, first = pairs[0]
    assert first_time == 0 and len(first.prompt_tokens) == 13 * 8 + 2 and first.max_new_tokens == 8  # 6,758 / 64
    assert [t for t, _ in pairs] == [(r.timestamp_ms - conversation[0].timestamp_ms) / 2000 for r in conversation[:50]]
    assert first.prompt_tokens[:8] == pairs[1][1].prompt_tokens[:8], "requests 0 and 1 share block 0"
    assert first.prompt_tokens[8:16] != pairs[1][1].prompt_tokens[8:16]
    long = TraceRequest(0, 200 * 512, 64, tuple(range(200)))
    ((_, cut),) = trace_arrivals([long], max_blocks=112)
    assert len(cut.prompt_tokens) == 112 * 8 and len(cut.prompt_tokens) + cut.max_new_tokens <= 1024
    with pytest.raises(ValueError, match="time_scale"):
        trace_arrivals(conversation[:2], time_scale=0)


@needs_reference
def test_serving_the_trace_with_and_without_prefix_caching():
    from kvcourse.bench.serving import trace_prefix_caching

    study = trace_prefix_caching(num_requests=120, caches={"small": 600, "large": 20_000})
    off, small, large = study["rows"]
    assert [row["prefix_caching"] for row in study["rows"]] == ["off", "on, small", "on, large"]
    assert off["hit_rate"] == 0 and 0 < small["hit_rate"] <= large["hit_rate"]
    assert large["tokens_fed"] < off["tokens_fed"], "prefix hits are tokens the model does not compute"
    assert all(row["outputs_correct"] for row in study["rows"]), "a wrong prefix hit would change the outputs"
    assert all(row["requests"] == 120 for row in study["rows"])


@needs_reference
def test_a_policy_goes_only_into_a_fresh_manager_and_survives_a_reset():
    from kvcourse.core.request import Request
    from kvcourse.eviction import FIFOBlockPool, with_policy
    from kvcourse.kv_cache import KVCacheManager

    manager = with_policy(KVCacheManager(8, 2, enable_prefix_caching=True), FIFOBlockPool)
    request = Request(0, [1, 2, 3, 4, 5], 1)
    manager.allocate_slots(request, 5)
    with pytest.raises(ValueError, match="FRESH manager"):
        with_policy(manager, FIFOBlockPool)
    manager.free(request)
    assert manager.block_pool.get_num_cached_blocks() == 2 and manager.reset_prefix_cache()
    pool = manager.block_pool
    assert pool.cached_at == [0] * 8 and len(pool.free_heap) == 8, "after a reset every free block is ranked afresh"
    assert len(pool.get_new_blocks(8)) == 8 and pool.free_heap == []
