"""LLMEngine: the scheduler, the paged KV-cache manager and the model runner, in one generate loop.

Each step (vLLM v1's EngineCore.step, in miniature):
    batch = scheduler.schedule_next_batch()          # memory is allocated before anything runs
    tokens = runner.execute(batch, block tables)     # one GPT-2 forward over every scheduled token
    scheduler.update_from_output(batch, tokens)      # append samples, finish and free requests

Decoding is greedy and ignores end-of-sequence (vLLM's `ignore_eos=True`, what benchmarks use):
every request gets exactly `max_new_tokens` tokens, so its output compares one to one with
Hugging Face's `model.generate(ids, do_sample=False, max_new_tokens=n, eos_token_id=None)` for that
prompt alone (`hf_greedy` below).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from kvcourse.kv_cache import KVCacheManager
from kvcourse.kv_cache_interface import blocks_needed
from kvcourse.model_runner import ModelRunner
from kvcourse.request import Request
from kvcourse.scheduler import StallFreeScheduler

Prompt = str | Sequence[int]
PROGRESS_MIN_TOKENS = 256  # show a progress bar by default when a run generates at least this many tokens


@dataclass
class EngineStats:
    """What the last generate() call did: steps, tokens, preemptions and prefix-cache hits."""

    iterations: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    scheduled_tokens: int = 0  # tokens fed to the model (prefill chunks, recomputes and decodes)
    preemptions: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache instead of the model
    dropped_sequences: int = 0  # scheduled, then preempted later in the same step: not run


@dataclass
class StepTrace:
    """One step as the scheduler planned it, for printing the lesson's trace."""

    iteration: int
    sequences: list[tuple[int, str, int, int]]  # (request id, "prefill" or "decode", start, tokens)
    free_blocks: int
    num_blocks: int
    finished: list[int] = field(default_factory=list)
    preempted: int = 0

    def __str__(self) -> str:
        parts = [f"Req {rid}: {kind} {n} token{'s' * (n != 1)} at {start}" for rid, kind, start, n in self.sequences]
        line = (
            f"iter {self.iteration:>3} | " + "; ".join(parts) + f" | free blocks {self.free_blocks}/{self.num_blocks}"
        )
        if self.preempted:
            line += f" | {self.preempted} preempted"
        if self.finished:
            line += f" | finished {self.finished}"
        return line


