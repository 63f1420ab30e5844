"""Throughput study: one mixed workload through Hugging Face and through our engine, side by side.

The workload is seeded: prompts of random token ids and output lengths both drawn from long-tailed
(log-normal) distributions, every request asking for its own number of new tokens, EOS ignored.
Each system gets the same model, device, batch size and token capacity:

- `hf_static`: `model.generate` on static batches of `max_batch_size` requests in arrival order,
  left-padded to the longest prompt; a batch runs until its longest request is done;
- `hf_continuous`: transformers' own continuous batching (the `generate_batch` manager, fed one
  `add_request` per request so each keeps its own length), same page size and number of pages;
- `kvcourse`: our `LLMEngine` (StallFreeScheduler + paged KVCacheManager + the fast attention
  backend, `kvcourse.backends.fast`: its default);
- `kvcourse_ref_attention`: the same engine with the learner's reference attention (exercises 5.2-5.3);
- `kvcourse_model_weights` (where the engine packs weights: CPU, GPT-2 small and up): the same engine
  multiplying with the model's own `Conv1D` layers instead of its oneDNN-packed copy
  (`kvcourse.backends.packed`), to show what the packing is worth;
- `kvcourse_triton`: the same with the Triton decode kernel (CUDA only).

Tokens per second counts only the tokens each request asked for, over wall time. Each system is
warmed up on a small slice of the workload, then timed on the whole of it, round after round
interleaved, keeping each system's best round. The block-size sweep reruns `kvcourse` at other
block sizes with the same token capacity. For each kvcourse system the JSON also says where its best
round's time went (`step_breakdown`): schedule, prepare inputs, model forward (attention apart),
attention, sample, update, and whatever else the step loop cost, as seconds and as fractions.

    python -m kvcourse.bench throughput --quick --json [--reference]   # yours, or the reference solutions/
    python -m kvcourse.bench throughput --model smollm2                # SmolLM2-135M-Instruct (./course setup)
"""

from __future__ import annotations

import logging
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import UTC, datetime

from kvcourse.bench.common import (
    device_name,
    emit,
    not_written,
    parse_args,
    pinned_threads,
    progress,
    run_reference,
    whose_code,
)
from kvcourse.core.contract import blocks_needed


