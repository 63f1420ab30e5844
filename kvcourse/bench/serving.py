"""Serving study: requests arrive over time; what do time to first token and time per output token do?

vLLM's serving benchmark reports, per request, TTFT (arrival to first token), TPOT (time per output
token after the first), ITL (the gaps between tokens) and end-to-end latency, and per run their
percentiles, throughput and goodput (requests per second that met a latency SLO). This study
measures the same on the course's scheduler under Poisson arrivals, through the engine's own loop
(`kvcourse.toy.arrivals.serve`, i.e. `EngineCore` with arrivals between steps), on a clock that is:

* simulated on a CPU: each step costs `fixed + per_token * tokens fed` seconds, a cost model fitted
  to measured GPT-2 step times (`fit_step_cost`), so runs and notebook outputs are deterministic;
* the wall clock on a GPU (`kvcourse.toy.arrivals.WallClock`), where step times are what they are.

Four parts: a request-rate sweep (the latency-throughput knee), a token-budget sweep (the
chunked-prefill trade-off), FCFS against skip-ahead admission on a long-tailed workload (the p99 TTFT
of the long prompts), and the policy knobs: a watermark (preemptions and recomputed tokens) and swap
against recompute (the crossover prompt length). A fifth replays real arrivals: the first minutes of
Mooncake's conversation trace, scaled to the toy world, served with prefix caching off and on.

    python -m kvcourse.bench serving [--quick] [--json]
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvcourse.bench.common import device_name, emit, not_written, parse_args, run_reference, whose_code
from kvcourse.bench.traces import TRACE_BLOCK_SIZE, TraceRequest, load_trace, prompt_tokens, truncated
from kvcourse.core.contract import MockKVCacheManager
from kvcourse.core.request import Request
from kvcourse.core.sched_output import SchedulerOutput
from kvcourse.scheduler import PreemptionCosts, StallFreeScheduler, recompute_seconds, swap_crossover, swap_seconds
from kvcourse.toy.arrivals import RequestTimes, ServingRun, SimulatedClock, StepCost, serve
from kvcourse.toy.executor import ToyExecutor
from kvcourse.toy.model import TOY_VOCAB_SIZE, toy_generate

PERCENTILES = (50, 90, 99)
LONG_PROMPT = 160  # prompts at least this long are "long" in the long-tailed workload

# Fitted with `fit_step_cost(measure_step_costs(load_gpt2("gpt2")))`: GPT-2 small (124M, fp32, the fast
# attention backend) on this project's 2-core CPU machine, 2026-12-01, steps of 1 to 256 tokens:
# 39.3 ms + 1.39 ms per token. Refit on your own machine the same way.
GPT2_CPU_STEP_COST = StepCost(fixed_s=0.039, per_token_s=0.0014)

GPT2_PARAMETERS = 124_439_808  # GPT-2 small (tied embeddings), for its FLOPs per token: 2 x parameters
GPT2_FP32_KV_BYTES_PER_TOKEN = 2 * 12 * 768 * 4  # K and V, 12 layers, 768 wide, fp32 (the CPU engine's dtype)
# ASSUMED, not measured: the link a swap moves K/V over on the simulated machine. The bandwidth is a
# PCIe 4.0 x16 link's usable rate; the fixed cost per transfer (pinning host memory, one copy per
# block and layer, a stream synchronisation) is a pessimistic guess that puts the crossover inside
# GPT-2's prompt lengths, so that both sides of it can be seen.
SWAP_LINK = {"link_bytes_per_s": 25e9, "link_latency_s": 0.02}


def simulated_preemption_costs(step_cost: StepCost = GPT2_CPU_STEP_COST) -> PreemptionCosts:
    """The simulated machine's costs: recompute at the step-cost model's per-token rate, swap over SWAP_LINK."""
    return PreemptionCosts(
        kv_bytes_per_token=GPT2_FP32_KV_BYTES_PER_TOKEN,
        flops_per_token=2 * GPT2_PARAMETERS,
        flops_per_s=2 * GPT2_PARAMETERS / step_cost.per_token_s,  # so one token costs per_token_s
        **SWAP_LINK,
    )


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
    if not done:
        raise ValueError("no request produced a token: there is nothing to summarize.")
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
    """Prompt lengths and output lengths of a request mix, with arrival times (and optional priorities)."""

    prompt_lens: tuple[int, ...]
    output_lens: tuple[int, ...]
    arrivals: tuple[float, ...]
    priorities: tuple[int, ...] = ()


def make_workload(num_requests: int, rate: float, seed: int = 0, long_every: int = 8) -> Workload:
    """Mostly short prompts, one long prompt in every `long_every`: the tail that FCFS must not starve."""
    rng = random.Random(seed)
    prompt_lens = tuple(
        rng.randint(LONG_PROMPT, 240) if i % long_every == long_every - 1 else rng.randint(8, 48)
        for i in range(num_requests)
    )
    output_lens = tuple(rng.randint(8, 32) for _ in range(num_requests))
    return Workload(prompt_lens, output_lens, tuple(poisson_arrivals(num_requests, rate, seed)))


class SkipAheadScheduler(StallFreeScheduler):
    """Notebook 02's pitfall, kept for comparison: admission skips a head that does not fit and admits those behind it."""

    def _admit(self, request: Request, token_budget_left: int, output: SchedulerOutput) -> bool:
        """Asked to admit the head, admit the first waiting request that fits: one that does not is passed over."""
        for candidate in list(self.waiting_queue):  # noqa: SIM110 (super() needs a loop, not a generator)
            if super()._admit(candidate, token_budget_left, output):
                return True
        return False


