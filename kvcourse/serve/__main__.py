"""`python -m kvcourse.serve`: serve a model through your engine with an OpenAI-compatible API.

    python -m kvcourse.serve --num-blocks 128 --port 8000          # SmolLM2-135M-Instruct (./course setup)
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "stream": true}'
    python -m kvcourse.serve --model tiny                          # a tiny random GPT-2: fast, gibberish
"""

from __future__ import annotations

import argparse
import sys

import uvicorn

from kvcourse.models.registry import DEFAULT_MODEL, model_names
from kvcourse.serve.app import MAX_BODY_BYTES
from kvcourse.serve.server import LOOPBACK, build_app, exposure_warning


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags of `vllm serve` that this engine has."""
    parser = argparse.ArgumentParser(prog="python -m kvcourse.serve", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, choices=model_names(), help=f"the model to serve (default {DEFAULT_MODEL})"
    )
    parser.add_argument("--num-blocks", type=int, default=256, help="KV-cache blocks in the pool (default 256)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    parser.add_argument("--token-budget", type=int, default=512, help="tokens the model runs per step (default 512)")
    parser.add_argument("--max-batch-size", type=int, default=16, help="requests running at once (default 16)")
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="share prompt blocks between requests and between a request's n completions (default on, as vLLM v1)",
    )
    parser.add_argument(
        "--max-body-bytes", type=int, default=MAX_BODY_BYTES, help=f"larger request bodies get a 413 ({MAX_BODY_BYTES})"
    )
    parser.add_argument(
        "--enable-debug-blocks",
        action="store_true",
        help="serve /debug/blocks even when bound beyond loopback (it shows every request's block table)",
    )
    parser.add_argument(
        "--attention",
        default=None,
        help="fast, reference (your exercises 5.2-5.3) or triton (default: the engine's, fast)",
    )
    parser.add_argument(
        "--host", default=LOOPBACK, help=f"address to listen on (default {LOOPBACK}: this machine only)"
    )
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Build the engine, then serve until Ctrl-C."""
    args = parse_args(argv)
    warning = exposure_warning(args.host)
    debug = warning is None or args.enable_debug_blocks
    if warning is not None:
        print(
            f"{warning} /debug/blocks is {'on' if debug else 'off (--enable-debug-blocks turns it on)'}.",
            file=sys.stderr,
        )
    try:
        app = build_app(
            args.model,
            num_blocks=args.num_blocks,
            block_size=args.block_size,
            token_budget=args.token_budget,
            max_batch_size=args.max_batch_size,
            enable_prefix_caching=args.enable_prefix_caching,
            attention=args.attention,
            max_body_bytes=args.max_body_bytes,
            debug_endpoints=debug,
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvcourse.serve: {exc}", file=sys.stderr)
        return 2
    print(f"Serving {args.model} on http://{args.host}:{args.port}/v1 (OpenAI-compatible); Ctrl-C stops.")
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


if __name__ == "__main__":
    sys.exit(main())