@dataclass(frozen=True)
class Workload:
    """Prompts (token ids) and how many new tokens each one asks for."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def useful_tokens(self) -> int:
        """The tokens the requests asked for: what every system is credited with."""
        return sum(self.output_lens)

    def head(self, n: int) -> Workload:
        """The first n requests, with short outputs: a warm-up that touches every code path."""
        return Workload(self.prompts[:n], [min(4, o) for o in self.output_lens[:n]])


@dataclass(frozen=True)
class Settings:
    """Sizes shared by every system, so the comparison is like for like."""

    model: str
    num_requests: int
    prompt_median: int
    output_median: int
    max_len: int
    max_batch_size: int
    token_budget: int
    block_size: int
    rounds: int
    sweep: tuple[int, ...]


def settings(quick: bool, cuda: bool, model: str | None = None) -> Settings:
    """CPU quick: the tiny GPT-2 (seconds, not minutes); CPU full: GPT-2 small; GPU: more, longer requests.

    model: another model (a name of kvcourse.models.registry, e.g. "smollm2") at the same sizes.
    """
    chosen = _sizes(quick, cuda)
    return chosen if model is None else Settings(**{**chosen.__dict__, "model": model})


def _sizes(quick: bool, cuda: bool) -> Settings:
    """The default model and sizes for this device and mode."""
    if cuda:
        return (
            Settings("gpt2", 64, 64, 96, 512, 32, 2048, 16, 2, (8, 16, 32))
            if quick
            else Settings("gpt2", 256, 128, 192, 1024, 64, 4096, 16, 3, (8, 16, 32, 64))
        )
    return (
        Settings("tiny", 24, 16, 16, 128, 8, 256, 16, 2, (8, 32))
        if quick
        else Settings("gpt2", 32, 32, 24, 128, 8, 512, 16, 2, (8, 16, 32, 64))
    )


def make_workload(s: Settings, seed: int = 0, vocab: int = 50257) -> Workload:
    """Seeded long-tailed prompt and output lengths (log-normal, clipped to the context we allow)."""
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(s.num_requests):
        prompt = min(max(2, round(rng.lognormvariate(math.log(s.prompt_median), 0.8))), s.max_len // 2)
        output = min(max(1, round(rng.lognormvariate(math.log(s.output_median), 0.8))), s.max_len - prompt)
        prompts.append([rng.randrange(vocab) for _ in range(prompt)])
        outputs.append(output)
    return Workload(prompts, outputs)


def num_blocks_for(s: Settings, block_size: int) -> int:
    """Blocks enough for a full batch of the longest requests: memory is not what limits here."""
    return s.max_batch_size * blocks_needed(s.max_len, block_size) + 1


def hf_static(model, work: Workload, s: Settings) -> list[list[int]]:
    """Static batching: fixed groups, left-padded, each group runs as long as its longest request."""
    import torch

    outputs = []
    for start in range(0, len(work.prompts), s.max_batch_size):
        prompts = work.prompts[start : start + s.max_batch_size]
        lens = work.output_lens[start : start + s.max_batch_size]
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=mask, do_sample=False, max_new_tokens=max(lens), eos_token_id=None, pad_token_id=0
            )
        outputs += [row[width : width + n].tolist() for row, n in zip(out, lens)]
    return outputs


def hf_continuous(model, work: Workload, s: Settings) -> list[list[int]]:
    """transformers' continuous batching, each request with its own max_new_tokens."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(work.output_lens), eos_token_id=None, pad_token_id=0)
    names = {f.name for f in fields(ContinuousBatchingConfig)}
    page = "page_size" if "page_size" in names else "block_size"  # transformers before 5.24 called it block_size
    cb = ContinuousBatchingConfig(
        **{page: s.block_size},
        num_blocks=num_blocks_for(s, s.block_size),
        max_batch_tokens=s.token_budget,
        max_requests_per_batch=s.max_batch_size,
    )
    results = {}
    # Its logger warns "`eos_token_id` not set ... (disabled)" once per run: disabled is what a fixed-length
    # benchmark asks for (eos_token_id=None above), so the warning says nothing; it is kept off stderr.
    quiet = logging.getLogger("ContinuousBatchingLogger")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return _hf_continuous_run(model, work, config, cb, results)
    finally:
        quiet.setLevel(level)


def _hf_continuous_run(model, work: Workload, config, cb, results: dict) -> list[list[int]]:
    """Feed transformers' continuous-batching manager every request and collect the generated tokens."""
    with model.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=cb, block=True, timeout=30, warmup=False
    ) as manager:
        ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(work.prompts, work.output_lens)]
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped before finishing the workload")
    return [list(results[i].generated_tokens) for i in ids]


STEP_PARTS = ("schedule", "prepare", "forward", "attention", "sample", "update", "other")


def step_breakdown(engine, total_seconds: float) -> dict:
    """Where one run's wall time went, by part of a step; `forward` excludes attention, the fractions sum to 1.

    The engine times schedule / execute / update (`engine.stats.step_seconds`); its runner times the
    parts of execute (`engine.runner.timings`); `other` is the rest (block copies, the step loop).
    """
    phases = engine.stats.step_seconds
    runner = engine.runner.timings
    seconds = {
        "schedule": phases.get("schedule", 0.0),
        "prepare": runner.prepare,
        "forward": runner.forward - runner.attention,
        "attention": runner.attention,
        "sample": runner.sample,
        "update": phases.get("update", 0.0),
    }
    seconds["other"] = max(0.0, total_seconds - sum(seconds.values()))
    total = sum(seconds.values())
    return {
        "seconds": seconds,
        "fractions": {part: value / total for part, value in seconds.items()},
        "steps": runner.steps,
        "synchronized": engine.runner.synchronize_timings,
    }


