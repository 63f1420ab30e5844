"""The serving study: latency metrics are computed right, and the quick study's JSON has its shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvcourse.bench.serving import (
    RequestTimes,
    StepCost,
    fit_step_cost,
    make_workload,
    percentile,
    poisson_arrivals,
    simulate,
    summarize,
)


def test_request_metrics_follow_vllm_definitions() -> None:
    t = RequestTimes(0, arrival=1.0, prompt_len=4, token_times=[1.5, 1.7, 2.0, 2.1])
    assert t.ttft == pytest.approx(0.5), "TTFT runs from arrival to the first token"
    assert t.tpot == pytest.approx((2.1 - 1.5) / 3), "TPOT averages the gaps after the first token"
    assert t.itl == pytest.approx([0.2, 0.3, 0.1]), "ITL lists every gap between tokens"
    assert t.e2e == pytest.approx(1.1)


def test_percentile_interpolates_like_numpy() -> None:
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(4.6)
    assert percentile([7.0], 99) == 7.0


def test_poisson_arrivals_are_seeded_increasing_and_at_the_rate() -> None:
    times = poisson_arrivals(4000, rate=8.0, seed=3)
    assert times == poisson_arrivals(4000, rate=8.0, seed=3)
    assert all(b > a for a, b in zip(times, times[1:]))
    assert len(times) / times[-1] == pytest.approx(8.0, rel=0.1)
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(3, rate=0)


def test_fit_recovers_a_line() -> None:
    cost = StepCost(0.02, 0.001)
    fitted = fit_step_cost([(n, cost(n)) for n in (1, 16, 64, 256)])
    assert fitted.fixed_s == pytest.approx(0.02) and fitted.per_token_s == pytest.approx(0.001)
    with pytest.raises(ValueError):
        fit_step_cost([(4, 0.1), (4, 0.2)])


def test_simulation_serves_every_request_and_load_raises_latency() -> None:
    light = summarize(simulate(make_workload(48, rate=1.0)), slo_ttft_s=2.0, slo_tpot_s=0.15)
    heavy = summarize(simulate(make_workload(48, rate=50.0)), slo_ttft_s=2.0, slo_tpot_s=0.15)
    assert light["requests"] == heavy["requests"] == 48
    assert heavy["ttft_p99"] > light["ttft_p99"], "a request rate far past capacity must queue requests"
    assert heavy["output_tokens_per_s"] > light["output_tokens_per_s"], "more load, more batching"
    assert light["goodput"] <= light["request_throughput"]


def test_bigger_token_budget_trades_inter_token_latency_for_ttft() -> None:
    work = make_workload(48, rate=4.0)
    small = summarize(simulate(work, token_budget=32), slo_ttft_s=2.0, slo_tpot_s=0.15)
    large = summarize(simulate(work, token_budget=512), slo_ttft_s=2.0, slo_tpot_s=0.15)
    assert large["itl_p99"] > small["itl_p99"], "a long prefill chunk stalls the running decodes"
    assert large["ttft_p50"] <= small["ttft_p50"], "a small budget chops prefills and delays first tokens"


def test_quick_study_json_has_its_figures() -> None:
    env = {**os.environ, "KVCOURSE_SOLUTIONS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "kvcourse.bench", "serving", "--quick", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["study"] == "serving" and result["clock"] == "simulated"
    assert {"device", "date", "rate_sweep", "budget_sweep", "knee_rate"} <= set(result)
    for row in result["rate_sweep"]:
        assert row["ttft_p50"] <= row["ttft_p90"] <= row["ttft_p99"]
        assert row["requests"] > 0
