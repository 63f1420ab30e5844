"""A small load generator: many concurrent streaming clients, each timing its own tokens.

It speaks only the OpenAI completions API (the official `openai` client, `stream=True` with usage),
so the same call measures this server and `vllm serve gpt2`. Per request it records TTFT (send to
first chunk), TPOT ((last chunk - first chunk) / (tokens - 1)) and end-to-end latency, as vLLM's
serving benchmark defines them; `summarize` gives p50/p99 and tokens per second.

Clients start all at once (a burst), or at given arrival times (`arrivals`, seconds from the start:
e.g. `kvcourse.bench.serving.poisson_arrivals`). `request_times` turns the results into the serving
study's `RequestTimes`, so `kvcourse.bench.serving.summarize` (ITL, E2E, goodput) reads a run over
HTTP exactly as it reads a simulated one.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class RequestResult:
    """One completed request as its client saw it."""

    index: int
    text: str
    completion_tokens: int
    ttft: float  # seconds from sending to the first chunk with text or tokens
    latency: float  # seconds from sending to the last chunk
    finish_reason: str | None
    token_ids: list[int] | None = None  # when the server returns them (kvcourse and vLLM: return_token_ids)
    sent_at: float = 0.0  # seconds from the start of the run to sending this request
    token_times: list[float] = field(default_factory=list)  # seconds from the start, one per token received

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (None for a one-token answer)."""
        if self.completion_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.completion_tokens - 1)


async def _one(
    client: Any, model: str, index: int, prompt: Any, max_tokens: int, extra: dict, t0: float, sampling: dict
) -> RequestResult:
    """Send one streaming completion and time its chunks (times are seconds since t0)."""
    start = time.perf_counter()
    first = last = None
    text, token_ids, token_times, usage, finish = [], [], [], None, None
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        **sampling,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        now = time.perf_counter()
        first = first if first is not None else now
        last = now
        text.append(choice.text)
        ids = (choice.model_extra or {}).get("token_ids")
        token_ids.extend(ids or [])
        token_times.extend([now - t0] * (len(ids) if ids is not None else 1))  # a chunk is one token without ids
        finish = choice.finish_reason or finish
    count = usage.completion_tokens if usage is not None else len(token_times)
    first = first if first is not None else time.perf_counter()
    return RequestResult(
        index,
        "".join(text),
        count,
        first - start,
        (last or first) - start,
        finish,
        token_ids or None,
        start - t0,
        token_times,
    )


async def run_load_async(
    base_url: str,
    prompts: Sequence[Any],
    max_tokens: int | Sequence[int],
    model: str,
    *,
    arrivals: Sequence[float] | None = None,
    concurrency: int | None = None,
    return_token_ids: bool = True,
    timeout: float = 300.0,
    sampling: dict[str, Any] | None = None,
) -> tuple[list[RequestResult], float]:
    """Fire every prompt (at its arrival time, or all at once; at most `concurrency` in flight); results, seconds.

    sampling: the sampling parameters of every request (default greedy, {"temperature": 0}, so outputs
    compare with Hugging Face's); a "seed" in it becomes seed + the request's index.
    """
    import openai

    lengths = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    starts = [0.0] * len(prompts) if arrivals is None else list(arrivals)
    if len(lengths) != len(prompts) or len(starts) != len(prompts):
        raise ValueError(
            f"{len(prompts)} prompts, {len(lengths)} max_tokens and {len(starts)} arrivals: give one of each per prompt."
        )
    extra = {"ignore_eos": True, **({"return_token_ids": True} if return_token_ids else {})}
    base = {"temperature": 0} if sampling is None else dict(sampling)

    def per_request(i: int) -> dict[str, Any]:
        return {**base, "seed": base["seed"] + i} if base.get("seed") is not None else base

    limit = asyncio.Semaphore(concurrency or len(prompts) or 1)
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", timeout=timeout, max_retries=0)
    t0 = time.perf_counter()

    async def client_at(i: int) -> RequestResult:
        await asyncio.sleep(max(0.0, t0 + starts[i] - time.perf_counter()))
        async with limit:
            return await _one(client, model, i, prompts[i], lengths[i], extra, t0, per_request(i))

    try:
        results = await asyncio.wait_for(asyncio.gather(*(client_at(i) for i in range(len(prompts)))), timeout)
    finally:
        await client.close()
    return list(results), time.perf_counter() - t0


def run_load(base_url: str, prompts: Sequence[Any], max_tokens: int | Sequence[int], model: str, **kwargs: Any):
    """run_load_async from ordinary code, even inside Jupyter (whose event loop already runs): in a thread."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = asyncio.run(run_load_async(base_url, prompts, max_tokens, model, **kwargs))
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target, name="kvcourse-loadgen")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def summarize(results: Sequence[RequestResult], seconds: float) -> dict[str, float]:
    """Requests, output tokens per second, and p50/p99 TTFT and TPOT in milliseconds."""
    ttft = np.array([r.ttft for r in results]) * 1000
    tpot = np.array([r.tpot for r in results if r.tpot is not None]) * 1000
    tokens = sum(r.completion_tokens for r in results)

    def pct(values: np.ndarray, q: float) -> float:
        return float(np.percentile(values, q)) if len(values) else float("nan")

    return {
        "requests": len(results),
        "output_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else float("nan"),
        "ttft_p50_ms": pct(ttft, 50),
        "ttft_p99_ms": pct(ttft, 99),
        "tpot_p50_ms": pct(tpot, 50),
        "tpot_p99_ms": pct(tpot, 99),
    }


def format_summary(summary: dict[str, float]) -> str:
    """One line a notebook prints."""
    return (
        f"{summary['requests']} requests, {summary['output_tokens']} tokens in {summary['seconds']:.2f} s "
        f"({summary['tokens_per_s']:.0f} tok/s); TTFT p50 {summary['ttft_p50_ms']:.0f} ms, "
        f"p99 {summary['ttft_p99_ms']:.0f} ms; TPOT p50 {summary['tpot_p50_ms']:.1f} ms, "
        f"p99 {summary['tpot_p99_ms']:.1f} ms"
    )


def request_times(results: Sequence[RequestResult], prompt_lens: Sequence[int] | None = None) -> list:
    """The results as the serving study's RequestTimes (arrival = when sent), for its summarize()."""
    from kvcourse.bench.serving import RequestTimes

    return [
        RequestTimes(r.index, r.sent_at, prompt_lens[r.index] if prompt_lens else 0, list(r.token_times))
        for r in results
    ]
