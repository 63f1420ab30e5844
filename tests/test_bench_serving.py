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
    preemption_workload,
    recomputed_tokens,
    simulate,
    simulate_run,
    simulated_preemption_costs,
    summarize,
)
from kvcourse.core.contract import MockKVCacheManager
from kvcourse.core.request import Request
from kvcourse.scheduler import StallFreeScheduler
from kvcourse.toy import toy_generate, toy_requests
from kvcourse.toy.arrivals import SimulatedClock, WallClock, serve


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


def _arrivals() -> list[tuple[float, Request]]:
    reqs = toy_requests([12, 6, 20, 9], max_new_tokens=5, seed=2)
    return list(zip((0.0, 0.0, 0.03, 5.0), reqs))


def test_requests_join_while_the_engine_runs() -> None:
    arrivals = _arrivals()
    scheduler = StallFreeScheduler(32, 4, MockKVCacheManager(num_blocks=32, block_size=4))
    result = serve(scheduler, arrivals, SimulatedClock(StepCost(0.01, 0.001)))
    by_id = {t.request_id: t for t in result.times}
    assert by_id[2].token_times[0] > 0.03 and by_id[3].token_times[0] > 5.0, "nobody is served before arriving"
    first_step = {
        rid: next(s.iteration for s in result.trace.steps if rid in [x[0] for x in s.scheduled]) for rid in by_id
    }
    assert first_step[2] > 1, "the request arriving at 0.03 s cannot be in the first step"
    assert any(len(step.scheduled) > 1 and 2 in [x[0] for x in step.scheduled] for step in result.trace.steps), (
        "a late arrival joins the running batch (continuous batching)"
    )
    for arrival, req in arrivals:
        assert req.arrival_time == arrival and req.output_tokens == toy_generate(req.prompt_tokens, 5)
        assert len(by_id[req.id].token_times) == 5
    again = serve(
        StallFreeScheduler(32, 4, MockKVCacheManager(num_blocks=32, block_size=4)),
        _arrivals(),
        SimulatedClock(StepCost(0.01, 0.001)),
    )
    assert [t.token_times for t in again.times] == [t.token_times for t in result.times], (
        "the simulated clock is deterministic"
    )


def test_wall_clock_serves_in_order() -> None:
    arrivals = [(t / 100, req) for t, (_, req) in enumerate(_arrivals())]  # 0 to 30 ms apart: a short real wait
    scheduler = StallFreeScheduler(32, 4, MockKVCacheManager(num_blocks=32, block_size=4))
    result = serve(scheduler, arrivals, WallClock())
    for t in result.times:
        assert t.token_times[0] >= t.arrival and t.token_times == sorted(t.token_times)


def test_serve_refuses_negative_arrivals() -> None:
    scheduler = StallFreeScheduler(32, 4, MockKVCacheManager(num_blocks=32, block_size=4))
    with pytest.raises(ValueError, match="arrival"):
        serve(scheduler, [(-1.0, Request(0, [1, 2], 2))], SimulatedClock(StepCost(0.01, 0.001)))


