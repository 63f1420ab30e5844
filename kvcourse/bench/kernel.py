"""Kernel study: decode attention time and achieved bandwidth over batch sizes and context lengths.

Decode attention reads every cached key and value once per step and does little arithmetic on them,
so it is memory-bound: its figure of merit is achieved bandwidth = bytes of K and V read / time.
Three ways are timed side by side on the same data (GPT-2 small's 12 heads of 64, block size 16,
block tables shuffled so pages are scattered as in a real run):

- `triton`: the course's Triton paged kernel (CUDA only; Triton's CPU interpreter times Python);
- `reference`: the gather reference `paged_decode_attention` (one Python loop step per sequence);
- `sdpa`: `torch.nn.functional.scaled_dot_product_attention` on a contiguous [B, H, S, D] cache,
  i.e. what a non-paged engine with the same bytes in one piece would pay.

The device's own copy bandwidth (a large clone: read + write) is measured in the same run as the
practical ceiling; on a known GPU the spec-sheet peak is given too.

    python -m kvcourse.bench kernel --quick --json [--reference]   # yours, or the reference solutions/
"""

from __future__ import annotations

from collections.abc import Callable
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

HEADS, HEAD_DIM, BLOCK_SIZE = 12, 64, 16  # GPT-2 small
SPEC_PEAK_BYTES_PER_S = {  # public spec sheets: HBM bandwidth, for the fraction-of-peak column only
    "H200": 4.8e12,
    "H100 80GB HBM3": 3.35e12,
    "H100 PCIe": 2.0e12,
    "A100-SXM4-80GB": 2.039e12,
    "A100-SXM4-40GB": 1.555e12,
}


