"""Lesson 10's figures, guarded: the two-tier Mooncake replay (issue 40's sanity checks) and the stored study."""

from __future__ import annotations

import pytest

from kvcourse.course.solutions_switch import solutions_enabled

if not solutions_enabled():
    pytest.skip("the replay runs the reference cache and tier: set KVCOURSE_SOLUTIONS=1", allow_module_level=True)

from kvcourse.bench import offload
from kvcourse.bench.trace import capacity_blocks, replay, trace_requests
from kvcourse.bench.traces import load_trace


@pytest.fixture(scope="module")
def chat():
    trace = load_trace("conversation")
    return trace, trace_requests(trace)


def test_device_only_hit_rate_is_4_7s(chat):
    trace, requests = chat
    rate = replay(trace, requests, capacity_blocks(10**7)).hit_rate
    assert round(rate, 4) == 0.2976, f"the device cache alone at 1e7 tokens must give 4.7's 0.2976, got {rate:.4f}"


def test_two_tiers_behave_like_one_cache_of_their_combined_size(chat):
    trace, requests = chat
    two = replay(trace, requests, capacity_blocks(10**7), tier_blocks=capacity_blocks(5 * 10**7))
    one = replay(trace, requests, capacity_blocks(6 * 10**7))
    assert two.tier_hit_tokens > 0, "the tier should serve some prompt tokens"
    assert abs(two.hit_rate - one.hit_rate) <= 0.01, (
        f"1e7 + 5e7 tokens in two tiers ({two.hit_rate:.4f}) should be within 0.01 of one 6e7 cache ({one.hit_rate:.4f})"
    )


def test_the_stored_study_agrees_with_a_fresh_replay(chat):
    stored = offload.stored()
    trace, requests = chat
    row = next(r for r in stored["rows"] if r["device_tokens"] == 10**6 and r["tier_tokens"] == 10**7)
    fresh = replay(trace, requests, capacity_blocks(10**6), tier_blocks=capacity_blocks(10**7))
    assert row["hit_rate"] == pytest.approx(fresh.hit_rate, abs=1e-9), "notebooks/data/two_tier_mooncake.json is stale"
    for device in offload.DEVICE_CAPACITIES:
        rates = [r["hit_rate"] for r in stored["rows"] if r["device_tokens"] == device]
        assert rates == sorted(rates), f"a larger tier must never lower the hit rate (device {device:,} tokens)"


def test_load_or_recompute_compares_like_with_like():
    cost = offload.CopyCost(
        "cpu", bytes_per_block=1000, save_bytes_per_s=1e6, load_bytes_per_s=1e6, seconds_per_copy_call=0.01
    )
    rows = offload.load_or_recompute(cost, tokens_per_s=1000.0, block_size=10, lengths=(5, 100))
    assert rows[0]["load_s"] == pytest.approx(0.01 + 0.001) and rows[0]["recompute_s"] == pytest.approx(0.005)
    assert not rows[0]["load_wins"] and rows[1]["load_wins"], "short prompts recompute, long ones load"
