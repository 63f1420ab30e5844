"""Figures the README quotes, rendered from the stored study data so prose and data cannot disagree.

    python scripts/quoted_figures.py           # exit 1 and show the difference if the README is out of date
    python scripts/quoted_figures.py --write   # rewrite the README's rendered spans from notebooks/data/

A rendered span sits between `<!-- figures: NAME -->` and `<!-- /figures -->` in README.md (the
comments do not show on GitHub or the site). tests/test_quoted_figures.py fails when a span differs
from what its data renders, and checks the figures notebook prose quotes against the same data.
To refresh a study: rerun it (its `--json` line) into notebooks/data/, then run this with --write.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "notebooks" / "data"
README = ROOT / "README.md"
SPAN = re.compile(r"(<!-- figures: (?P<name>[\w-]+) -->)(?P<body>.*?)(<!-- /figures -->)", re.DOTALL)


def load(name: str) -> dict:
    """One stored study (notebooks/data/NAME.json)."""
    return json.loads((DATA / f"{name}.json").read_text())


def _tokens(capacity: int) -> str:
    """10**6 -> '1e6', 3 * 10**6 -> '3e6' (as the README and the study's report write capacities)."""
    mantissa, exponent = f"{capacity:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _rates(rates: dict[str, float], capacities: tuple[int, ...]) -> str:
    """'4.3/5.6/14.4' in percent, one decimal, in the order of `capacities`."""
    return "/".join(f"{100 * rates[str(c)]:.1f}" for c in capacities)


def eviction_gap(study: dict) -> tuple[float, float]:
    """The least and the most percentage points FIFO loses to LRU over the study's eviction capacities."""
    rates = study["eviction"]["hit_rate"]
    gaps = [100 * (rates["LRU"][c] - rates["FIFO"][c]) for c in rates["LRU"]]
    return min(gaps), max(gaps)


def trace_figures(study: dict) -> str:
    """The README's Mooncake trace row: hit rates per capacity, the paper's claims, the eviction policies."""
    chat, synthetic = study["traces"]["conversation"], study["traces"]["synthetic"]
    chat_caps = (10**4, 10**5, 10**6, 3 * 10**6, 10**7, 3 * 10**7, 5 * 10**7, 10**8)
    synthetic_caps = (10**6, 3 * 10**6, 10**7)
    eviction = study["eviction"]["hit_rate"]
    eviction_caps = tuple(sorted(int(c) for c in eviction["LRU"]))
    holds = all(claim for trace in (chat, synthetic) for claim in trace["paper"].values())
    low, high = eviction_gap(study)
    policies = ", ".join(f"{policy} {_rates(eviction[policy], eviction_caps)}%" for policy in ("LRU", "FIFO", "LFU"))
    return (
        f"conversation ({chat['requests']:,} requests): max {100 * chat['max_hit_rate']:.1f}%; "
        f"{'/'.join(map(_tokens, chat_caps))} tokens: {_rates(chat['hit_rate'], chat_caps)}%. "
        f"synthetic ({synthetic['requests']:,}): max {100 * synthetic['max_hit_rate']:.1f}%; "
        f"{'/'.join(map(_tokens, synthetic_caps))}: {_rates(synthetic['hit_rate'], synthetic_caps)}%. "
        f"Paper: 3M below half the max, 50M close to it: {'both hold on both traces' if holds else 'NOT both held'} "
        f"(paper's Table 2: about {chat['paper_cache_ratio']:.0%} and {synthetic['paper_cache_ratio']:.0%}). "
        f"Eviction at {'/'.join(map(_tokens, eviction_caps))} tokens: {policies} "
        f"(FIFO {low:.1f} to {high:.1f} points behind LRU). One full replay of the conversation trace at 3e6 "
        f"tokens: {chat['replay_seconds_3M']:.2f} s ({chat['replay_cpu_seconds_3M']:.2f} s of CPU), whole study "
        f"{chat['seconds'] + synthetic['seconds']:.0f} s; measured on {study['measured_on']}"
    )


# Each rendered span of the README: its name -> the text its data gives.
RENDERERS: dict[str, Callable[[], str]] = {"trace": lambda: trace_figures(load("mooncake_study"))}


def render(text: str) -> str:
    """`text` with every figures span replaced by what its data renders (an unknown name is an error)."""

    def fill(match: re.Match) -> str:
        name = match.group("name")
        if name not in RENDERERS:
            raise KeyError(f"README.md names a figures span {name!r} that scripts/quoted_figures.py does not render")
        return f"{match.group(1)}{RENDERERS[name]()}{match.group(4)}"

    return SPAN.sub(fill, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite README.md's rendered spans")
    args = parser.parse_args(argv)
    text = README.read_text()
    rendered = render(text)
    if args.write:
        README.write_text(rendered)
        print("README.md: figures rendered from notebooks/data/")
        return 0
    if rendered != text:
        print("README.md's figures differ from notebooks/data/: run python scripts/quoted_figures.py --write")
        return 1
    print("README.md's figures match notebooks/data/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
