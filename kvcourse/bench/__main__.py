"""Dispatch `python -m kvcourse.bench STUDY ...` to kvcourse.bench.STUDY.main."""

from __future__ import annotations

import importlib
import sys

STUDIES = {
    "allocator": "allocation time per block as the pool grows (O(1) check)",
    "waste": "share of reserved KV memory that holds token states, per scheme (alias: memory)",
    "throughput": "tokens per second: HF static batches, HF continuous batching, kvcourse",
    "serving": "TTFT, TPOT, ITL and goodput under Poisson arrivals: rate and token-budget sweeps",
    "kernel": "decode attention time and bandwidth: Triton, gather reference, SDPA",
    "trace": "prefix hit rate vs cache capacity on Mooncake's production traces (their Figure 9)",
}
ALIASES = {"memory": "waste"}  # the study's earlier name


def main(argv: list[str] | None = None) -> int:
    """Run one study; each study parses its own --quick / --json."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ALIASES:
        argv = [ALIASES[argv[0]], *argv[1:]]
    if not argv or argv[0] not in STUDIES:
        print("usage: python -m kvcourse.bench {" + ",".join(STUDIES) + "} [--quick] [--json] [--reference]\n")
        for name, what in STUDIES.items():
            print(f"  {name:<11} {what}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(f"kvcourse.bench.{argv[0]}")
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
