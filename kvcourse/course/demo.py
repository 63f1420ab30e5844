"""The source lesson's four prompts through the paged engine: the scheduler trace, then the outputs.

python -m kvcourse.course.demo                      # GPT-2 (pretrained if the Hub answers, else seeded random)
python -m kvcourse.course.demo --model tiny         # the 2-layer test model, in a second
python -m kvcourse.course.demo --num-blocks 6 --block-size 8 --token-budget 24   # tight: chunking, preemption
"""

from __future__ import annotations

import argparse
import sys

from kvcourse.engine.llm_engine import LLMEngine, hf_greedy
from kvcourse.models.gpt2 import LESSON_PROMPTS, load_gpt2, load_tokenizer


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The lesson's settings are the defaults (100 blocks of 16, budget 1024, batch 8, 5 new tokens)."""
    parser = argparse.ArgumentParser(prog="python -m kvcourse.course.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2", help="gpt2, gpt2-medium, ... or tiny (default: gpt2)")
    parser.add_argument("--max-new-tokens", type=int, default=5)
    parser.add_argument("--num-blocks", type=int, default=100)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--token-budget", type=int, default=1024)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--prefix-caching", action="store_true", help="turn on prefix caching")
    parser.add_argument("--attention", choices=["reference", "triton"], default="reference")
    parser.add_argument("--no-check", action="store_true", help="skip the comparison with Hugging Face's generate")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the four prompts, print every step and the decoded continuations."""
    args = parse_args(argv)
    tokenizer = load_tokenizer()
    model = load_gpt2(args.model)
    prompts = [tokenizer.encode(p) for p in LESSON_PROMPTS]
    engine = LLMEngine(
        model,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        token_budget=args.token_budget,
        max_batch_size=args.max_batch_size,
        enable_prefix_caching=args.prefix_caching,
        attention=args.attention,
        tokenizer=tokenizer,
    )
    print(
        f"\n{len(prompts)} requests, prompt tokens {[len(p) for p in prompts]}, {args.max_new_tokens} new tokens each; "
        f"{args.num_blocks} blocks of {args.block_size} tokens, token budget {args.token_budget}, "
        f"batch size {args.max_batch_size}\n"
    )
    outputs = engine.generate(prompts, args.max_new_tokens, trace=True)
    print("Scheduler trace (Rn = request n, @ = positions fed, * = the chunk samples a token):")
    for step in engine.trace:
        print(f"  {step}")
    s = engine.stats
    print(
        f"\n{s.iterations} steps, {s.scheduled_tokens} tokens fed to the model, {s.generated_tokens} generated, "
        f"{s.preemptions} preemptions, {s.prefix_hit_tokens} prompt tokens from the prefix cache.\n"
    )
    for i, (prompt, output) in enumerate(zip(LESSON_PROMPTS, outputs)):
        print(f"Req {i}: {prompt!r}\n    -> {tokenizer.decode(output)!r}  {output}")
    if not args.no_check:
        same = all(out == hf_greedy(model, p, args.max_new_tokens) for p, out in zip(prompts, outputs))
        print(f"\nIdentical to Hugging Face's model.generate(do_sample=False), one prompt at a time: {same}")
        return 0 if same else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