def kvcourse_engine(
    attention: str = "fast", block_size: int | None = None, synchronize: bool = False, pack_weights: bool | None = None
) -> Callable:
    """Our LLMEngine on the workload; a fresh engine per run, from an empty cache (weights packed once, in the warm-up).

    After each run, `run_engine.breakdown` holds that run's step_breakdown (synchronize: on a GPU,
    wait for the kernels at each timing point, which costs speed: for a dedicated breakdown run) and
    `run_engine.steps` the shape of each of its forward passes (for the roofline bound).
    """

    def run_engine(model, work: Workload, s: Settings) -> list[list[int]]:
        from kvcourse.bench.roofline import recording_steps
        from kvcourse.engine.llm_engine import LLMEngine

        size = block_size or s.block_size
        engine = LLMEngine(
            model,
            num_blocks=num_blocks_for(s, size),
            block_size=size,
            token_budget=s.token_budget,
            max_batch_size=s.max_batch_size,
            attention=attention,
            pack_weights=pack_weights,
        )
        engine.runner.synchronize_timings = synchronize
        # generate() takes one max_new_tokens for all: queue each request with its own, then step.
        requests = [engine.add_request(list(p), n) for p, n in zip(work.prompts, work.output_lens)]
        start = time.perf_counter()
        with recording_steps(model) as steps:
            while engine.scheduler.has_unfinished_requests():
                engine.step()
        run_engine.breakdown = step_breakdown(engine, time.perf_counter() - start)
        run_engine.steps = steps
        return [list(r.output_tokens) for r in requests]

    return run_engine


def systems(cuda: bool, packs: bool = False) -> dict[str, Callable]:
    """Every system to time, by the name used in the JSON (packs: the engine packs this model's weights)."""
    table = {
        "hf_static": hf_static,
        "hf_continuous": hf_continuous,
        "kvcourse": kvcourse_engine("fast"),
        "kvcourse_ref_attention": kvcourse_engine("reference"),
    }
    if cuda:
        table["kvcourse_triton"] = kvcourse_engine("triton")
    if packs:
        table["kvcourse_model_weights"] = kvcourse_engine("fast", pack_weights=False)
    return table


def timed(fn: Callable, model, work: Workload, s: Settings, cuda: bool) -> tuple[float, list[list[int]]]:
    """Wall seconds of one full run (GPU synchronised), and what it produced."""
    import torch

    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn(model, work, s)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def measure(fns: dict[str, Callable], model, work: Workload, s: Settings, cuda: bool) -> tuple[dict, dict, dict]:
    """Warm every system up, then time them round-robin; best round per system, the outputs, the best round's breakdown."""
    for fn in progress(fns.values(), "warm-up"):
        fn(model, work.head(2), s)
    best, outputs, breakdowns = {}, {}, {}
    for _ in progress(range(s.rounds), "rounds"):
        for name, fn in fns.items():
            seconds, outputs[name] = timed(fn, model, work, s, cuda)
            if seconds < best.get(name, math.inf):
                best[name] = seconds
                if hasattr(fn, "breakdown"):
                    breakdowns[name] = fn.breakdown
    return best, outputs, breakdowns


def synchronized_breakdowns(model, work: Workload, s: Settings, names: list[str]) -> dict:
    """On a GPU, one more run per kvcourse system with the timings synchronized (the timed rounds are not)."""
    attention = {"kvcourse": "fast", "kvcourse_ref_attention": "reference", "kvcourse_triton": "triton"}
    result = {}
    for name in names:
        fn = kvcourse_engine(attention[name], synchronize=True)
        fn(model, work, s)
        result[name] = fn.breakdown
    return result


def agreement(outputs: dict[str, list[list[int]]], reference: str = "hf_continuous") -> dict[str, float]:
    """Share of requests whose tokens equal the reference's (greedy decoding: they should agree)."""
    ref = outputs[reference]
    return {
        name: sum(a == b for a, b in zip(out, ref)) / len(ref) for name, out in outputs.items() if name != reference
    }