def grid(quick: bool, cuda: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Batch sizes and context lengths: small on a CPU, up to long contexts on a GPU."""
    if cuda:
        return ((1, 8, 32, 128), (1024, 4096, 16384)) if not quick else ((1, 16, 64), (1024, 8192))
    return ((1, 8, 32), (256, 1024, 4096)) if not quick else ((1, 8, 32), (256, 1024))


def make_inputs(batch: int, context: int, dtype, device: str, seed: int = 0) -> dict:
    """One layer's paged cache with shuffled block tables, and the same K/V laid out contiguously."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)  # drawn where they live: GBs on a GPU
    per_seq = blocks_needed(context, BLOCK_SIZE)
    num_blocks = batch * per_seq
    shape = (num_blocks, BLOCK_SIZE, HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    value_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    tables = torch.randperm(num_blocks, generator=gen, device=device).view(batch, per_seq).to(torch.int32)
    query = torch.randn((batch, HEADS, HEAD_DIM), generator=gen, device=device, dtype=dtype)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return {
        "query": query,
        "key_cache": key_cache,
        "value_cache": value_cache,
        "block_tables": tables,
        "seq_lens": seq_lens,
        "k": _contiguous(key_cache, tables, context),
        "v": _contiguous(value_cache, tables, context),
    }


def _contiguous(cache, tables, context: int):
    """The same tokens as one [B, H, S, D] tensor per layer: a non-paged engine's layout."""
    batch = tables.shape[0]
    flat = cache[tables.long()].reshape(batch, -1, HEADS, HEAD_DIM)[:, :context]
    return flat.permute(0, 2, 1, 3).contiguous()


def methods(cuda: bool) -> dict[str, Callable[[dict], object]]:
    """The decode-attention implementations to time, by name."""
    import torch.nn.functional as F

    from kvcourse.attention import paged_decode_attention, triton_paged_decode_attention

    def paged(fn):
        return lambda x: fn(x["query"], x["key_cache"], x["value_cache"], x["block_tables"], x["seq_lens"])

    table = {
        "reference": paged(paged_decode_attention),
        "sdpa": lambda x: F.scaled_dot_product_attention(x["query"].unsqueeze(2), x["k"], x["v"]).squeeze(2),
    }
    if cuda:
        table = {"triton": paged(triton_paged_decode_attention), **table}
    return table


def time_call(fn: Callable[[], object], cuda: bool, repeats: int, warmup: int = 1) -> float:
    """Seconds per call, timed with the field's tools: Triton's do_bench on a GPU, torch's Timer on a CPU.

    `triton.testing.do_bench` synchronises and flushes the L2 cache between runs (so a decode kernel is
    measured reading K/V from HBM, as in serving); `torch.utils.benchmark.Timer` runs blocks of calls
    until `repeats` blocks are measured. Both report the median.
    """
    if cuda:
        from triton.testing import do_bench

        return do_bench(fn, warmup=max(1, warmup) * 5, rep=max(repeats, 1) * 10, return_mode="median") / 1e3
    from torch.utils.benchmark import Timer

    for _ in range(warmup):
        fn()
    measurement = Timer(stmt="fn()", globals={"fn": fn}, num_threads=_threads()).blocked_autorange(
        min_run_time=0.02 * max(repeats, 1)
    )
    return measurement.median


def _threads() -> int:
    """Time with the threads torch uses now (the study may pin them), not Timer's default of one."""
    import torch

    return torch.get_num_threads()


def copy_bandwidth(cuda: bool, quick: bool) -> float:
    """Bytes per second of a large copy into memory already touched (read + write): this device's practical ceiling."""
    import torch

    numel = 256 * 2**20 // 4  # 256 MiB: well past every cache
    src = torch.ones(numel, dtype=torch.float32, device="cuda" if cuda else "cpu")
    dst = torch.zeros_like(src)
    seconds = time_call(lambda: dst.copy_(src), cuda, repeats=10 if cuda else 5)
    return 2 * src.numel() * src.element_size() / seconds


def spec_peak(name: str) -> float | None:
    """The spec-sheet bandwidth of a known GPU, or None (CPUs and unknown GPUs)."""
    for key, peak in SPEC_PEAK_BYTES_PER_S.items():
        if key in name:
            return peak
    return None


def measure_point(batch: int, context: int, cuda: bool, quick: bool, fns: dict) -> dict:
    """Every method on one (batch, context): seconds, GB/s, and the largest difference from SDPA."""
    import torch

    dtype = torch.float16 if cuda else torch.float32
    x = make_inputs(batch, context, dtype, "cuda" if cuda else "cpu")
    kv_bytes = 2 * batch * context * HEADS * HEAD_DIM * x["key_cache"].element_size()
    repeats = (20 if cuda else 3) if quick else (50 if cuda else 7)
    expected = fns["sdpa"](x).float()
    row = {
        "batch": batch,
        "context": context,
        "kv_bytes": kv_bytes,
        "seconds": {},
        "bytes_per_s": {},
        "max_abs_diff": {},
    }
    for name, fn in fns.items():
        row["max_abs_diff"][name] = float((fn(x).float() - expected).abs().max())
        seconds = time_call(lambda fn=fn: fn(x), cuda, repeats)
        row["seconds"][name] = seconds
        row["bytes_per_s"][name] = kv_bytes / seconds
    return row


def run(
    quick: bool = True,
    *,
    batches: tuple[int, ...] | None = None,
    contexts: tuple[int, ...] | None = None,
    threads: int | None = None,
    reference: bool = False,
) -> dict:
    """Time every method over the grid (your attention, or with reference=True solutions/'s); GPU: % of peak."""
    if reference:
        return run_reference("kernel", {"quick": quick, "batches": batches, "contexts": contexts, "threads": threads})
    import torch

    cuda = torch.cuda.is_available()
    default_batches, default_contexts = grid(quick, cuda)
    batches, contexts = batches or default_batches, contexts or default_contexts
    fns = methods(cuda)
    points = [(b, c) for b in batches for c in contexts]
    with pinned_threads(threads, quick, cuda):
        rows = [measure_point(b, c, cuda, quick, fns) for b, c in progress(points, "kernel grid")]
        copy_bw = copy_bandwidth(cuda, quick)
        device = device_name()
    peak = spec_peak(device) if cuda else None
    for row in rows:
        row["fraction_of_copy"] = {m: bw / copy_bw for m, bw in row["bytes_per_s"].items()}
        if peak:
            row["fraction_of_peak"] = {m: bw / peak for m, bw in row["bytes_per_s"].items()}
    return {
        "device": device,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "study": "kernel",
        "code": whose_code("attention"),
        "cuda": cuda,
        "dtype": "float16" if cuda else "float32",
        "heads": HEADS,
        "head_dim": HEAD_DIM,
        "block_size": BLOCK_SIZE,
        "methods": list(fns),
        "copy_bytes_per_s": copy_bw,
        "spec_peak_bytes_per_s": peak,
        "rows": rows,
        "triton": "timed" if cuda else "skipped: needs CUDA (the CPU interpreter would time Python, not memory)",
    }


def print_table(result: dict) -> None:
    """One line per (batch, context): time and GB/s per method."""
    print(
        f"kernel study on {result['device']} ({result['dtype']}, {result['heads']} heads x {result['head_dim']}, "
        f"block size {result['block_size']}); copy bandwidth {result['copy_bytes_per_s'] / 1e9:.1f} GB/s"
    )
    if not result["cuda"]:
        print("Triton kernel: skipped, it needs CUDA (on a CPU only its interpreter runs, which times Python).")
    peak = result.get("spec_peak_bytes_per_s")
    peak_head = f" {'% peak':>6}" if peak else ""
    head = " ".join(f"{m + ' ms':>13} {m + ' GB/s':>14}{peak_head}" for m in result["methods"])
    print(f"{'batch':>5} {'context':>7} {'KV MB':>7} {head}")
    for row in result["rows"]:
        cells = " ".join(
            f"{row['seconds'][m] * 1e3:>13.3f} {row['bytes_per_s'][m] / 1e9:>14.2f}"
            + (f" {row['bytes_per_s'][m] / peak:>6.1%}" if peak else "")
            for m in result["methods"]
        )
        print(f"{row['batch']:>5} {row['context']:>7} {row['kv_bytes'] / 1e6:>7.1f} {cells}")
    if peak:
        print(f"% peak: of the spec-sheet bandwidth, {peak / 1e12:.2f} TB/s")


def plot(result: dict):
    """Achieved bandwidth against context length, one panel per batch size; the copy ceiling dashed."""
    import matplotlib.pyplot as plt

    batches = sorted({row["batch"] for row in result["rows"]})
    fig, axes = plt.subplots(1, len(batches), figsize=(4 * len(batches), 3.5), sharey=True, squeeze=False)
    for ax, batch in zip(axes[0], batches):
        rows = [r for r in result["rows"] if r["batch"] == batch]
        for method in result["methods"]:
            ax.plot([r["context"] for r in rows], [r["bytes_per_s"][method] / 1e9 for r in rows], "o-", label=method)
        ax.axhline(result["copy_bytes_per_s"] / 1e9, ls="--", color="gray", label="copy (measured)")
        if result.get("spec_peak_bytes_per_s"):
            ax.axhline(result["spec_peak_bytes_per_s"] / 1e9, ls=":", color="black", label="spec peak")
        ax.set(xscale="log", yscale="log", xlabel="context length (tokens)", title=f"batch {batch}")
        ax.set_xticks([r["context"] for r in rows], [str(r["context"]) for r in rows])
        ax.minorticks_off()
    axes[0][0].set_ylabel("K/V bytes read / time (GB/s)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"decode attention on {result['device']}, {result['dtype']}, {result['date'][:10]}")
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    """`python -m kvcourse.bench kernel [--quick] [--json]`."""
    args = parse_args("kernel", "decode attention time and bandwidth: Triton, gather reference, SDPA", argv)
    try:
        result = run(quick=args.quick, reference=args.reference)
    except NotImplementedError as error:
        return not_written(error, "kernel")
    print_table(result)
    emit(result, args.json)
    return 0
