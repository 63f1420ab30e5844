"""Benchmarks: `python -m kvcourse.bench {allocator,memory,throughput,kernel} [--quick] [--json]`."""
