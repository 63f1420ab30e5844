"""Mutants written from the exercises' CONTRACTS (issue 24): the slips a learner makes, not the tests' blind spots.

`scripts/mutation_check.py` runs these after its own list. Each is one edit inside one exercise's
regions in solutions/; every one must be caught by that exercise's own graded tests. They cover the
variants a new learner wrote while solving from the contracts alone (order of operations, partial
updates on a failure path, off-by-one at block boundaries, stale hash and LRU state, tie-breaking,
numerics) and the ones listed in issue 24.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    """One realistic bug: replace `old` by `new` inside the regions of exercise `exercise`."""

    exercise: str
    description: str
    old: str
    new: str


# fmt: off
LEARNER_MUTANTS = [
    # ---- 3.1 the free-block queue ----
    Mutant("3.1", "append walks from the head to find the last block (O(n))",
           "        last = self.fake_tail.prev_free_block\n        last.next_free_block = block\n",
           "        last = self.fake_head\n        while last.next_free_block is not self.fake_tail:\n"
           "            last = last.next_free_block\n        last.next_free_block = block\n"),
    Mutant("3.1", "popleft finds the front through get_all_free_blocks (O(n))",
           "        block = self.fake_head.next_free_block\n        self.remove(block)",
           "        block = self.get_all_free_blocks()[0]\n        self.remove(block)"),
    Mutant("3.1", "remove first checks the block is queued by searching the list (O(n))",
           "        block.prev_free_block.next_free_block = block.next_free_block\n",
           "        if block not in self.get_all_free_blocks():\n            raise ValueError('not queued')\n"
           "        block.prev_free_block.next_free_block = block.next_free_block\n"),
    Mutant("3.1", "popleft takes the most recently freed block (the back)",
           "        block = self.fake_head.next_free_block\n        self.remove(block)",
           "        block = self.fake_tail.prev_free_block\n        self.remove(block)"),
    Mutant("3.1", "append puts the block at the front (LIFO)",
           "        last = self.fake_tail.prev_free_block\n        last.next_free_block = block\n"
           "        block.prev_free_block = last\n        block.next_free_block = self.fake_tail\n"
           "        self.fake_tail.prev_free_block = block\n",
           "        first = self.fake_head.next_free_block\n        self.fake_head.next_free_block = block\n"
           "        block.prev_free_block = self.fake_head\n        block.next_free_block = first\n"
           "        first.prev_free_block = block\n"),
    Mutant("3.1", "remove leaves the next block's back pointer on the removed block",
           "        block.next_free_block.prev_free_block = block.prev_free_block\n", ""),
    Mutant("3.1", "append forgets to count the block", "        self.num_free_blocks += 1\n", ""),
    Mutant("3.1", "append links forwards only (the old last block still points at the tail)",
           "        last.next_free_block = block\n", ""),
    Mutant("3.1", "remove clears only the block's next pointer", "        block.prev_free_block = None\n", ""),
    Mutant("3.1", "popleft unlinks by hand and forgets the back pointer and the block's own pointers",
           "        self.remove(block)\n        return block",
           "        self.fake_head.next_free_block = block.next_free_block\n        self.num_free_blocks -= 1\n"
           "        return block"),
    # ---- 3.2 the block pool ----
    Mutant("3.2", "free_blocks queues the blocks in reverse of the order given",
           "        for block in blocks:\n            block.ref_cnt -= 1",
           "        for block in reversed(blocks):\n            block.ref_cnt -= 1"),
    Mutant("3.2", "touch adds the holder before looking whether the block was free",
           "            if block.ref_cnt == 0:\n                self.free_block_queue.remove(block)\n            block.ref_cnt += 1",
           "            block.ref_cnt += 1\n            if block.ref_cnt == 0:\n                self.free_block_queue.remove(block)"),
    Mutant("3.2", "touch unlinks every block, held ones too",
           "            if block.ref_cnt == 0:\n                self.free_block_queue.remove(block)\n",
           "            self.free_block_queue.remove(block)\n"),
    Mutant("3.2", "a handed-out block gets no holder",
           "            self._maybe_evict_cached_block(block)\n            block.ref_cnt += 1\n",
           "            self._maybe_evict_cached_block(block)\n"),
    Mutant("3.2", "free_blocks drops every holder of a shared block at once",
           "            block.ref_cnt -= 1\n            if block.ref_cnt == 0:",
           "            block.ref_cnt = 0\n            if block.ref_cnt == 0:"),
    Mutant("3.2", "only the first block handed out goes through eviction",
           "            self._maybe_evict_cached_block(block)\n            block.ref_cnt += 1\n            blocks.append(block)",
           "            if not blocks:\n                self._maybe_evict_cached_block(block)\n            block.ref_cnt += 1\n"
           "            blocks.append(block)"),
    Mutant("3.2", "touch takes a free block out of the queue but gives it no holder",
           "                self.free_block_queue.remove(block)\n            block.ref_cnt += 1",
           "                self.free_block_queue.remove(block)\n                continue\n            block.ref_cnt += 1"),
    # ---- 3.3 allocate_slots, _num_new_blocks, can_allocate ----
    Mutant("3.3", "touch(hits) after get_new_blocks: a free hit is handed out again as a new block",
           "        self.block_pool.touch(hits)  # before get_new_blocks: a free hit must not be handed out\n"
           "        req_blocks.extend(hits)\n        copies = self._copy_on_write(req_blocks, to_copy)\n"
           "        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)\n",
           "        req_blocks.extend(hits)\n        copies = self._copy_on_write(req_blocks, to_copy)\n"
           "        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)\n        self.block_pool.touch(hits)\n"),
    Mutant("3.3", "an admission is recorded on every successful allocate_slots",
           "        if is_admission:\n            self._record_admission(request, num_new_computed_tokens if hits else 0)",
           "        self._record_admission(request, num_new_computed_tokens if hits else 0)"),
    Mutant("3.3", "can_allocate ignores copy-on-write",
           "        return self._num_new_blocks(request, num_tokens, 0, len(to_copy)) is not None",
           "        return self._num_new_blocks(request, num_tokens, 0, 0) is not None"),
    Mutant("3.3", "the table is created before the room is checked (a failed admission leaves an empty table)",
           "        if num_new_blocks is None:\n            return None\n        is_admission = request.id not in self.req_to_blocks\n"
           "        req_blocks = self.req_to_blocks.setdefault(request.id, [])\n",
           "        is_admission = request.id not in self.req_to_blocks\n"
           "        req_blocks = self.req_to_blocks.setdefault(request.id, [])\n        if num_new_blocks is None:\n"
           "            return None\n"),
    Mutant("3.3", "returns the new blocks but not the copies", "return KVCacheBlocks(copies + new_blocks)",
           "return KVCacheBlocks(new_blocks)"),
    Mutant("3.3", "returns the whole table", "return KVCacheBlocks(copies + new_blocks)",
           "return KVCacheBlocks(req_blocks)"),
    Mutant("3.3", "refuses an allocation that fits the free blocks exactly",
           "if num_new_blocks + num_extra > self.block_pool.get_num_free_blocks():",
           "if num_new_blocks + num_extra >= self.block_pool.get_num_free_blocks():"),
    Mutant("3.3", "sizing the table forgets the prefix hits it will hold",
           "num_held = len(self.req_to_blocks.get(request.id, [])) + num_hits",
           "num_held = len(self.req_to_blocks.get(request.id, []))"),
    Mutant("3.3", "a table that already covers the tokens asks for a negative number of blocks",
           "max(0, blocks_needed(num_tokens, self.block_size) - num_held)",
           "blocks_needed(num_tokens, self.block_size) - num_held"),
    Mutant("3.3", "the room check ignores the extra free blocks (copies, free hits)",
           "if num_new_blocks + num_extra > self.block_pool.get_num_free_blocks():",
           "if num_new_blocks > self.block_pool.get_num_free_blocks():"),
    Mutant("3.3", "can_allocate forgets the tokens already computed",
           "        num_tokens = request.num_computed_tokens + num_new_tokens\n",
           "        num_tokens = num_new_tokens\n"),
    Mutant("3.3", "full blocks are offered to the prefix cache before the new blocks join the table",
           "        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)\n        req_blocks.extend(new_blocks)\n"
           "        self._cache_full_blocks(request, req_blocks, num_tokens)\n",
           "        self._cache_full_blocks(request, req_blocks, num_tokens)\n"
           "        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)\n        req_blocks.extend(new_blocks)\n"),
    Mutant("3.3", "an admission without hits is recorded with the computed tokens as hits",
           "self._record_admission(request, num_new_computed_tokens if hits else 0)",
           "self._record_admission(request, num_new_computed_tokens)"),
    Mutant("3.3", "the hits go after the new blocks in the table",
           "        req_blocks.extend(hits)\n        copies = self._copy_on_write(req_blocks, to_copy)\n"
           "        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)\n        req_blocks.extend(new_blocks)\n",
           "        copies = self._copy_on_write(req_blocks, to_copy)\n"
           "        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)\n        req_blocks.extend(new_blocks)\n"
           "        req_blocks.extend(hits)\n"),
    Mutant("3.3", "every hit counts as using up a free block, even a held one",
           "sum(1 for block in hits if block.ref_cnt == 0)", "len(hits)"),
    Mutant("3.3", "the prefix hits are never touched (no holder added)",
           "        self.block_pool.touch(hits)  # before get_new_blocks: a free hit must not be handed out\n", ""),
    Mutant("3.3", "no copy-on-write: a shared block is written in place",
           "        copies = self._copy_on_write(req_blocks, to_copy)\n", "        copies = []\n"),
    # ---- 3.4 free ----
    Mutant("3.4", "free leaves an empty table behind", "        blocks = self.req_to_blocks.pop(request.id, [])\n",
           "        blocks = self.req_to_blocks.get(request.id, [])\n        if request.id in self.req_to_blocks:\n"
           "            self.req_to_blocks[request.id] = []\n"),
    Mutant("3.4", "free gives back only the blocks nobody else holds",
           "self.block_pool.free_blocks(reversed(blocks))",
           "self.block_pool.free_blocks(reversed([b for b in blocks if b.ref_cnt == 1]))"),
    Mutant("3.4", "free forgets the table but keeps the blocks", "        self.block_pool.free_blocks(reversed(blocks))\n", ""),
    Mutant("3.4", "free gives the blocks back by descending block id, not tail first",
           "self.block_pool.free_blocks(reversed(blocks))",
           "self.block_pool.free_blocks(sorted(blocks, key=lambda b: -b.block_id))"),
    Mutant("3.4", "free drops the holders by hand, bypassing the pool's queue",
           "        self.block_pool.free_blocks(reversed(blocks))\n",
           "        for block in reversed(blocks):\n            block.ref_cnt -= 1\n"),
]
# fmt: on