def requests_for(workload: Workload, seed: int = 0) -> list[tuple[float, Request]]:
    """The workload as (arrival time, Request) pairs, with seeded random prompt tokens."""
    rng = random.Random(seed)
    priorities = workload.priorities or (0,) * len(workload.prompt_lens)
    return [
        (a, Request(id=i, prompt_tokens=[rng.randrange(1000) for _ in range(n)], max_new_tokens=m, priority=p))
        for i, (n, m, a, p) in enumerate(zip(workload.prompt_lens, workload.output_lens, workload.arrivals, priorities))
    ]


def simulate_run(
    workload: Workload,
    *,
    token_budget: int = 256,
    max_batch_size: int = 16,
    num_blocks: int = 128,
    block_size: int = 16,
    step_cost: Callable[[int], float] = GPT2_CPU_STEP_COST,
    make_scheduler: Callable[..., StallFreeScheduler] = StallFreeScheduler,
    swap_costs: PreemptionCosts | None = None,
    seed: int = 0,
    **knobs,
) -> tuple[ServingRun, StallFreeScheduler]:
    """Serve the workload through the engine loop on a simulated clock; knobs go to the scheduler (policy, watermark, ...)."""
    scheduler = make_scheduler(token_budget, max_batch_size, MockKVCacheManager(num_blocks, block_size), **knobs)
    result = serve(scheduler, requests_for(workload, seed), SimulatedClock(step_cost, _transfer_cost(swap_costs)))
    return result, scheduler


def _transfer_cost(costs: PreemptionCosts | None) -> Callable[[int, int], float] | None:
    """A step's swap transfers priced like swap_seconds: a latency each, plus the bytes over the bandwidth."""
    if costs is None:
        return None
    return lambda transfers, tokens: (
        transfers * costs.link_latency_s + tokens * costs.kv_bytes_per_token / costs.link_bytes_per_s
    )


def simulate(workload: Workload, **options) -> list[RequestTimes]:
    """Every request's times when the workload is served on the simulated clock (see simulate_run)."""
    return simulate_run(workload, **options)[0].times


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

    from kvcourse.engine.llm_engine import LLMEngine

    samples = []
    for n in prompt_lens:
        engine = LLMEngine(model, num_blocks=64, block_size=16, token_budget=max(prompt_lens))
        engine.add_request(list(range(1, n + 1)), new_tokens)
        while engine.scheduler.has_unfinished_requests():
            fed_before, start = engine.stats.scheduled_tokens, time.perf_counter()
            engine.step()
            samples.append((engine.stats.scheduled_tokens - fed_before, time.perf_counter() - start))
    return samples


SLO = {"slo_ttft_s": 2.0, "slo_tpot_s": 0.15}


def rate_sweep(rates: Sequence[float], num_requests: int, **sim) -> list[dict]:
    """Throughput and latency percentiles at each request rate: where is the knee?"""
    return [{"rate": r, **summarize(simulate(make_workload(num_requests, r), **sim), **SLO)} for r in rates]