def run(
    quick: bool = True,
    *,
    threads: int | None = None,
    sweep: bool = True,
    seed: int = 0,
    overrides: dict | None = None,
    reference: bool = False,
    model: str | None = None,
) -> dict:
    """Time every system on one workload (your engine, or with reference=True solutions/'s); ratios to hf_static.

    model: a name of kvcourse.models.registry ("smollm2", "gpt2", ...); None: the tiny GPT-2 quick, else gpt2.
    """
    if reference:
        arguments = {"quick": quick, "threads": threads, "sweep": sweep, "seed": seed, "overrides": overrides}
        return run_reference("throughput", {**arguments, "model": model})
    import torch

    from kvcourse.backends.packed import can_pack
    from kvcourse.bench import roofline

    cuda = torch.cuda.is_available()
    s = settings(quick, cuda, model)
    if overrides:
        s = Settings(**{**s.__dict__, **overrides})
    with pinned_threads(threads, quick, cuda):
        model = load_study_model(s.model, seed).to("cuda" if cuda else "cpu")
        work = make_workload(s, seed, model.config.vocab_size)
        fns = systems(cuda, packs=can_pack(model))
        if sweep:
            fns.update({f"kvcourse_block_{b}": kvcourse_engine("fast", b) for b in s.sweep if b != s.block_size})
        seconds, outputs, breakdowns = measure(fns, model, work, s, cuda)
        if cuda:  # the timed rounds do not wait for the GPU at each timing point: one synchronized run each
            breakdowns = synchronized_breakdowns(model, work, s, [n for n in systems(cuda) if n in breakdowns])
        steps = {
            name: fn.steps for name, fn in fns.items() if name in systems(cuda, packs=True) and hasattr(fn, "steps")
        }
        roof = roofline.summary(steps, seconds, model, cuda)  # this machine's limits, measured now, in this run
        device = device_name()
    return summarize(s, work, seconds, outputs, cuda, sweep, seed, breakdowns) | {
        "roofline": roof,
        "device": device,
        "pretrained": bool(getattr(model, "is_pretrained", False)),
        "code": whose_code("scheduler", "kv_cache", "attention", "model_runner"),
    }


def load_study_model(name: str, seed: int):
    """The study's model: GPT-2 (seeded random weights when not pretrained here) or a registry model (smollm2)."""
    from kvcourse.models.gpt2 import GPT2_SIZES, load_gpt2
    from kvcourse.models.registry import load_model

    if name in GPT2_SIZES or name == "tiny":
        return load_gpt2(name, seed=seed, verbose=False)
    return load_model(name)[0]


def summarize(
    s: Settings,
    work: Workload,
    seconds: dict,
    outputs: dict,
    cuda: bool,
    sweep: bool,
    seed: int,
    breakdowns: dict | None = None,
) -> dict:
    """The JSON object: tokens per second, ratios to hf_static, the block-size sweep, step breakdowns, sanity counts."""
    tps = {name: work.useful_tokens / sec for name, sec in seconds.items()}
    main_names = [name for name in systems(cuda, packs=True) if name in seconds]
    sizes = sorted({*s.sweep, s.block_size}) if sweep else []
    sweep_tps = {str(b): tps["kvcourse" if b == s.block_size else f"kvcourse_block_{b}"] for b in sizes}
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "study": "throughput",
        "model": s.model,
        "settings": s.__dict__ | {"sweep": list(s.sweep)},
        "workload": {
            "requests": len(work.prompts),
            "prompt_tokens": sum(map(len, work.prompts)),
            "useful_output_tokens": work.useful_tokens,
            "longest_prompt": max(map(len, work.prompts)),
            "longest_output": max(work.output_lens),
            "seed": seed,
        },
        "seconds": {n: seconds[n] for n in main_names},
        "tokens_per_s": {n: tps[n] for n in main_names},
        "ratio_to_hf_static": {n: tps[n] / tps["hf_static"] for n in main_names},
        "block_size_sweep": {"tokens_per_s": sweep_tps},
        "step_breakdown": {n: b for n, b in (breakdowns or {}).items() if n in main_names},
        "tokens_generated": {n: sum(map(len, out)) for n, out in outputs.items()},
        "agreement_with_hf_continuous": agreement(outputs),
    }


