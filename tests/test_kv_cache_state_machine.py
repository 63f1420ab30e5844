"""Hypothesis drives the reference KVCacheManager through random runs and checks its invariants after every step.

Two machines: `AllocatorMachine` (lesson 03: allocate / free / preempt, no sharing) and
`SharingMachine` (lesson 04: the same plus prefix-cached admissions and forks). Besides the
bookkeeping invariants, both simulate the KV memory itself: every computed token is "written" into
its slot, copy-on-write copies are applied, and each live request must read back exactly its own
tokens through its block table. A sharing bug (a hit with the wrong K/V, a write into a block a
sibling still uses) shows up there.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from reference import load_reference

from kvcourse.core.request import Request

KVCacheManager = load_reference("kv_cache").KVCacheManager
PREFIXES = [[7, 1, 2, 3, 4, 5, 6, 7], [7, 1, 2, 3, 0, 0], [2]]  # shared "system prompts"
SETTINGS = settings(max_examples=200, stateful_step_count=25, deadline=None)


class AllocatorMachine(RuleBasedStateMachine):
    """Allocate, free and preempt over a small pool; invariants after every step."""

    caching = False

    def __init__(self) -> None:
        super().__init__()
        self.running: dict[int, Request] = {}  # hold blocks (possibly zero so far)
        self.waiting: dict[int, Request] = {}  # preempted, to be admitted again from scratch
        self.next_id = 0
        self.memory: dict[int, list[int | None]] = {}  # block id -> the token whose K/V each slot holds

    @initialize(num_blocks=st.integers(1, 12), block_size=st.integers(1, 4))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=self.caching)
        self.memory = {i: [None] * block_size for i in range(num_blocks)}

    # ---- helpers ----

    def snapshot(self) -> tuple:
        """Everything a failed allocation must leave untouched."""
        pool = self.manager.block_pool
        return (
            pool.get_num_free_blocks(),
            [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            [(b.ref_cnt, b.block_hash) for b in pool.blocks],
            {rid: list(ids) for rid, ids in ((r, self.manager.get_block_ids(req)) for r, req in self.running.items())},
            dict(pool.cached_block_hash_to_block),
            list(self.manager.pending_copies),
        )

    def compute(self, req: Request, start: int, end: int) -> None:
        """The executor: run pending copies, then write tokens [start, end) of req into their slots."""
        for src, dst in self.manager.take_pending_copies():
            self.memory[dst] = list(self.memory[src])
        table, size, tokens = self.manager.get_block_ids(req), self.manager.block_size, req.all_token_ids
        for pos in range(start, end):
            self.memory[table[pos // size]][pos % size] = tokens[pos]
        req.num_computed_tokens = end

    def allocate_or_check(self, req: Request, n: int, n_hit: int = 0, hits=None) -> bool:
        """allocate_slots, and on failure check that nothing at all changed."""
        before = self.snapshot()
        got = self.manager.allocate_slots(req, n, n_hit, hits)
        if got is None:
            assert self.snapshot() == before, "a failed allocation changed the manager's state"
        return got is not None

    # ---- rules ----

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 3), max_size=6), data=st.data())
    def admit(self, prefix: list[int], suffix: list[int], data) -> None:
        """A new or preempted request is admitted: prefix hits, then a first chunk."""
        if self.waiting and data.draw(st.booleans(), label="resume a preempted request"):
            req = self.waiting.pop(data.draw(st.sampled_from(sorted(self.waiting)), label="which"))
        else:
            req = Request(self.next_id, (prefix + suffix) or [1], max_new_tokens=4)
            self.next_id += 1
        hits, n_hit = self.manager.get_computed_blocks(req)
        assert n_hit % self.manager.block_size == 0 and n_hit <= req.num_tokens - 1, "a hit must leave the last token"
        assert n_hit == len(hits) * self.manager.block_size, "hit tokens and hit blocks disagree"
        n = data.draw(st.integers(1, req.num_tokens - n_hit), label="first chunk")
        if self.allocate_or_check(req, n, n_hit, hits):
            req.num_computed_tokens = n_hit
            self.running[req.id] = req
            self.compute(req, n_hit, n_hit + n)
        else:
            self.waiting[req.id] = req

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step(self, data) -> None:
        """A running request computes its next chunk, or samples a token and decodes it."""
        req = self.running[data.draw(st.sampled_from(sorted(self.running)), label="request")]
        if req.num_computed_tokens == req.num_tokens:
            req.output_tokens.append(data.draw(st.integers(0, 3), label="sampled token"))
        n = data.draw(st.integers(1, req.num_tokens - req.num_computed_tokens), label="tokens")
        start = req.num_computed_tokens
        if self.allocate_or_check(req, n):
            self.compute(req, start, start + n)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data) -> None:
        """A request ends: all its blocks go back; freeing it again is a no-op."""
        req = self.running.pop(data.draw(st.sampled_from(sorted(self.running)), label="request"))
        self.manager.free(req)
        self.manager.free(req)
        assert self.manager.get_block_ids(req) == [], "a freed request still has a table"

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data) -> None:
        """Preemption by recompute: free, forget computed tokens, wait to be admitted again."""
        req = self.running.pop(data.draw(st.sampled_from(sorted(self.running)), label="request"))
        self.manager.free(req)
        req.num_computed_tokens = 0
        self.waiting[req.id] = req

    # ---- invariants ----

    def tables(self) -> dict[int, list[int]]:
        """Every live block table, by request id."""
        return {rid: self.manager.get_block_ids(req) for rid, req in self.running.items()}

    @invariant()
    def every_block_in_exactly_one_place(self) -> None:
        if not hasattr(self, "manager"):
            return
        pool = self.manager.block_pool
        free = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        held = {bid for table in self.tables().values() for bid in table}
        assert len(free) == len(set(free)) == pool.get_num_free_blocks(), "the free queue repeats a block or miscounts"
        assert not held & set(free), "a block is both free and in a block table"
        assert len(free) + len(held) == pool.num_blocks, "free + held blocks do not add up to the pool"
        assert set(free) | held == set(range(pool.num_blocks)), "a block is neither free nor held (leaked)"

    @invariant()
    def ref_counts_match_holders(self) -> None:
        if not hasattr(self, "manager"):
            return
        holders = Counter(bid for table in self.tables().values() for bid in table)
        free = {b.block_id for b in self.manager.block_pool.free_block_queue.get_all_free_blocks()}
        for block in self.manager.block_pool.blocks:
            assert block.ref_cnt == holders[block.block_id], f"block {block.block_id}: ref count != tables holding it"
            assert (block.ref_cnt == 0) == (block.block_id in free), (
                f"block {block.block_id}: in free queue iff ref 0 broken"
            )
        assert set(self.manager.req_to_blocks) <= set(self.running), "the manager keeps a table for a finished request"

    @invariant()
    def tables_cover_computed_tokens(self) -> None:
        if not hasattr(self, "manager"):
            return
        size = self.manager.block_size
        for req in self.running.values():
            held = len(self.manager.get_block_ids(req))
            assert held == -(-req.num_computed_tokens // size), (
                f"request {req.id}: table does not fit its computed tokens"
            )

    @invariant()
    def every_request_reads_its_own_tokens(self) -> None:
        if not hasattr(self, "manager"):
            return
        size = self.manager.block_size
        for req in self.running.values():
            table, tokens = self.manager.get_block_ids(req), req.all_token_ids
            read = [self.memory[table[p // size]][p % size] for p in range(req.num_computed_tokens)]
            assert read == tokens[: req.num_computed_tokens], f"request {req.id} reads K/V of other tokens"

    @invariant()
    def cached_blocks_hold_their_tokens(self) -> None:
        if not hasattr(self, "manager"):
            return
        pool = self.manager.block_pool
        for block_hash, block in pool.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash, "the cache maps a hash to a block that has another hash"
            assert list(block.token_ids) == self.memory[block.block_id], (
                "a cached block's K/V are not its hashed tokens"
            )
        for block in pool.blocks:
            if block.block_hash is not None:
                assert pool.cached_block_hash_to_block.get(block.block_hash) is block, "a hashed block is not published"
        if not self.caching:
            assert not pool.cached_block_hash_to_block, "blocks were cached with prefix caching off"

    def teardown(self) -> None:
        """Nothing leaks once every request has ended."""
        if not hasattr(self, "manager"):
            return
        for req in list(self.running.values()):
            self.manager.free(req)
        assert self.manager.get_num_free_blocks() == self.manager.num_blocks, "blocks leaked after all requests ended"
        assert all(b.ref_cnt == 0 for b in self.manager.block_pool.blocks), (
            "a ref count is left after all requests ended"
        )
        assert not self.manager.req_to_blocks, "block tables are left after all requests ended"


class SharingMachine(AllocatorMachine):
    """The same with prefix caching on, plus forks (parallel sampling) with copy-on-write."""

    caching = True

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def fork(self, data) -> None:
        """A running request forks a child that shares every block."""
        parent = self.running[data.draw(st.sampled_from(sorted(self.running)), label="parent")]
        child = Request(
            self.next_id,
            list(parent.prompt_tokens),
            max_new_tokens=4,
            output_tokens=list(parent.output_tokens),
            num_computed_tokens=parent.num_computed_tokens,
        )
        self.next_id += 1
        self.manager.fork(parent, child)
        self.running[child.id] = child


TestAllocatorMachine = pytest.mark.timeout(120)(AllocatorMachine.TestCase)
TestAllocatorMachine.settings = SETTINGS
TestSharingMachine = pytest.mark.timeout(120)(SharingMachine.TestCase)
TestSharingMachine.settings = SETTINGS