def budget_sweep(budgets: Sequence[int], rate: float, num_requests: int, **sim) -> list[dict]:
    """The chunked-prefill trade-off: a bigger token budget shortens TTFT but stalls running decodes."""
    work = make_workload(num_requests, rate)
    return [{"token_budget": b, **summarize(simulate(work, token_budget=b, **sim), **SLO)} for b in budgets]


def knee(sweep: list[dict], slo_key: str = "ttft_p99") -> float | None:
    """The highest rate whose p99 TTFT still meets the SLO: past it, queues grow without bound."""
    ok = [row["rate"] for row in sweep if row[slo_key] <= SLO["slo_ttft_s"]]
    return max(ok) if ok else None


def busy_rate(sweep: list[dict]) -> float:
    """The rate the policy studies run at: the knee (busy, not yet swamped), or the lowest rate if none meets the SLO."""
    return knee(sweep) or min(row["rate"] for row in sweep)


def recomputed_tokens(run: ServingRun) -> int:
    """Tokens fed more than once: everything fed, minus each request's prompt and outputs fed once."""
    fed = sum(step.num_tokens for step in run.trace.steps)
    once = sum(r.num_prompt_tokens + max(len(r.output_tokens) - 1, 0) for r in run.trace.requests.values())
    return fed - once


def tail_by_length(times: Sequence[RequestTimes]) -> dict:
    """p50 and p99 TTFT of the long prompts and of the short ones, separately."""
    long = [t.ttft for t in times if t.token_times and t.prompt_len >= LONG_PROMPT]
    short = [t.ttft for t in times if t.token_times and t.prompt_len < LONG_PROMPT]
    return {
        "long_ttft_p50": percentile(long, 50),
        "long_ttft_p99": percentile(long, 99),
        "short_ttft_p50": percentile(short, 50),
        "short_ttft_p99": percentile(short, 99),
        "num_long": len(long),
    }


def admission_tails(rate: float, num_requests: int, num_blocks: int = 40, **sim) -> dict:
    """FCFS against skip-ahead on the long-tailed workload, in a cache small enough that a long prompt must wait."""
    work = make_workload(num_requests, rate)
    rows = {}
    for name, scheduler in (("fcfs", StallFreeScheduler), ("skip_ahead", SkipAheadScheduler)):
        run, _ = simulate_run(work, num_blocks=num_blocks, make_scheduler=scheduler, **sim)
        rows[name] = {**tail_by_length(run.times), **summarize(run.times, **SLO)}
    return rows


def with_priorities(workload: Workload, urgent_every: int = 4) -> Workload:
    """The same requests, one in every `urgent_every` marked urgent (priority 0; the rest priority 1)."""
    priorities = tuple(0 if i % urgent_every == 0 else 1 for i in range(len(workload.prompt_lens)))
    return Workload(workload.prompt_lens, workload.output_lens, workload.arrivals, priorities)


def priority_study(rate: float, num_requests: int, num_blocks: int = 40, **sim) -> dict:
    """FCFS against policy="priority" when one request in four is urgent: whose TTFT tail moves?"""
    work = with_priorities(make_workload(num_requests, rate))
    rows = {}
    for policy in ("fcfs", "priority"):
        run, scheduler = simulate_run(work, num_blocks=num_blocks, policy=policy, **sim)
        urgent = [t.ttft for t in run.times if t.token_times and t.priority == 0]
        rest = [t.ttft for t in run.times if t.token_times and t.priority != 0]
        rows[policy] = {
            "urgent_ttft_p50": percentile(urgent, 50),
            "urgent_ttft_p99": percentile(urgent, 99),
            "other_ttft_p50": percentile(rest, 50),
            "other_ttft_p99": percentile(rest, 99),
            "preemptions": scheduler.num_preemptions,
            **summarize(run.times, **SLO),
        }
    return rows


def watermark_study(watermarks: Sequence[float], rate: float, num_requests: int, num_blocks: int = 40, **sim) -> list:
    """Preemptions and recomputed tokens as the watermark keeps more blocks free for running decodes."""
    work = make_workload(num_requests, rate)
    rows = []
    for watermark in watermarks:
        run, scheduler = simulate_run(work, num_blocks=num_blocks, watermark=watermark, **sim)
        rows.append(
            {
                "watermark": watermark,
                "preemptions": scheduler.num_preemptions,
                "recomputed_tokens": recomputed_tokens(run),
                **summarize(run.times, **SLO),
            }
        )
    return rows


