"""The scheduler's knobs (notebook 07), each named after vLLM's, checked in words before anything runs.

* `policy="priority"` (vLLM's `scheduling_policy="priority"`): the waiting queue is ordered by
  (request.priority, request.arrival_time), lower value first, and the preemption victim is the
  running request with the largest (priority, arrival_time) instead of the newest admission.
* `watermark=0.01` (vLLM's `--watermark`, off by default; v0's block manager had one too): admit a request only while, after its first
  chunk, at least `watermark_blocks` blocks stay free for the running decodes to grow into.
* `preemption_mode="swap"` with `num_cpu_blocks` (vLLM v0's swap space): a victim's K/V goes to a
  CPU block pool instead of being dropped, and comes back (swap-in) on re-admission, with its
  `num_computed_tokens` intact. Only the toy world's unpaged executor keeps a swapped request's
  tokens (its cache is per request); the GPT-2 engine preempts by recompute only.
"""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("fcfs", "priority")  # vLLM's scheduling_policy values
PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True)
class PreemptionCosts:
    """What preempting a request costs on one machine: moving its K/V (swap) against redoing its prefill (recompute)."""

    kv_bytes_per_token: int  # K and V of one token, all layers (kvcourse.memory.kv_bytes_per_token)
    link_bytes_per_s: float  # host <-> device bandwidth the swap moves K/V over
    link_latency_s: float  # fixed cost of one transfer (launch, synchronisation), each way
    flops_per_token: float  # the model's forward FLOPs per token fed (about 2 x parameters)
    flops_per_s: float  # FLOPs the device achieves on a prefill


def check_knobs(policy: str, watermark: float, preemption_mode: str, num_cpu_blocks: int) -> None:
    """The serving knobs, each checked with a sentence that says what to pass instead."""
    if policy not in POLICIES:
        raise ValueError(f"policy is {policy!r}; use one of {', '.join(map(repr, POLICIES))}.")
    if isinstance(watermark, bool) or not isinstance(watermark, (int, float)) or not 0 <= watermark < 1:
        raise ValueError(f"watermark is {watermark!r}; it is a fraction of the blocks, from 0 up to (not including) 1.")
    if preemption_mode not in PREEMPTION_MODES:
        raise ValueError(
            f"preemption_mode is {preemption_mode!r}; use one of {', '.join(map(repr, PREEMPTION_MODES))}."
        )
    if isinstance(num_cpu_blocks, bool) or not isinstance(num_cpu_blocks, int) or num_cpu_blocks < 0:
        raise ValueError(f"num_cpu_blocks is {num_cpu_blocks!r}; it is a count of CPU blocks, 0 or more.")
    if preemption_mode == "swap" and num_cpu_blocks == 0:
        raise ValueError('preemption_mode="swap" needs a swap space: pass num_cpu_blocks > 0.')


def positive_int(name: str, value: int) -> int:
    """Budgets and sizes are counts; zero or less would schedule nothing forever."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} is {value!r}; it must be a positive whole number.")
    return value


__all__ = ["POLICIES", "PREEMPTION_MODES", "PreemptionCosts", "check_knobs", "positive_int"]
