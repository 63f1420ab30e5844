"""Serving study: requests arrive over time; what do time to first token and time per output token do?

vLLM's serving benchmark reports, per request, TTFT (arrival to first token), TPOT (time per output
token after the first), ITL (the gaps between tokens) and end-to-end latency, and per run their
percentiles, throughput and goodput (requests per second that met a latency SLO). This study
measures the same on the course's scheduler under Poisson arrivals, with a clock that is:

* simulated on a CPU: each step costs `fixed + per_token * tokens fed` seconds, a cost model fitted
  to measured GPT-2 step times (`fit_step_cost`), so runs and notebook outputs are deterministic;
* the wall clock on a GPU (`clock="wall"`), where step times are what they are.

    python -m kvcourse.bench serving [--quick] [--json]
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvcourse.bench.common import device_name, emit, not_written, parse_args, run_reference, whose_code
from kvcourse.kv_cache_interface import MockKVCacheManager
from kvcourse.request import Request
from kvcourse.scheduler import StallFreeScheduler
from kvcourse.toy import ToyExecutor

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class StepCost:
    """Seconds one engine step takes: a fixed part (launches, Python) plus a part per token fed."""

    fixed_s: float
    per_token_s: float

    def __call__(self, num_tokens: int) -> float:
        return self.fixed_s + self.per_token_s * num_tokens


# PROVISIONAL (not yet measured): replaced by a fit of `measure_step_costs` on GPT-2 small.
GPT2_CPU_STEP_COST = StepCost(fixed_s=0.030, per_token_s=0.0016)


@dataclass
class RequestTimes:
    """When one request arrived, got each token, and finished (seconds on the study's clock)."""

    request_id: int
    arrival: float
    prompt_len: int
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        """Time to first token: queueing plus the whole prefill."""
        return self.token_times[0] - self.arrival

    @property
    def tpot(self) -> float:
        """Time per output token after the first (0 for a one-token request)."""
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else 0.0

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies: the gaps a streaming client sees."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def e2e(self) -> float:
        """End-to-end latency: arrival to last token."""
        return self.token_times[-1] - self.arrival


def poisson_arrivals(num_requests: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times of a Poisson process with `rate` requests per second (exponential gaps)."""
    if rate <= 0:
        raise ValueError(f"rate is {rate!r} requests/s; it must be positive.")
    rng = random.Random(seed)
    now, times = 0.0, []
    for _ in range(num_requests):
        now += rng.expovariate(rate)
        times.append(now)
    return times


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (linear interpolation, like numpy's default)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarize(times: Sequence[RequestTimes], slo_ttft_s: float, slo_tpot_s: float) -> dict:
    """Percentiles of TTFT, TPOT, ITL and E2E; throughput; goodput (requests/s meeting both SLOs)."""
    done = [t for t in times if t.token_times]
    start = min(t.arrival for t in done)
    span = max(t.token_times[-1] for t in done) - start
    metrics = {
        "ttft": [t.ttft for t in done],
        "tpot": [t.tpot for t in done if len(t.token_times) > 1],
        "itl": [gap for t in done for gap in t.itl],
        "e2e": [t.e2e for t in done],
    }
    good = sum(t.ttft <= slo_ttft_s and t.tpot <= slo_tpot_s for t in done)
    return {
        **{f"{name}_p{p}": percentile(values, p) for name, values in metrics.items() for p in PERCENTILES},
        "ttft_mean": statistics.fmean(metrics["ttft"]),
        "requests": len(done),
        "duration_s": span,
        "output_tokens_per_s": sum(len(t.token_times) for t in done) / span,
        "request_throughput": len(done) / span,
        "goodput": good / span,
        "slo": {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s},
    }


@dataclass(frozen=True)
class Workload:
    """Prompt lengths and output lengths of a long-tailed request mix, with Poisson arrival times."""

    prompt_lens: tuple[int, ...]
    output_lens: tuple[int, ...]
    arrivals: tuple[float, ...]


def make_workload(num_requests: int, rate: float, seed: int = 0, long_every: int = 8) -> Workload:
    """Mostly short prompts, one long prompt in every `long_every`: the tail that FCFS must not starve."""
    rng = random.Random(seed)
    prompt_lens = tuple(
        rng.randint(160, 240) if i % long_every == long_every - 1 else rng.randint(8, 48) for i in range(num_requests)
    )
    output_lens = tuple(rng.randint(8, 32) for _ in range(num_requests))
    return Workload(prompt_lens, output_lens, tuple(poisson_arrivals(num_requests, rate, seed)))


def simulate(
    workload: Workload,
    *,
    token_budget: int = 256,
    max_batch_size: int = 16,
    num_blocks: int = 128,
    block_size: int = 16,
    step_cost: Callable[[int], float] = GPT2_CPU_STEP_COST,
    make_scheduler: Callable[..., object] = StallFreeScheduler,
    seed: int = 0,
) -> list[RequestTimes]:
    """Serve the workload on a simulated clock: arrivals join between steps; each step costs step_cost."""
    rng = random.Random(seed)
    manager = MockKVCacheManager(num_blocks, block_size)
    scheduler = make_scheduler(token_budget, max_batch_size, manager)
    executor = ToyExecutor(block_size=None)
    requests = [
        Request(id=i, prompt_tokens=[rng.randrange(1000) for _ in range(n)], max_new_tokens=m)
        for i, (n, m) in enumerate(zip(workload.prompt_lens, workload.output_lens))
    ]
    times = {r.id: RequestTimes(r.id, a, len(r.prompt_tokens)) for r, a in zip(requests, workload.arrivals)}
    pending, now = list(zip(workload.arrivals, requests)), 0.0
    while pending or scheduler.has_unfinished_requests():
        while pending and pending[0][0] <= now:
            scheduler.add_request(pending.pop(0)[1])
        if not scheduler.has_unfinished_requests():
            now = pending[0][0]  # idle: jump to the next arrival
            continue
        batch = scheduler.schedule_next_batch()
        if not batch:
            raise RuntimeError(f"the scheduler planned an empty step at t={now:.3f}s with work left: {scheduler!r}")
        sampled = executor.execute(batch)  # the toy model keeps its own cache: only the clock matters here
        now += step_cost(sum(len(s.tokens) for s in batch))
        scheduler.update_from_output(batch, sampled)
        for request_id in sampled:
            times[request_id].token_times.append(now)
    return list(times.values())


def fit_step_cost(samples: Sequence[tuple[int, float]]) -> StepCost:
    """Least-squares line through (tokens fed, seconds) pairs of measured engine steps."""
    if len({n for n, _ in samples}) < 2:
        raise ValueError("fit_step_cost needs steps of at least two different sizes.")
    mean_n = statistics.fmean(n for n, _ in samples)
    mean_s = statistics.fmean(s for _, s in samples)
    slope = sum((n - mean_n) * (s - mean_s) for n, s in samples) / sum((n - mean_n) ** 2 for n, _ in samples)
    return StepCost(fixed_s=max(0.0, mean_s - slope * mean_n), per_token_s=max(0.0, slope))


def measure_step_costs(model, prompt_lens: Sequence[int] = (8, 32, 64, 128, 256), new_tokens: int = 4) -> list:
    """(tokens fed, seconds) of real engine steps: one prompt at a time, its prefill then a few decodes."""
    import time

    from kvcourse.engine import LLMEngine

    samples = []
    for n in prompt_lens:
        engine = LLMEngine(model, num_blocks=64, block_size=16, token_budget=max(prompt_lens))
        engine.add_request(list(range(1, n + 1)), new_tokens)
        while engine.scheduler.has_unfinished_requests():
            fed_before, start = engine.stats.scheduled_tokens, time.perf_counter()
            engine.step()
            samples.append((engine.stats.scheduled_tokens - fed_before, time.perf_counter() - start))
    return samples


def rate_sweep(rates: Sequence[float], num_requests: int, **sim) -> list[dict]:
    """Throughput and latency percentiles at each request rate: where is the knee?"""
    return [{"rate": r, **summarize(simulate(make_workload(num_requests, r), **sim), **SLO)} for r in rates]


def budget_sweep(budgets: Sequence[int], rate: float, num_requests: int, **sim) -> list[dict]:
    """The chunked-prefill trade-off: a bigger token budget shortens TTFT but stalls running decodes."""
    work = make_workload(num_requests, rate)
    return [{"token_budget": b, **summarize(simulate(work, token_budget=b, **sim), **SLO)} for b in budgets]


SLO = {"slo_ttft_s": 2.0, "slo_tpot_s": 0.15}


def knee(sweep: list[dict], slo_key: str = "ttft_p99") -> float | None:
    """The highest rate whose p99 TTFT still meets the SLO: past it, queues grow without bound."""
    ok = [row["rate"] for row in sweep if row[slo_key] <= SLO["slo_ttft_s"]]
    return max(ok) if ok else None


def run(quick: bool = True, *, reference: bool = False) -> dict:
    """The serving study: a request-rate sweep and a token-budget sweep (your scheduler, or the reference's)."""
    from datetime import UTC, datetime

    if reference:
        return run_reference("serving", {"quick": quick})

    n = 64 if quick else 256
    rates = (1, 2, 4, 6, 8, 12) if quick else (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
    sweep = rate_sweep(rates, n)
    return {
        "study": "serving",
        "quick": quick,
        "device": device_name(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "clock": "simulated",
        "code": whose_code("scheduler"),
        "step_cost": {"fixed_s": GPT2_CPU_STEP_COST.fixed_s, "per_token_s": GPT2_CPU_STEP_COST.per_token_s},
        "rate_sweep": sweep,
        "knee_rate": knee(sweep),
        "budget_sweep": budget_sweep((32, 64, 128, 256, 512), rate=4, num_requests=n),
    }


def print_table(result: dict) -> None:
    """Rate sweep and budget sweep as two small tables."""
    print(
        f"serving study on a simulated clock (step = {result['step_cost']['fixed_s'] * 1e3:.0f} ms + "
        f"{result['step_cost']['per_token_s'] * 1e3:.2f} ms/token)"
    )
    print(" rate  tok/s  goodput  TTFT p50   p99   TPOT p50   p99")
    for row in result["rate_sweep"]:
        print(
            f"{row['rate']:>5} {row['output_tokens_per_s']:>6.1f} {row['goodput']:>8.2f} "
            f"{row['ttft_p50']:>9.2f} {row['ttft_p99']:>5.2f} {row['tpot_p50']:>10.3f} {row['tpot_p99']:>5.3f}"
        )
    print(f"knee (highest rate with p99 TTFT <= {SLO['slo_ttft_s']} s): {result['knee_rate']} requests/s")
    print("budget  TTFT p50   p99   TPOT p50   p99   ITL p99")
    for row in result["budget_sweep"]:
        print(
            f"{row['token_budget']:>6} {row['ttft_p50']:>9.2f} {row['ttft_p99']:>5.2f} "
            f"{row['tpot_p50']:>10.3f} {row['tpot_p99']:>5.3f} {row['itl_p99']:>9.3f}"
        )


def main(argv: list[str] | None = None) -> int:
    """`python -m kvcourse.bench serving [--quick] [--json]`."""
    args = parse_args("serving", "TTFT, TPOT and goodput under Poisson arrivals", argv)
    try:
        result = run(quick=args.quick, reference=args.reference)
    except NotImplementedError as error:
        return not_written(error, "serving")
    if not args.json:
        print_table(result)
    emit(result, args.json)
    return 0