def preemption_workload(prompt_len: int, num_requests: int = 12, output_len: int = 32) -> Workload:
    """Equal prompts arriving together into a cache too small for all of them to decode: preemptions guaranteed."""
    return Workload((prompt_len,) * num_requests, (output_len,) * num_requests, (0.0,) * num_requests)


def _cheaper(num_tokens: int, costs: PreemptionCosts) -> str:
    """The cost model's choice for one victim of num_tokens cached tokens."""
    return "swap" if swap_seconds(num_tokens, costs) < recompute_seconds(num_tokens, costs) else "recompute"


def _faster(recompute_s: float, swap_s: float) -> str:
    """Which preemption mode finished the run first ("same" when no preemption happened)."""
    if math.isclose(recompute_s, swap_s):
        return "same"
    return "swap" if swap_s < recompute_s else "recompute"


AROUND_CROSSOVER = (0.25, 0.5, 0.75, 1.25, 1.5, 2.0, 3.0)  # the swap study's prompt lengths, as multiples


def swap_study(
    prompt_lens: Sequence[int] | None = None, step_cost: StepCost = GPT2_CPU_STEP_COST, block_size: int = 16
) -> dict:
    """Swap against recompute: the cost model's crossover, and served runs on both sides of it.

    prompt_lens defaults to multiples of the crossover (AROUND_CROSSOVER), so the study straddles it
    whatever the step-cost model says; without a crossover up to 1,024 tokens, to 16-256 tokens.
    """
    costs = simulated_preemption_costs(step_cost)
    crossover = swap_crossover(costs, max_tokens=1024)
    if prompt_lens is None:
        around = [max(1, round(f * crossover)) for f in AROUND_CROSSOVER] if crossover else [16, 32, 64, 128, 256]
        prompt_lens = sorted(set(around))
    rows = []
    for n in prompt_lens:
        work = preemption_workload(n)
        num_blocks = 3 * math.ceil((n + work.output_lens[0]) / block_size) + 1  # three requests at their longest
        common = {"num_blocks": num_blocks, "block_size": block_size, "step_cost": step_cost, "max_batch_size": 12}
        recompute, r_sched = simulate_run(work, **common)
        swap, s_sched = simulate_run(work, preemption_mode="swap", num_cpu_blocks=10**6, swap_costs=costs, **common)
        context = 2 * s_sched.num_swapped_out_tokens / s_sched.num_swaps if s_sched.num_swaps else None
        predicted = None if context is None else _cheaper(round(context), costs)
        faster = _faster(recompute.duration_s, swap.duration_s)
        rows.append(
            {
                "prompt_len": n,
                "mean_victim_context": context,  # tokens a victim had cached when it was swapped out
                "model_says": predicted,  # the cost model's choice at that context
                "agrees": None if predicted is None else predicted == faster,
                "swap_s": swap_seconds(n, costs),
                "recompute_s": recompute_seconds(n, costs),
                "recompute_run_s": recompute.duration_s,
                "swap_run_s": swap.duration_s,
                "preemptions_recompute": r_sched.num_preemptions,
                "preemptions_swap": s_sched.num_preemptions,
                "recomputed_tokens": recomputed_tokens(recompute),
                "swapped_tokens": s_sched.num_swapped_out_tokens,
                "faster": faster,
            }
        )
    return {
        "link": SWAP_LINK,
        "kv_bytes_per_token": costs.kv_bytes_per_token,
        "crossover_tokens": crossover,
        "rows": rows,
    }


def print_swap_rows(rows: list[dict]) -> None:
    """The swap study, one row per prompt length: the served runs and what the cost model predicts."""
    print("prompt  victim context  run: recompute s  swap s  preemptions  faster     model says")
    for row in rows:
        context = "-" if row["mean_victim_context"] is None else f"{row['mean_victim_context']:.0f}"
        print(
            f"{row['prompt_len']:>6} {context:>15} {row['recompute_run_s']:>17.2f} {row['swap_run_s']:>7.2f} "
            f"{row['preemptions_recompute']:>12}  {row['faster']:<9}  {row['model_says'] or '-'}"
        )


