"""`python -m kvcourse generate "PROMPT"`: one answer from a real model through your engine, and the KV blocks it used.

    python -m kvcourse generate "What is the capital of France?"              # SmolLM2, chat template
    python -m kvcourse generate --model gpt2 --max-new-tokens 20 "The capital of France is"
    python -m kvcourse generate --json "Name three primary colors."          # {"text": ..., "token_ids": [...]}

Greedy decoding, through LLMEngine: your scheduler, KV-cache manager, attention and runner once you have
written them; until then (a fresh clone) the reference ones in solutions/, saying so in one line on stderr
(`--mine` insists on yours; KVCOURSE_SOLUTIONS=1 always runs the reference). An instruct model (SmolLM2) gets the prompt through its chat template and stops
at its end-of-turn token, exactly as Hugging Face's `model.generate(ids, do_sample=False)` would: the
`--json` token ids are the generated ones, that end-of-turn token included when it was reached.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import Any

from kvcourse.core.contract import blocks_needed
from kvcourse.models.registry import DEFAULT_MODEL, chat_prompt, is_instruct, load_model, model_names, stop_token_id

BLOCK_SIZE = 16
DEFAULT_MAX_NEW_TOKENS = 64
ENGINE_MODULES = ("step", "scheduler", "kv_cache", "attention", "model_runner")  # what LLMEngine runs of yours
STUB_MARK = "not written yet: edit kvcourse/"  # the sentence every stub's NotImplementedError carries


@dataclass
class Generation:
    """One prompt's answer and what it took: the tokens, the text, the KV blocks it held at its longest."""

    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    block_ids: list[int]
    block_size: int


def unwritten_engine_exercises() -> list[str]:
    """The engine's exercise modules (kvcourse/*.py) that still hold a stub, read as text (nothing imported)."""
    from kvcourse.course.solutions_switch import SOLUTIONS_DIR

    package = SOLUTIONS_DIR.parent / "kvcourse"
    return [name for name in ENGINE_MODULES if STUB_MARK in (package / f"{name}.py").read_text(encoding="utf-8")]


def choose_engine(mine: bool) -> None:
    """Run the learner's engine once it is written; before that, the reference, said on stderr (--mine: theirs)."""
    from kvcourse.course.solutions_switch import solutions_enabled

    unwritten = [] if mine or solutions_enabled() else unwritten_engine_exercises()
    if unwritten:
        os.environ["KVCOURSE_SOLUTIONS"] = "1"  # read when the exercise modules are first imported, just below
        print(
            f"(exercise stubs are left in kvcourse/{', kvcourse/'.join(f'{m}.py' for m in unwritten)}: this answer "
            "comes from the reference engine in solutions/; --mine runs yours)",
            file=sys.stderr,
        )


def prompt_ids(name: str, tokenizer: Any, prompt: str) -> list[int]:
    """The prompt's token ids: through the chat template for an instruct model, as is otherwise."""
    if is_instruct(name):
        return chat_prompt(tokenizer, [{"role": "user", "content": prompt}])
    return list(tokenizer.encode(prompt))


def generate(
    model: Any, tokenizer: Any, ids: list[int], max_new_tokens: int, block_size: int = BLOCK_SIZE
) -> Generation:
    """Greedy tokens for one prompt through a fresh LLMEngine, stopping at the model's end-of-sequence token."""
    from kvcourse.engine.llm_engine import LLMEngine
    from kvcourse.serve.detokenize import decode

    num_blocks = blocks_needed(len(ids) + max_new_tokens, block_size) + 1
    engine = LLMEngine(model, num_blocks=num_blocks, block_size=block_size, tokenizer=tokenizer)
    request = engine.add_request(ids, max_new_tokens)
    request.eos_token_id = stop_token_id(model)  # the scheduler ends the request there, as generate() would
    held: list[int] = []

    def note_blocks(_record: object) -> None:
        """Before each step runs, the request's block table (its blocks are freed once it finishes)."""
        nonlocal held
        current = engine.kv_cache_manager.get_block_ids(request)
        held = current if len(current) >= len(held) else held

    engine.core.on_schedule = note_blocks
    while engine.has_unfinished_requests():
        engine.step()
    tokens = list(request.output_tokens)
    return Generation(list(ids), tokens, decode(tokenizer, tokens), held, block_size)


def summary(name: str, result: Generation) -> str:
    """The line under the answer: tokens in and out, and the blocks that held their keys and values."""
    blocks = result.block_ids
    return (
        f"[{name}: {len(result.prompt_ids)} prompt tokens + {len(result.token_ids)} generated; "
        f"KV blocks used: {len(blocks)} of {result.block_size} tokens each, ids {blocks}]"
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command's flags."""
    parser = argparse.ArgumentParser(prog="python -m kvcourse generate", description=__doc__.splitlines()[0])
    parser.add_argument("prompt", help="what to ask (an instruct model gets it through its chat template)")
    parser.add_argument("--model", default=DEFAULT_MODEL, choices=model_names(), help=f"default {DEFAULT_MODEL}")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, help="at most this many tokens")
    parser.add_argument("--json", action="store_true", help='print {"text": ..., "token_ids": [...]} only')
    parser.add_argument("--mine", action="store_true", help="run your engine even while some exercises are stubs")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Load the model, generate, print the answer and its blocks (or the JSON); exit 1 with one sentence on failure."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.max_new_tokens < 1:
        print("kvcourse generate: --max-new-tokens must be 1 or more.", file=sys.stderr)
        return 2
    choose_engine(args.mine)
    try:
        model, tokenizer = load_model(args.model)
        result = generate(model, tokenizer, prompt_ids(args.model, tokenizer, args.prompt), args.max_new_tokens)
    except (FileNotFoundError, ValueError) as exc:
        print(f"kvcourse generate: {exc}", file=sys.stderr)
        return 1
    except NotImplementedError as exc:
        print(
            f"kvcourse generate: an exercise the engine needs is not written yet ({exc}); write it, or run the "
            "reference with KVCOURSE_SOLUTIONS=1.",
            file=sys.stderr,
        )
        return 1
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids}))
    else:
        print(result.text.strip())
        print(summary(args.model, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