@pytest.mark.parametrize(
    ("knobs", "words"),
    [
        ({"policy": "lifo"}, "policy"),
        ({"watermark": 1.5}, "watermark"),
        ({"preemption_mode": "drop"}, "preemption_mode"),
        ({"preemption_mode": "swap"}, "num_cpu_blocks"),
        ({"num_cpu_blocks": -1}, "num_cpu_blocks"),
    ],
)
def test_scheduler_knobs_refuse_bad_values_in_words(knobs: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        StallFreeScheduler(32, 4, MockKVCacheManager(num_blocks=8, block_size=4), **knobs)


def test_swap_keeps_outputs_and_replaces_recompute() -> None:
    work = preemption_workload(24)
    common = {"num_blocks": 13, "max_batch_size": 12}
    recompute, r_sched = simulate_run(work, **common)
    swap, s_sched = simulate_run(
        work, preemption_mode="swap", num_cpu_blocks=1000, swap_costs=simulated_preemption_costs(), **common
    )
    assert r_sched.num_preemptions > 0 and recomputed_tokens(recompute) > 0, "the workload must preempt"
    assert s_sched.num_swapped_out_tokens == s_sched.num_swapped_in_tokens > 0, "every swap-out comes back in"
    assert recomputed_tokens(swap) == 0, "with room in the CPU pool nothing is fed twice"
    assert recompute.trace.outputs() == swap.trace.outputs(), "the preemption mode never changes the outputs"


@pytest.mark.slow  # the whole quick serving study in a fresh process: `./course test -m slow` (CI runs it)
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
    assert {"admission", "priority", "watermark", "swap"} <= set(result)
    for row in result["rate_sweep"]:
        assert row["ttft_p50"] <= row["ttft_p90"] <= row["ttft_p99"]
        assert row["requests"] > 0
    assert result["knee_rate"] is None or result["knee_rate"] in [row["rate"] for row in result["rate_sweep"]]
    assert result["busy_rate"] in [row["rate"] for row in result["rate_sweep"]], (
        "the policy studies run at a swept rate"
    )
    assert set(result["admission"]) == {"fcfs", "skip_ahead"} and set(result["priority"]) == {"fcfs", "priority"}
    for row in result["admission"].values():
        assert row["num_long"] > 0 and row["long_ttft_p50"] <= row["long_ttft_p99"]
    marks = result["watermark"]
    assert [row["watermark"] for row in marks] == sorted(row["watermark"] for row in marks)
    assert all(row["preemptions"] >= 0 and row["recomputed_tokens"] >= 0 for row in marks)
    assert marks[0]["watermark"] == 0.0 and marks[0]["preemptions"] > 0, "the study's load must preempt without one"
    swap = result["swap"]
    assert swap["crossover_tokens"] is None or 1 <= swap["crossover_tokens"] <= 1024
    assert all(row["faster"] in ("swap", "recompute", "same") for row in swap["rows"])


def test_gpt2_engine_serves_arrivals_on_both_clocks() -> None:
    import torch
    from transformers import GPT2LMHeadModel

    from kvcourse.engine.llm_engine import LLMEngine
    from kvcourse.models.gpt2 import tiny_gpt2_config
    from kvcourse.toy.arrivals import serve_engine

    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_gpt2_config()).eval()
    prompts = [[5, 9, 2, 7, 1], [3, 3, 8], [11, 4, 6, 2, 9, 9, 1]]
    expected = LLMEngine(model, num_blocks=32, block_size=4).generate(prompts, max_new_tokens=4)
    arrivals = [(0.0, prompts[0], 4), (0.0, prompts[1], 4), (0.05, prompts[2], 4)]
    for clock in (SimulatedClock(StepCost(0.02, 0.001)), WallClock()):
        engine = LLMEngine(model, num_blocks=32, block_size=4)
        result = serve_engine(engine, arrivals, clock)
        assert [list(r.output_tokens) for r in result.trace.requests.values()] == expected
        assert all(len(t.token_times) == 4 and t.token_times[0] >= t.arrival for t in result.times)
    assert result.times[2].arrival == 0.05


def test_wall_clock_sweep_runs_gpt2_through_the_engine() -> None:
    """The GPU path on a tiny model on the CPU: shape only (wall-clock figures are not asserted)."""
    import torch
    from transformers import GPT2LMHeadModel

    from kvcourse.bench.serving import wall_clock_sweep
    from kvcourse.models.gpt2 import tiny_gpt2_config

    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_gpt2_config()).eval()
    [row] = wall_clock_sweep((200.0,), num_requests=6, model=model, num_blocks=64)
    assert row["rate"] == 200.0 and row["requests"] == 6 and row["ttft_p50"] <= row["ttft_p99"]


@pytest.mark.parametrize("cost", [StepCost(0.03, 0.0016), StepCost(0.02, 0.0005), StepCost(0.05, 0.003)])
def test_served_swap_runs_agree_with_the_cost_model_at_the_victims_context(cost: StepCost) -> None:
    from kvcourse.bench.serving import swap_study

    study = swap_study(step_cost=cost)
    rows = [row for row in study["rows"] if row["agrees"] is not None]
    assert len(rows) >= 4, "the study must preempt at most of its prompt lengths"
    assert {row["faster"] for row in rows} <= {"swap", "recompute"}
    assert all(row["agrees"] for row in rows), [(r["prompt_len"], r["faster"], r["model_says"]) for r in rows]