def wall_clock_sweep(rates: Sequence[float], num_requests: int, model, num_blocks: int = 2048) -> list[dict]:
    """GPT-2 itself under Poisson arrivals on the wall clock (a GPU run): the same metrics, measured."""
    from kvcourse.engine.llm_engine import LLMEngine
    from kvcourse.toy.arrivals import WallClock, serve_engine

    rows = []
    for rate in rates:
        work = make_workload(num_requests, rate)
        rng = random.Random(0)
        arrivals = [
            (a, [rng.randrange(50_000) for _ in range(n)], m)
            for a, n, m in zip(work.arrivals, work.prompt_lens, work.output_lens)
        ]
        engine = LLMEngine(model, num_blocks=num_blocks, block_size=16, token_budget=256, max_batch_size=16)
        result = serve_engine(engine, arrivals, WallClock())
        rows.append({"rate": rate, **summarize(result.times, **SLO)})
    return rows


# ---- Real arrivals: Mooncake's conversation trace, scaled to the toy world (notebook 07, section 11) ----
TRACE_TOKENS_PER_BLOCK = 8  # a 512-token trace block becomes 8 toy tokens: every length is divided by 64
TRACE_MAX_BLOCKS = 112  # prompts cut to 112 blocks (896 tokens): prompt and output fit GPT-2's 1,024 positions
# Caches in blocks of 8 toy tokens, i.e. 512 real tokens each: 3,800 blocks are 1.95 M real tokens, the KV
# cache of GPT-2 small on an 80 GB GPU (notebook 04); 100,000 blocks are 51 M tokens, a cluster's pool.
TRACE_CACHES = {"one GPU": 3_800, "cluster pool": 100_000}


def trace_arrivals(
    trace: Sequence[TraceRequest],
    *,
    time_scale: float = 1.0,
    tokens_per_block: int = TRACE_TOKENS_PER_BLOCK,
    max_blocks: int = TRACE_MAX_BLOCKS,
    vocab_size: int = TOY_VOCAB_SIZE,
) -> list[tuple[float, Request]]:
    """The trace as (arrival s, Request) pairs: times from its first request x time_scale, lengths / 64.

    Each 512-token block becomes `tokens_per_block` toy tokens drawn from its hash id (equal ids share,
    so prefix caching finds what the trace shares); outputs shrink by the same factor (at least 1 token).
    """
    if time_scale <= 0:
        raise ValueError(f"time_scale is {time_scale!r}; simulated seconds per trace second must be positive.")
    start = trace[0].timestamp_ms if trace else 0
    pairs = []
    for i, source in enumerate(trace):
        cut = truncated(source, max_blocks)
        tokens = prompt_tokens(cut, tokens_per_block, vocab_size)
        outputs = max(1, round(source.output_length * tokens_per_block / TRACE_BLOCK_SIZE))
        pairs.append(((source.timestamp_ms - start) / 1000 * time_scale, Request(i, tokens, outputs)))
    return pairs


def trace_prefix_caching(
    num_requests: int = 600,
    time_scale: float = 1.0,
    caches: dict[str, int] | None = None,
    token_budget: int = 256,
    max_batch_size: int = 16,
) -> dict:
    """TTFT on the trace's first requests with prefix caching off, then on in each cache size (simulated clock)."""
    from kvcourse.kv_cache import KVCacheManager

    caches = TRACE_CACHES if caches is None else caches
    trace = load_trace("conversation", limit=num_requests)
    runs = [("off", min(caches.values()), False)] + [(f"on, {name}", blocks, True) for name, blocks in caches.items()]
    rows = []
    for label, num_blocks, caching in runs:
        arrivals = trace_arrivals(trace, time_scale=time_scale)
        manager = KVCacheManager(num_blocks, TRACE_TOKENS_PER_BLOCK, enable_prefix_caching=caching)
        scheduler = StallFreeScheduler(token_budget, max_batch_size, manager)
        run = serve(
            scheduler, arrivals, SimulatedClock(GPT2_CPU_STEP_COST), ToyExecutor(block_size=TRACE_TOKENS_PER_BLOCK)
        )
        requests = [request for _, request in arrivals]
        rows.append(
            {
                "prefix_caching": label,
                "num_blocks": num_blocks,
                "real_tokens_cached": num_blocks * TRACE_BLOCK_SIZE,
                "hit_rate": manager.prefix_cache_stats.hit_rate,
                "tokens_fed": sum(step.num_tokens for step in run.trace.steps),
                "preemptions": scheduler.num_preemptions,
                "outputs_correct": all(
                    r.output_tokens == toy_generate(r.prompt_tokens, r.max_new_tokens) for r in requests
                ),
                **summarize(run.times, **SLO),
            }
        )
    return {
        "requests": len(trace),
        "trace_seconds": (trace[-1].timestamp_ms - trace[0].timestamp_ms) / 1000,
        "time_scale": time_scale,
        "tokens_per_block": TRACE_TOKENS_PER_BLOCK,
        "truncated": sum(len(r.hash_ids) > TRACE_MAX_BLOCKS for r in trace),
        "rows": rows,
    }