def ordered(names) -> list[str]:
    """Systems in the story's order (JSON files come back with their keys sorted)."""
    order = [
        "hf_static",
        "hf_continuous",
        "kvcourse",
        "kvcourse_ref_attention",
        "kvcourse_model_weights",
        "kvcourse_triton",
    ]
    return [n for n in order if n in names] + sorted(n for n in names if n not in order)


def print_table(result: dict) -> None:
    """Tokens per second per system, its ratios to HF, its time over the roofline bound and whether its tokens are HF's; then the sweep."""
    w, st = result["workload"], result["settings"]
    print(
        f"throughput study on {result['device']}: {result['model']} "
        f"({'pretrained' if result['pretrained'] else 'seeded random weights'}), {w['requests']} requests, "
        f"{w['prompt_tokens']} prompt + {w['useful_output_tokens']} output tokens, batch {st['max_batch_size']}"
    )
    over = (result.get("roofline") or {}).get("time_over_bound", {})
    same = result.get("agreement_with_hf_continuous", {})
    tps = result["tokens_per_s"]
    print(
        f"{'system':<22} {'tokens/s':>9} {'x hf_static':>11} {'x hf_continuous':>15} {'time / bound':>12} "
        f"{'same tokens':>11}"
    )
    for name in ordered(tps):
        bound = f"{over[name]:>11.2f}x" if name in over else f"{'-':>12}"
        agrees = "reference" if name == "hf_continuous" else f"{same[name]:.0%}" if name in same else "-"
        print(
            f"{name:<22} {tps[name]:>9.1f} {result['ratio_to_hf_static'][name]:>11.2f} "
            f"{tps[name] / tps['hf_continuous']:>15.2f} {bound} {agrees:>11}"
        )
    sweep = result["block_size_sweep"]["tokens_per_s"]
    if sweep:
        sweep = ", ".join(f"{b}: {sweep[str(b)]:.1f}" for b in sorted(map(int, sweep)))
        print(f"kvcourse tokens/s by block size: {sweep}")
    if "kvcourse_triton" not in result["tokens_per_s"]:
        print("kvcourse_triton: skipped, the Triton kernel needs CUDA.")
    print_roofline(result)
    print_breakdown(result)


def print_roofline(result: dict) -> None:
    """This machine's limits, measured in the run, and kvcourse's time against the least its steps could take."""
    roof = result.get("roofline")
    if not roof or "kvcourse" not in roof["bound"]:
        return
    rates = roof["matmul_flops_per_s"]
    bound, took = roof["bound"]["kvcourse"], result["seconds"]["kvcourse"]
    print(
        f"roofline, measured in this run: copy bandwidth {roof['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s; "
        f"matrix products at {roof['matmul_rows']} rows {min(rates.values()) / 1e9:.0f}-{max(rates.values()) / 1e9:.0f} "
        f"GFLOP/s over {len(rates)} weight shapes"
    )
    print(
        f"kvcourse's {bound['steps']} steps read {roof['weight_bytes_per_step'] / 1e6:.0f} MB of weights each (plus KV): "
        f"at least {bound['seconds']:.2f} s ({bound['memory_bound_steps']} steps bound by memory, the rest by arithmetic); "
        f"it took {took:.2f} s = {roof['time_over_bound']['kvcourse']:.2f}x the bound "
        f"({1 / roof['time_over_bound']['kvcourse']:.0%} of the roofline)"
    )


def print_breakdown(result: dict) -> None:
    """Each kvcourse system's share of wall time per part of a step (forward excludes attention)."""
    breakdowns = result.get("step_breakdown") or {}
    if not breakdowns:
        return
    print("where each step's time goes (share of the best round's wall time):")
    print(f"{'system':<22} " + " ".join(f"{part:>9}" for part in STEP_PARTS) + f" {'steps':>6}")
    for name in ordered(breakdowns):
        shares = breakdowns[name]["fractions"]
        print(
            f"{name:<22} "
            + " ".join(f"{shares[part]:>9.1%}" for part in STEP_PARTS)
            + f" {breakdowns[name]['steps']:>6}"
        )