class LLMEngine:
    """Greedy generation for GPT-2 through our scheduler, paged KV cache and paged attention."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_blocks: int,
        block_size: int = 16,
        token_budget: int = 512,
        max_batch_size: int = 16,
        enable_prefix_caching: bool = False,
        attention: str = "reference",
        tokenizer=None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.kv_cache_manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = StallFreeScheduler(token_budget, max_batch_size, self.kv_cache_manager)
        self.runner = ModelRunner(model, num_blocks, block_size, attention)
        self.max_positions = int(model.config.n_positions)
        self.stats = EngineStats()
        self.trace: list[StepTrace] = []
        self._next_request_id = 0
        self._requests: dict[int, Request] = {}  # every request this engine was given, by id

    # ------------------------------------------------------------------ public
    def generate(
        self, prompts: Sequence[Prompt], max_new_tokens: int, *, progress: bool | None = None, trace: bool = False
    ) -> list[list[int]]:
        """The greedy continuation of every prompt (token ids), in the order given.

        prompts: strings (encoded with the tokenizer, GPT-2's by default) or lists of token ids.
        progress: a tqdm bar on stderr; None shows it for runs of PROGRESS_MIN_TOKENS tokens or more.
        trace: record every step in `self.trace` (print them with `print(*engine.trace, sep="\\n")`).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise ValueError("prompts must be a list of prompts (strings or token-id lists), even for one prompt.")
        token_lists = [self._encode(i, prompt) for i, prompt in enumerate(prompts)]
        self._check_requests(token_lists, max_new_tokens)
        requests = [self._add_request(tokens, max_new_tokens) for tokens in token_lists]
        self.stats, self.trace = EngineStats(prompt_tokens=sum(map(len, token_lists))), []
        show = sum(r.max_new_tokens for r in requests) >= PROGRESS_MIN_TOKENS if progress is None else progress
        with tqdm(
            total=len(requests) * max_new_tokens,
            desc="generating",
            unit="tok",
            file=sys.stderr,
            disable=not show,
            leave=False,
        ) as bar:
            while self.scheduler.has_unfinished_requests():
                sampled = self.step(trace=trace)
                bar.update(sampled)
        return [list(r.output_tokens) for r in requests]

    def add_request(self, prompt: Prompt, max_new_tokens: int) -> Request:
        """Queue one prompt without running it (drive the engine with step(), as a benchmark does)."""
        tokens = self._encode(0, prompt)
        self._check_requests([tokens], max_new_tokens)
        return self._add_request(tokens, max_new_tokens)

    def step(self, trace: bool = False) -> int:
        """Schedule, run and update once; returns how many tokens were sampled."""
        preemptions_before = self.scheduler.num_preemptions
        hits_before = self.kv_cache_manager.prefix_cache_stats.hits
        batch = self.scheduler.schedule_next_batch()
        if not batch:
            raise RuntimeError(
                f"the scheduler planned an empty step with requests still unfinished ({self.scheduler!r}): "
                "the cache may be too small for even one request to make progress; raise num_blocks."
            )
        batch = self._drop_preempted(batch)
        self.stats.preemptions += self.scheduler.num_preemptions - preemptions_before
        self.stats.prefix_hit_tokens += self.kv_cache_manager.prefix_cache_stats.hits - hits_before
        if not batch:
            return 0
        self._apply_block_copies()
        block_tables = {
            seq.request_id: self.kv_cache_manager.get_block_ids(self._requests[seq.request_id]) for seq in batch
        }
        next_tokens = self.runner.execute(batch, block_tables)
        sampled = {seq.request_id: next_tokens[seq.request_id] for seq in batch if self._samples(seq)}
        finished = self.scheduler.update_from_output(batch, sampled)
        self.stats.iterations += 1
        self.stats.scheduled_tokens += sum(len(seq.tokens) for seq in batch)
        self.stats.generated_tokens += len(sampled)
        if trace:
            self.trace.append(
                StepTrace(
                    self.stats.iterations,
                    [
                        (s.request_id, "decode" if s.is_decode else "prefill", s.position_ids_start, len(s.tokens))
                        for s in batch
                    ],
                    self.kv_cache_manager.get_num_free_blocks(),
                    self.kv_cache_manager.num_blocks,
                    [r.id for r in finished],
                    self.scheduler.num_preemptions - preemptions_before,
                )
            )
        return len(sampled)

    # ------------------------------------------------------------------ helpers
    def _encode(self, index: int, prompt: Prompt) -> list[int]:
        """Token ids for one prompt; strings go through the tokenizer (GPT-2's unless another was given)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                from kvcourse.models import load_tokenizer

                self.tokenizer = load_tokenizer()
            tokens = self.tokenizer.encode(prompt)
        else:
            tokens = [int(t) for t in prompt]
        if not tokens:
            raise ValueError(f"prompt {index} is empty: give at least one token (the model needs one to predict from).")
        return tokens

    def _check_requests(self, token_lists: list[list[int]], max_new_tokens: int) -> None:
        """Refuse, before anything runs, what could never be served, saying how to fix it."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens is {max_new_tokens!r}; it must be a whole number, 1 or more.")
        manager = self.kv_cache_manager
        for i, tokens in enumerate(token_lists):
            total = len(tokens) + max_new_tokens
            if total > self.max_positions:
                raise ValueError(
                    f"prompt {i} has {len(tokens)} tokens and asks for {max_new_tokens} more, but the model's "
                    f"context holds {self.max_positions} positions (config.n_positions): shorten the prompt "
                    "or lower max_new_tokens."
                )
            if blocks_needed(total, manager.block_size) > manager.num_blocks:
                raise ValueError(
                    f"prompt {i} needs {blocks_needed(total, manager.block_size)} blocks of {manager.block_size} "
                    f"tokens at its longest, but the cache has {manager.num_blocks}: raise num_blocks, "
                    "shorten the prompt or lower max_new_tokens."
                )

    def _add_request(self, tokens: list[int], max_new_tokens: int) -> Request:
        """Hand one prompt to the scheduler under a fresh id (ids never repeat across generate calls)."""
        request = Request(id=self._next_request_id, prompt_tokens=tokens, max_new_tokens=max_new_tokens)
        self._next_request_id += 1
        self._requests[request.id] = request
        self.scheduler.add_request(request)
        return request

    def _drop_preempted(self, batch: list) -> list:
        """A sequence preempted later in the same step lost its blocks: it must not run (it will be recomputed)."""
        kept = [seq for seq in batch if seq.request_id in self.scheduler.active_pool]
        self.stats.dropped_sequences += len(batch) - len(kept)
        return kept

    def _apply_block_copies(self) -> None:
        """Copy-on-write: the manager lists (src, dst) blocks whose contents must be duplicated first."""
        take = getattr(self.kv_cache_manager, "take_pending_copies", None)
        for src, dst in take() if take else []:
            for layer in self.runner.kv_cache.layers:
                layer.keys[dst] = layer.keys[src]
                layer.values[dst] = layer.values[src]

    @staticmethod
    def _samples(seq) -> bool:
        """Whether this sequence's last token yields a new token (every decode; the last prefill chunk)."""
        return bool(getattr(seq, "samples_token", seq.is_decode))


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt_tokens: Sequence[int], max_new_tokens: int) -> list[int]:
    """Hugging Face's own greedy generate for one prompt, EOS ignored like the engine: the reference to match."""
    input_ids = torch.tensor([list(prompt_tokens)], device=next(model.parameters()).device)
    output = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=None,
        pad_token_id=model.config.eos_token_id or 0,
    )
    return output[0, input_ids.shape[1] :].tolist()