def print_trace_rows(study: dict) -> None:
    """The trace replay, one row per prefix-caching setting."""
    print(
        f"Mooncake conversation trace: first {study['requests']} requests ({study['trace_seconds']:.0f} s of arrivals "
        f"x {study['time_scale']}), lengths / {TRACE_BLOCK_SIZE // study['tokens_per_block']}"
    )
    print("prefix caching        blocks  real tokens  hit rate  tokens fed  TTFT p50   p90   p99  correct")
    for row in study["rows"]:
        print(
            f"{row['prefix_caching']:<20} {row['num_blocks']:>7,} {row['real_tokens_cached'] / 1e6:>10.1f}M "
            f"{row['hit_rate']:>9.1%} {row['tokens_fed']:>11,} {row['ttft_p50']:>9.2f} {row['ttft_p90']:>5.2f} "
            f"{row['ttft_p99']:>5.2f}  {row['outputs_correct']}"
        )


def _wall_clock_part(quick: bool) -> dict:
    """On a GPU: GPT-2 small served on the wall clock; elsewhere, a note saying why it was skipped."""
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device: the wall-clock sweep runs on a GPU only (the simulated clock is above)"}
    from kvcourse.models.gpt2 import load_gpt2

    model = load_gpt2("gpt2", verbose=False).to("cuda")
    rates = (4, 16, 64) if quick else (2, 4, 8, 16, 32, 64, 128)
    sweep = wall_clock_sweep(rates, 32 if quick else 128, model)
    return {"model": "gpt2", "rate_sweep": sweep, "knee_rate": knee(sweep)}