def plot_roofline(result: dict, ax=None):
    """Each kvcourse system's wall time beside the least its steps could take here (memory or arithmetic, per step)."""
    import matplotlib.pyplot as plt

    roof = result["roofline"]
    names = ordered(roof["bound"])
    ax = ax or plt.subplots(figsize=(7, 0.8 + 0.45 * len(names)))[1]
    ax.barh(names, [result["seconds"][n] for n in names], color="#4c956c", label="measured run time")
    ax.barh(names, [roof["bound"][n]["seconds"] for n in names], height=0.35, color="#3d405b", label="roofline bound")
    for y, name in enumerate(names):
        ax.text(result["seconds"][name], y, f" {roof['time_over_bound'][name]:.2f}x", va="center", fontsize=8)
    ax.set(xlabel="seconds for the whole workload", title=f"kvcourse against this machine's limits ({result['model']})")
    ax.legend(fontsize=8, loc="lower right")
    ax.invert_yaxis()
    return ax


def plot_breakdown(result: dict, ax=None):
    """One horizontal bar per kvcourse system, split by part of a step (shares of its wall time)."""
    import matplotlib.pyplot as plt

    breakdowns = result.get("step_breakdown") or {}
    names = ordered(breakdowns)
    ax = ax or plt.subplots(figsize=(7, 0.6 + 0.5 * len(names)))[1]
    colors = ["#8fb8de", "#b0b0b0", "#4c956c", "#e07a5f", "#f2cc8f", "#3d405b", "#dddddd"]
    left = [0.0] * len(names)
    for part, color in zip(STEP_PARTS, colors):
        shares = [breakdowns[n]["fractions"][part] for n in names]
        ax.barh(names, shares, left=left, color=color, label=part)
        left = [a + b for a, b in zip(left, shares)]
    ax.set(xlim=(0, 1), xlabel="share of wall time", title=f"where each step's time goes ({result['model']})")
    ax.legend(ncol=4, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(names) < 3 else -0.2))
    ax.invert_yaxis()
    return ax


def plot(result: dict, ax=None):
    """Tokens per second per system, each bar labelled with its ratio to static batching."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(6, 3.5))[1]
    names = ordered(result["tokens_per_s"])
    colors = ["#b0b0b0", "#8fb8de", "#4c956c", "#2d6a4f", "#74a57f"]
    bars = ax.bar(names, [result["tokens_per_s"][n] for n in names], color=colors[: len(names)])
    ax.bar_label(bars, labels=[f"{result['ratio_to_hf_static'][n]:.2f}x" for n in names])
    title = f"throughput: {result['model']} on {result['device']}\n{result['date'][:10]}"
    ax.set(ylabel="output tokens / s", title=title)
    ax.tick_params(axis="x", labelsize=8)
    return ax


def plot_sweep(result: dict, ax=None):
    """kvcourse tokens per second against block size."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(5, 3.5))[1]
    sweep = result["block_size_sweep"]["tokens_per_s"]
    sizes = sorted(int(b) for b in sweep)
    ax.plot(sizes, [sweep[str(b)] for b in sizes], "o-", color="#2d6a4f")
    ax.set(
        xscale="log",
        xlabel="block size (tokens)",
        ylabel="kvcourse output tokens / s",
        ylim=(0, None),
        title="throughput vs block size",
    )
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.minorticks_off()
    return ax


def main(argv: list[str] | None = None) -> int:
    """`python -m kvcourse.bench throughput [--quick] [--json]`."""
    from kvcourse.models.registry import model_names

    what = "tokens per second: HF static batches, HF continuous batching, kvcourse"
    args = parse_args("throughput", what, argv, models=model_names())
    try:
        result = run(quick=args.quick, reference=args.reference, model=args.model)
    except NotImplementedError as error:
        return not_written(error, "throughput")
    except FileNotFoundError as error:  # SmolLM2 not converted yet: one sentence, no traceback
        print(f"kvcourse.bench throughput: {error}", file=sys.stderr)
        return 1
    print_table(result)
    emit(result, args.json)
    return 0
