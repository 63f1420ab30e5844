"""The toy executor: it keeps its own simulated KV cache, filled at the positions the scheduler gives."""

from __future__ import annotations

from collections.abc import Sequence

from kvcourse.core.contract import ScheduledSequenceProtocol
from kvcourse.core.sched_output import SchedulerOutput
from kvcourse.toy.model import TOY_VOCAB_SIZE, toy_next_token


class ToyExecutor:
    """Stands in for the model: stores each fed token's "K/V" in a simulated cache and samples from the whole context.

    Given block tables (what a paged engine passes), the simulated cache is paged like the real one:
    token at position p of a request lives in slot p % block_size of block table[p // block_size], so
    prefix-cache hits read what another request wrote, and a token fed without a block is an error.
    Without block tables (last lesson's memory-blind scheduler), each request gets its own list.
    """

    def __init__(self, vocab_size: int = TOY_VOCAB_SIZE, block_size: int | None = None) -> None:
        """An empty simulated cache; block_size is needed only when block tables are passed."""
        if vocab_size <= 0:
            raise ValueError(f"vocab_size is {vocab_size}; the toy model needs at least one token id.")
        if block_size is not None and block_size <= 0:
            raise ValueError(f"block_size is {block_size}; a block holds at least one token.")
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.slots: dict[tuple[int, int], int] = {}  # (block id, offset) -> token whose K/V is stored there
        self.cached_tokens: dict[int, list[int]] = {}  # without block tables: request id -> tokens by position

    def execute(self, scheduler_output: SchedulerOutput) -> dict[int, int]:
        """Run one step's plan: forget requests settled since the last step, make its block copies, run its sequences."""
        for request_id in scheduler_output.finished_req_ids:
            self.release(request_id)
        self.copy_blocks(scheduler_output.blocks_to_copy)
        return self.execute_batch(scheduler_output.scheduled_seqs, scheduler_output.block_ids)

    def copy_blocks(self, blocks_to_copy: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: block dst gets every token src holds, before the sequences are written."""
        for src, dst in blocks_to_copy:
            for offset in range(self.block_size or 0):
                if (src, offset) in self.slots:
                    self.slots[dst, offset] = self.slots[src, offset]

    def execute_batch(
        self, batch: Sequence[ScheduledSequenceProtocol], block_tables: dict[int, list[int]] | None = None
    ) -> dict[int, int]:
        """Write each sequence's tokens at its positions, then sample one token where the sequence asks for it."""
        sampled: dict[int, int] = {}
        for sequence in batch:
            rid, tokens, start = sequence.request_id, list(sequence.tokens), sequence.position_ids_start
            self._check_tokens(rid, tokens)
            if block_tables is None:
                context = self._write_own(rid, tokens, start)
            else:
                context = self._write_paged(rid, tokens, start, block_tables.get(rid, []))
            if sequence.samples_token:
                sampled[rid] = toy_next_token(context, self.vocab_size)
        return sampled

    def _check_tokens(self, request_id: int, tokens: list[int]) -> None:
        """A real model would embed any id it is given; the toy one says when an id is not a real token."""
        if not tokens:
            raise ValueError(f"Request {request_id}: a scheduled sequence with no tokens.")
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"Request {request_id}: token {bad[0]} is not in the toy vocabulary (0-{self.vocab_size - 1}); "
                "a placeholder token was fed to the model."
            )

    def _write_own(self, request_id: int, tokens: list[int], start: int) -> list[int]:
        """Unpaged: the request's own list; returns the context the next token is predicted from."""
        cached = self.cached_tokens.setdefault(request_id, [])
        if not 0 <= start <= len(cached):
            raise ValueError(
                f"Request {request_id}: tokens fed at position {start}, but only {len(cached)} positions "
                "hold cached K/V: a gap. Positions must come from num_computed_tokens."
            )
        del cached[start:]
        cached.extend(tokens)
        return list(cached)

    def _write_paged(self, request_id: int, tokens: list[int], start: int, table: list[int]) -> list[int]:
        """Paged: write through the block table, then read the whole context back through it."""
        if self.block_size is None:
            raise ValueError("ToyExecutor needs block_size to use block tables; pass the KV manager's block_size.")
        end = start + len(tokens)
        if end > len(table) * self.block_size:
            raise ValueError(
                f"Request {request_id}: tokens fed up to position {end - 1}, but its {len(table)} blocks hold "
                f"only {len(table) * self.block_size} tokens: a token was scheduled without memory."
            )
        for position, token in enumerate(tokens, start):
            self.slots[self._slot(table, position)] = token
        context = []
        for position in range(end):
            token = self.slots.get(self._slot(table, position))
            if token is None:
                raise ValueError(
                    f"Request {request_id}: position {position} was never written: a gap. "
                    "Positions must come from num_computed_tokens."
                )
            context.append(token)
        return context

    def _slot(self, table: list[int], position: int) -> tuple[int, int]:
        """Where a position's K/V lives: (block id, offset in the block)."""
        return table[position // self.block_size], position % self.block_size

    def release(self, request_id: int) -> None:
        """Forget a finished request's unpaged cache (paged slots stay, like real memory)."""
        self.cached_tokens.pop(request_id, None)
