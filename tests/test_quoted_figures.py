"""Every figure the course quotes in prose agrees with the stored data it comes from (issue 39).

The README's study rows are rendered from notebooks/data/ (scripts/quoted_figures.py); a notebook's prose
and stored outputs are read here next to the same data, so a rerun study that moves a figure fails a test
until the prose says the new number.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import nbformat

from kvcourse.bench.trace import VLLM_GPU_MEMORY_UTILIZATION

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_04 = ROOT / "notebooks" / "04_sharing_blocks.ipynb"
NOTEBOOK_06 = ROOT / "notebooks" / "06_measuring_the_payoff.ipynb"


def _figures_module():
    """scripts/quoted_figures.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("quoted_figures", ROOT / "scripts" / "quoted_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FIGURES = _figures_module()
STUDY = FIGURES.load("mooncake_study")


def _markdown(path: Path) -> str:
    """A notebook's prose, one string (lines re-joined so a phrase may wrap)."""
    cells = nbformat.read(path, as_version=4).cells
    return " ".join(" ".join(c.source.split()) for c in cells if c.cell_type == "markdown")


def _stdout(path: Path) -> str:
    """Everything a notebook's stored outputs printed."""
    cells = nbformat.read(path, as_version=4).cells
    return "".join(o.get("text", "") for c in cells if c.cell_type == "code" for o in c.outputs)


def test_readme_figures_are_rendered_from_the_data() -> None:
    readme = FIGURES.README.read_text()
    assert FIGURES.SPAN.search(readme), "README.md lost its '<!-- figures: trace -->' span"
    assert FIGURES.render(readme) == readme, (
        "README.md's quoted figures differ from notebooks/data/: run `python scripts/quoted_figures.py --write`"
    )


def test_a_changed_study_changes_the_readme() -> None:
    """The rendered row follows its data (a renderer that ignored the data would pass the test above)."""
    moved = json.loads(json.dumps(STUDY))
    moved["traces"]["conversation"]["hit_rate"]["10000"] = 0.5
    assert "50.0/" in FIGURES.trace_figures(moved)
    assert "50.0/" not in FIGURES.trace_figures(STUDY)


def test_notebook_04_hit_rate_table_matches_the_study() -> None:
    rows = re.findall(r"^\s*([\d,]+)\s+([\d.]+)%\s+([\d.]+)%\s*$", _stdout(NOTEBOOK_04), re.MULTILINE)
    assert len(rows) >= 9, f"notebook 04's hit-rate table is not in its stored outputs ({len(rows)} rows found)"
    for capacity, chat, synthetic in rows:
        key = capacity.replace(",", "")
        for trace, shown in (("conversation", chat), ("synthetic", synthetic)):
            stored = 100 * STUDY["traces"][trace]["hit_rate"][key]
            assert f"{stored:.1f}" == shown, (
                f"notebook 04 shows {shown}% for {trace} at {capacity} tokens, data {stored:.2f}%"
            )


def test_notebook_04_eviction_figures_match_the_study() -> None:
    rows = re.findall(r"^\s*([\d,]+)\s+([\d.]+)%\s+([\d.]+)%\s+([\d.]+)%", _stdout(NOTEBOOK_04), re.MULTILINE)
    assert rows, "notebook 04's eviction table (LRU FIFO LFU) is not in its stored outputs"
    rates = STUDY["eviction"]["hit_rate"]
    for capacity, *shown in rows:
        key = capacity.replace(",", "")
        expected = [f"{100 * rates[policy][key]:.1f}" for policy in ("LRU", "FIFO", "LFU")]
        assert shown == expected, f"notebook 04 at {capacity} tokens shows {shown}, the study {expected}"
    low, high = FIGURES.eviction_gap(STUDY)
    phrase = f"FIFO loses {low:.1f} to {high:.1f} points to LRU"
    assert phrase in _markdown(NOTEBOOK_04), (
        f"notebook 04 §10 should say '{phrase}' (notebooks/data/mooncake_study.json)"
    )


def test_one_gpu_memory_utilization_everywhere() -> None:
    """vLLM 0.33's default, as checked in its wheel, is the value notebook 04 computes with and quotes."""
    report = json.loads((ROOT / "notebooks" / "data" / "vllm_checked.json").read_text())
    claim = next(c for c in report["claims"] if c["symbol"] == "CacheConfig.gpu_memory_utilization")
    assert claim["found"] and f"default={VLLM_GPU_MEMORY_UTILIZATION}" in claim["contains"], (
        f"vllm_checked.json says {claim}, kvcourse.bench.trace says {VLLM_GPU_MEMORY_UTILIZATION}"
    )
    prose = _markdown(NOTEBOOK_04)
    assert f"{VLLM_GPU_MEMORY_UTILIZATION:.0%} of the memory" in prose
    code = "".join(c.source for c in nbformat.read(NOTEBOOK_04, as_version=4).cells if c.cell_type == "code")
    assert "VLLM_GPU_MEMORY_UTILIZATION * gpu_bytes" in code and "0.9 * gpu_bytes" not in code


THROUGHPUT = json.loads((ROOT / "notebooks" / "data" / "cpu_throughput.json").read_text())


def _throughput_quotes(study: dict) -> list[str]:
    """The phrases the README's GPT-2 small throughput row and notebook 06 quote from the stored study."""
    rate, ratio = study["tokens_per_s"], study["ratio_to_hf_static"]
    parts = study["step_breakdown"]["kvcourse"]["fractions"]
    sweep = study["block_size_sweep"]["tokens_per_s"]
    bound = study["roofline"]["bound"]["kvcourse"]["seconds"]
    return [
        f"HF static batches {rate['hf_static']:.1f} tok/s",
        f"HF continuous batching {rate['hf_continuous']:.1f} ({ratio['hf_continuous']:.2f}×)",
        f"**kvcourse {rate['kvcourse']:.1f} ({ratio['kvcourse']:.2f}×; {rate['kvcourse'] / rate['hf_continuous']:.2f}× HF continuous)**",
        f"with the reference attention {rate['kvcourse_ref_attention']:.1f} ({ratio['kvcourse_ref_attention']:.2f}×)",
        f"with the model's own (unpacked) linear layers {rate['kvcourse_model_weights']:.1f}",
        f"Where kvcourse's {study['seconds']['kvcourse']:.2f} s went",
        f"forward pass without attention {parts['forward']:.1%}, attention {parts['attention']:.1%}",
        "Block sizes 8/16/32/64: " + "/".join(f"{sweep[b]:.1f}" for b in ("8", "16", "32", "64")) + " tok/s",
        f"{study['seconds']['kvcourse']:.2f} s against {bound:.2f} s",
    ]


def test_readme_throughput_row_quotes_the_stored_study() -> None:
    readme = " ".join((ROOT / "README.md").read_text().split())
    missing = [q for q in _throughput_quotes(THROUGHPUT) if q not in readme]
    assert not missing, f"README.md does not say what notebooks/data/cpu_throughput.json holds: {missing}"


def test_notebook_06_quotes_the_stored_study() -> None:
    seconds = THROUGHPUT["seconds"]["kvcourse"]
    ratio = seconds / THROUGHPUT["roofline"]["bound"]["kvcourse"]["seconds"]
    prose = _markdown(ROOT / "notebooks" / "06_measuring_the_payoff.ipynb")
    assert f"now {seconds:.2f} s, **{ratio:.2f}x**" in prose, (
        f"notebook 06 should say 'now {seconds:.2f} s, {ratio:.2f}x'"
    )


def test_readme_memory_row_quotes_notebook_06s_table() -> None:
    """The memory study is deterministic: notebook 06 prints it (nbval checks the print), the README quotes it."""
    table = dict(re.findall(r"^(max|pow2|oracle|paged-\d+)\s+([\d.]+)%", _stdout(NOTEBOOK_06), re.MULTILINE))
    assert {"max", "pow2", "oracle", "paged-16"} <= set(table), f"notebook 06's memory table not found: {table}"
    readme = (ROOT / "README.md").read_text()
    quoted = (
        f"max {table['max']}%, pow2 {table['pow2']}%, oracle {table['oracle']}%, paged-16 {table['paged-16']}%",
        "Block size 1/8/32/64/128: " + "/".join(table[f"paged-{b}"] for b in (1, 8, 32, 64, 128)) + "%",
    )
    missing = [q for q in quoted if q not in readme]
    assert not missing, f"README.md's memory row should say {missing} (notebook 06's stored memory study)"