def run(quick: bool = True, *, reference: bool = False) -> dict:
    """The serving study: rate sweep, token-budget sweep, FCFS against skip-ahead, watermark, swap against recompute."""
    from datetime import UTC, datetime

    if reference:
        return run_reference("serving", {"quick": quick})

    n = 64 if quick else 256
    rates = (1, 2, 4, 6, 8, 12, 16, 24) if quick else (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32)
    sweep = rate_sweep(rates, n)
    busy = busy_rate(sweep)
    return {
        "study": "serving",
        "quick": quick,
        "device": device_name(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "clock": "simulated",
        "code": whose_code("scheduler"),
        "step_cost": {"fixed_s": GPT2_CPU_STEP_COST.fixed_s, "per_token_s": GPT2_CPU_STEP_COST.per_token_s},
        "slo": SLO,
        "rate_sweep": sweep,
        "knee_rate": knee(sweep),
        "busy_rate": busy,
        "budget_sweep": budget_sweep((32, 64, 128, 256, 512), rate=busy / 2, num_requests=n),
        "admission": admission_tails(rate=busy, num_requests=n),
        "priority": priority_study(rate=busy, num_requests=n),
        "watermark": watermark_study((0.0, 0.05, 0.1, 0.2), rate=busy, num_requests=n),
        "swap": swap_study(),
        "trace": trace_prefix_caching(num_requests=300 if quick else 600),
        "wall_clock": _wall_clock_part(quick),
    }


def print_table(result: dict) -> None:
    """Each part of the study as a small table."""
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
    print("admission   long TTFT p50   p99   short TTFT p50   p99   tok/s")
    for name, row in result["admission"].items():
        print(
            f"{name:<10} {row['long_ttft_p50']:>14.2f} {row['long_ttft_p99']:>5.2f} "
            f"{row['short_ttft_p50']:>16.2f} {row['short_ttft_p99']:>5.2f} {row['output_tokens_per_s']:>7.1f}"
        )
    print("policy     urgent TTFT p50   p99   others TTFT p50   p99  preemptions")
    for name, row in result["priority"].items():
        print(
            f"{name:<10} {row['urgent_ttft_p50']:>16.2f} {row['urgent_ttft_p99']:>5.2f} "
            f"{row['other_ttft_p50']:>17.2f} {row['other_ttft_p99']:>5.2f} {row['preemptions']:>12}"
        )
    print("watermark  preemptions  recomputed tokens  TTFT p99  TPOT p99")
    for row in result["watermark"]:
        print(
            f"{row['watermark']:>9} {row['preemptions']:>12} {row['recomputed_tokens']:>18} "
            f"{row['ttft_p99']:>9.2f} {row['tpot_p99']:>9.3f}"
        )
    swap = result["swap"]
    print(f"swap vs recompute: the cost model's crossover is {swap['crossover_tokens']} tokens")
    print_swap_rows(swap["rows"])
    print_trace_rows(result["trace"])
    wall = result["wall_clock"]
    if "skipped" in wall:
        print(f"wall clock: skipped ({wall['skipped']})")
        return
    print(f"wall clock, {wall['model']} on this GPU: knee {wall['knee_rate']} requests/s")
    for row in wall["rate_sweep"]:
        print(
            f"{row['rate']:>5} {row['output_tokens_per_s']:>8.1f} tok/s  TTFT p50 {row['ttft_p50']:.3f} p99 "
            f"{row['ttft_p99']:.3f}  TPOT p50 {row['tpot_p50']:.4f} p99 {row['tpot_p99']:.4f}"
        )


def plot_latency_distributions(times: Sequence[RequestTimes], title: str = ""):
    """TTFT and TPOT of every request, side by side, with p50 and p99 marked."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
    done = [t for t in times if t.token_times]
    for ax, name, values in (
        (axes[0], "TTFT (s)", [t.ttft for t in done]),
        (axes[1], "TPOT (s)", [t.tpot for t in done if len(t.token_times) > 1]),
    ):
        ax.hist(values, bins=30, color="tab:blue", alpha=0.7)
        for p, style in ((50, "--"), (99, ":")):
            ax.axvline(percentile(values, p), color="black", linestyle=style, label=f"p{p}")
        ax.set_xlabel(name)
        ax.set_ylabel("requests")
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_rate_sweep(sweep: list[dict]):
    """The latency-throughput curve: p50/p99 TTFT and output tokens/s as the request rate grows."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.2))
    rates = [row["rate"] for row in sweep]
    left.plot(rates, [row["ttft_p50"] for row in sweep], "o-", label="TTFT p50")
    left.plot(rates, [row["ttft_p99"] for row in sweep], "s-", label="TTFT p99")
    left.axhline(SLO["slo_ttft_s"], color="grey", linestyle="--", label="SLO")
    left.set_xlabel("request rate (requests/s)")
    left.set_ylabel("seconds")
    left.legend()
    right.plot([row["output_tokens_per_s"] for row in sweep], [row["ttft_p99"] for row in sweep], "o-")
    for row in sweep:
        right.annotate(f"{row['rate']}/s", (row["output_tokens_per_s"], row["ttft_p99"]), fontsize=8)
    right.set_xlabel("throughput (output tokens/s)")
    right.set_ylabel("TTFT p99 (s)")
    right.set_title("latency against throughput")
    fig.tight_layout()
    return fig


def plot_budget_tradeoff(rows: list[dict]):
    """The chunked-prefill trade-off in one picture: TTFT falls and the decode stall grows with the budget."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.4))
    budgets = [row["token_budget"] for row in rows]
    ax.plot(budgets, [row["ttft_p99"] for row in rows], "o-", color="tab:blue", label="TTFT p99")
    ax.plot(budgets, [row["ttft_p50"] for row in rows], "o--", color="tab:blue", label="TTFT p50")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("token budget per step (max_num_batched_tokens)")
    ax.set_ylabel("TTFT (s)", color="tab:blue")
    other = ax.twinx()
    other.plot(budgets, [row["itl_p99"] for row in rows], "s-", color="tab:red", label="ITL p99")
    other.set_ylabel("inter-token latency p99 (s)", color="tab:red")
    fig.legend(loc="upper center", ncols=3, fontsize=8)
    fig.tight_layout()
    return fig


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
