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
    # ---- 4.1 the hash chain ----
    Mutant("4.1", "hashes the tokens' digits joined into one string ([1, 23] and [12, 3] collide)",
           "repr((parent_block_hash, [int(token) for token in token_ids]))",
           "repr((parent_block_hash, ''.join(str(token) for token in token_ids)))"),
    Mutant("4.1", "sorts the tokens first (order no longer matters)", "[int(token) for token in token_ids]",
           "sorted(int(token) for token in token_ids)"),
    Mutant("4.1", "returns the hex string, not the digest bytes", "HASH_FUNCTION(payload).digest()",
           "HASH_FUNCTION(payload).hexdigest()"),
    Mutant("4.1", "the chain misses a last block that ends exactly at the end",
           "range(0, len(token_ids) - block_size + 1, block_size)", "range(0, len(token_ids) - block_size, block_size)"),
    Mutant("4.1", "the chain hashes the partial last block too", "range(0, len(token_ids) - block_size + 1, block_size)",
           "range(0, len(token_ids), block_size)"),
    Mutant("4.1", "hashes the tokens as given: a tuple and a list of the same tokens differ",
           "repr((parent_block_hash, [int(token) for token in token_ids]))", "repr((parent_block_hash, token_ids))"),
    # ---- 4.2 publishing and the hash chain kept per request ----
    Mutant("4.2", "every full block is re-offered on every step (publish once not enforced)",
           "        num_done = self.num_cached_block.get(request.id, 0)\n", "        num_done = 0\n"),
    Mutant("4.2", "the publishing progress is never recorded", "        self.num_cached_block[request.id] = num_full\n", ""),
    Mutant("4.2", "publishes blocks whose tokens are not known yet",
           "num_full = min(num_tokens, request.num_tokens) // self.block_size", "num_full = num_tokens // self.block_size"),
    Mutant("4.2", "a published block is published again under a new hash",
           "if block.block_hash is not None or block_hash in self.cached_block_hash_to_block:",
           "if block_hash in self.cached_block_hash_to_block:"),
    Mutant("4.2", "keeps the block's tokens as a list", "block.block_hash, block.token_ids = block_hash, tuple(tokens)",
           "block.block_hash, block.token_ids = block_hash, list(tokens)"),
    Mutant("4.2", "extends a copy of the kept chain (every call hashes again)",
           "        hashes = self.req_to_block_hashes[request.id][1]\n",
           "        hashes = list(self.req_to_block_hashes[request.id][1])\n"),
    Mutant("4.2", "the chain stops one block early when the tokens end on a boundary",
           "while (len(hashes) + 1) * self.block_size <= len(token_ids):",
           "while (len(hashes) + 1) * self.block_size < len(token_ids):"),
    Mutant("4.2", "the chain hashes the prompt only, never the generated tokens",
           "        token_ids = request.all_token_ids\n        while", "        token_ids = request.prompt_tokens\n        while"),
    Mutant("4.2", "publishes the blocks under their neighbours' hashes",
           "hashes[num_done:num_full], block_tokens)", "hashes[num_done + 1:num_full + 1], block_tokens)"),
    # ---- 4.3 lookup ----
    Mutant("4.3", "stops the lookup one block early", "num_lookup = (request.num_tokens - 1) // self.block_size",
           "num_lookup = (request.num_tokens - 2) // self.block_size"),
    Mutant("4.3", "counts hit blocks, not hit tokens", "return KVCacheBlocks(hits), len(hits) * self.block_size",
           "return KVCacheBlocks(hits), len(hits)"),
    Mutant("4.3", "checks the hit against a block's tokens minus its last",
           "token_ids[start : start + self.block_size])", "token_ids[start : start + self.block_size - 1])"),
    Mutant("4.3", "compares the stored tuple with a list", "block.token_ids != tuple(token_ids)",
           "block.token_ids != token_ids"),
    Mutant("4.3", "the lookup takes the hits itself (adds holders)",
           "        return KVCacheBlocks(hits), len(hits) * self.block_size",
           "        self.block_pool.touch(hits)\n        return KVCacheBlocks(hits), len(hits) * self.block_size"),
    Mutant("4.3", "the lookup walks the chain from the newest block back",
           "for i, block_hash in enumerate(self._block_hashes(request)[:num_lookup]):",
           "for i, block_hash in reversed(list(enumerate(self._block_hashes(request)[:num_lookup]))):"),
    # ---- 4.4 eviction ----
    Mutant("4.4", "keeps the block's old tokens", "        block.token_ids = None\n", ""),
    Mutant("4.4", "eviction forgets every cached prefix", "        del self.cached_block_hash_to_block[block.block_hash]\n",
           "        self.cached_block_hash_to_block.clear()\n"),
    Mutant("4.4", "clears the hash before deleting its entry (deletes the entry of None)",
           "        del self.cached_block_hash_to_block[block.block_hash]\n        block.block_hash = None\n",
           "        block.block_hash = None\n        self.cached_block_hash_to_block.pop(block.block_hash, None)\n"),
    # ---- 4.5 fork, copy-on-write, pending copies ----
    Mutant("4.5", "take_pending_copies returns the copies without clearing them",
           "        copies, self.pending_copies = self.pending_copies, []\n", "        copies = list(self.pending_copies)\n"),
    Mutant("4.5", "take_pending_copies clears the very list it returns",
           "        copies, self.pending_copies = self.pending_copies, []\n",
           "        copies = self.pending_copies\n        self.pending_copies.clear()\n"),
    Mutant("4.5", "the child starts with no publishing progress (re-offers the shared blocks)",
           "self.num_cached_block[child.id] = self.num_cached_block.get(parent.id, 0)", "self.num_cached_block[child.id] = 0"),
    Mutant("4.5", "the child inherits no hash chain",
           "        if parent.id in self.req_to_block_hashes:\n"
           "            self.req_to_block_hashes[child.id] = (child, list(self.req_to_block_hashes[parent.id][1]))\n", ""),
    Mutant("4.5", "copies are reported as (dst, src)", "self.pending_copies.append((src.block_id, dst.block_id))",
           "self.pending_copies.append((dst.block_id, src.block_id))"),
    Mutant("4.5", "the copy is taken but the table keeps the shared block", "            req_blocks[i] = dst\n", ""),
    Mutant("4.5", "the inherited chain stays keyed to the parent request",
           "(child, list(self.req_to_block_hashes[parent.id][1]))",
           "(parent, list(self.req_to_block_hashes[parent.id][1]))"),
    Mutant("4.5", "fork shares all but the last block", "self.req_to_blocks[child.id] = list(blocks)",
           "self.req_to_blocks[child.id] = list(blocks[:-1])"),
    # ---- 4.6 which shared blocks a write touches ----
    Mutant("4.6", "a step that writes nothing still copies", "        if num_tokens <= first_write:\n            return []\n", ""),
    Mutant("4.6", "the last block written is left out",
           "last = min(len(req_blocks), blocks_needed(num_tokens, self.block_size))",
           "last = min(len(req_blocks), (num_tokens - 1) // self.block_size)"),
    Mutant("4.6", "the block the write starts in is left out", "range(first_write // self.block_size, last)",
           "range(first_write // self.block_size + 1, last)"),
    Mutant("4.6", "the write starts one block early (copies an untouched full block)",
           "range(first_write // self.block_size, last)", "range(max(0, (first_write - 1) // self.block_size), last)"),
    # ---- 0.x memory arithmetic ----
    Mutant("0.1", "hard-codes two bytes per number (fp16)", "* _bytes_per_element(dtype)", "* 2"),
    Mutant("0.1", "forgets the layers", "return 2 * _num_layers(config) * _kv_width(config)",
           "return 2 * _kv_width(config)"),
    Mutant("0.1", "counts bits, not bytes", "* _bytes_per_element(dtype)", "* 8 * _bytes_per_element(dtype)"),
    Mutant("0.2", "true division: a float count", "return memory_bytes // (seq_len * bytes_per_token)",
           "return memory_bytes / (seq_len * bytes_per_token)"),
    Mutant("0.2", "forgets the sequence length", "memory_bytes // (seq_len * bytes_per_token)",
           "memory_bytes // bytes_per_token"),
    Mutant("0.2", "one short when the budget fits exactly", "memory_bytes // (seq_len * bytes_per_token)",
           "(memory_bytes - 1) // (seq_len * bytes_per_token)"),
    # ---- 5.1 cache writes ----
    Mutant("5.1", "no cast to the cache's dtype",
           "[slots] = key.to(key_cache.dtype)\n    value_cache.view(-1, *value_cache.shape[2:])[slots] = value.to(value_cache.dtype)",
           "[slots] = key\n    value_cache.view(-1, *value_cache.shape[2:])[slots] = value"),
    Mutant("5.1", "casts to float16 whatever the cache's dtype", "[slots] = key.to(key_cache.dtype)",
           "[slots] = key.half()"),
    Mutant("5.1", "swaps block and offset in the slot", "    key_cache.view(-1, *key_cache.shape[2:])[slots] = key.to(key_cache.dtype)\n",
           "    key_cache[slots % key_cache.shape[1], slots // key_cache.shape[1]] = key.to(key_cache.dtype)\n"),
    Mutant("5.1", "writes the values into a reshaped copy",
           "    value_cache.view(-1, *value_cache.shape[2:])[slots] = value.to(value_cache.dtype)",
           "    value_cache.transpose(0, 1).reshape(-1, *value_cache.shape[2:])[slots] = value.to(value_cache.dtype)"),
    # ---- 5.2 the reference decode attention ----
    Mutant("5.2", "no float32 upcast: scores, softmax and sum in the cache's dtype",
           "        keys = gather_kv(key_cache, block_tables[b], seq_len).float()  # [S, H, D]\n"
           "        values = gather_kv(value_cache, block_tables[b], seq_len).float()  # [S, H, D]\n"
           '        scores = torch.einsum("hd,shd->hs", query[b].float(), keys) * scale',
           "        keys = gather_kv(key_cache, block_tables[b], seq_len)  # [S, H, D]\n"
           "        values = gather_kv(value_cache, block_tables[b], seq_len)  # [S, H, D]\n"
           '        scores = torch.einsum("hd,shd->hs", query[b], keys) * scale'),
    Mutant("5.2", "a softmax without subtracting the max", "weights = torch.softmax(scores, dim=-1)\n        out[b]",
           "weights = scores.exp() / scores.exp().sum(-1, keepdim=True)\n        out[b]"),
    Mutant("5.2", "gathers every entry of the block table, padding included",
           "blocks = cache[block_table[:num_blocks].long()]", "blocks = cache[block_table.long()]"),
    Mutant("5.2", "rounds the blocks to read down", "num_blocks = blocks_needed(seq_len, cache.shape[1])",
           "num_blocks = seq_len // cache.shape[1]"),
    Mutant("5.2", "one token short", "        seq_len = int(seq_lens[b])\n", "        seq_len = int(seq_lens[b]) - 1\n"),
    Mutant("5.2", "divides by the scale", 'torch.einsum("hd,shd->hs", query[b].float(), keys) * scale',
           'torch.einsum("hd,shd->hs", query[b].float(), keys) / scale'),
    # ---- 5.3 mixed chunks ----
    Mutant("5.3", "a query sees the token after it", "torch.arange(seq_len - chunk_len, seq_len, device=query.device)",
           "torch.arange(seq_len - chunk_len + 1, seq_len + 1, device=query.device)"),
    Mutant("5.3", "no float32 upcast",
           "    keys = gather_kv(key_cache, block_table, seq_len).float()  # [S, H, D]\n"
           "    values = gather_kv(value_cache, block_table, seq_len).float()  # [S, H, D]\n"
           '    scores = torch.einsum("lhd,shd->hls", query.float(), keys) * scale',
           "    keys = gather_kv(key_cache, block_table, seq_len)  # [S, H, D]\n"
           "    values = gather_kv(value_cache, block_table, seq_len)  # [S, H, D]\n"
           '    scores = torch.einsum("lhd,shd->hls", query, keys) * scale'),
    Mutant("5.3", "softmax over the queries, not the keys", 'float("-inf")), dim=-1)', 'float("-inf")), dim=1)'),
    # ---- 5.4 the Triton kernel ----
    Mutant("5.4", "the running max starts at 0.0, not -inf", '    m_i = float("-inf")\n', "    m_i = 0.0\n"),
    Mutant("5.4", "the loop bound rounds down (the last partial block is skipped)", "range(0, tl.cdiv(seq_len, BLOCK_SIZE))",
           "range(0, seq_len // BLOCK_SIZE)"),
    Mutant("5.4", "the running sum is not rescaled", "l_i = l_i * alpha + tl.sum(p, axis=0)", "l_i = l_i + tl.sum(p, axis=0)"),
    Mutant("5.4", "the running max is never updated", "        m_i = m_new\n", ""),
    Mutant("5.4", "masked scores count as 0, not -inf", 'tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))',
           "tl.sum(k * q[None, :], axis=1) * scale, 0.0)"),
    Mutant("5.4", "every sequence reads the first row of the block table",
           "tl.load(block_tables_ptr + seq * stride_bt + i)", "tl.load(block_tables_ptr + i)"),
    # ---- 5.5 token layout ----
    Mutant("5.5", "a Python loop over tokens",
           "    seq_of_token = torch.repeat_interleave(torch.arange(len(starts)), num_tokens)  # [T]: each token's sequence\n"
           "    offset_in_chunk = torch.arange(int(query_start_loc[-1])) - query_start_loc[seq_of_token]\n"
           "    positions = starts[seq_of_token] + offset_in_chunk\n"
           "    slot_mapping = table[seq_of_token, positions // block_size] * block_size + positions % block_size\n",
           "    pos, slots = [], []\n    for b in range(len(starts)):\n        for i in range(int(num_tokens[b])):\n"
           "            p = int(starts[b]) + i\n            pos.append(p)\n"
           "            slots.append(int(table[b, p // block_size]) * block_size + p % block_size)\n"
           "    positions, slot_mapping = torch.tensor(pos, dtype=torch.long), torch.tensor(slots, dtype=torch.long)\n"),
    Mutant("5.5", "the block index counts from the chunk's start", "table[seq_of_token, positions // block_size]",
           "table[seq_of_token, offset_in_chunk // block_size]"),
    Mutant("5.5", "offsets in the chunk measured from the cached length",
           "offset_in_chunk = torch.arange(int(query_start_loc[-1])) - query_start_loc[seq_of_token]",
           "offset_in_chunk = torch.arange(int(query_start_loc[-1])) - starts[seq_of_token]"),
    # ---- 7.1 priority ----
    Mutant("7.1", "the victim by priority alone, ignoring arrival", "key=lambda r: (r.priority, r.arrival_time))",
           "key=lambda r: r.priority)"),
    Mutant("7.1", "the victim by arrival alone, ignoring priority", "key=lambda r: (r.priority, r.arrival_time))",
           "key=lambda r: r.arrival_time)"),
    Mutant("7.1", "exact ties preempt the oldest admission", "max(reversed(list(self.active_pool.values()))",
           "max(list(self.active_pool.values())"),
    Mutant("7.1", "the queue is ordered by priority only", "if (other.priority, other.arrival_time) > key:",
           "if other.priority > request.priority:"),
    # ---- 7.2 watermark ----
    Mutant("7.2", "exactly the watermark left free is refused", "- needed >= self.watermark_blocks",
           "- needed > self.watermark_blocks"),
    Mutant("7.2", "the blocks needed are rounded down", "needed = blocks_needed(num_new_tokens, manager.block_size)",
           "needed = num_new_tokens // manager.block_size"),
    Mutant("7.2", "the watermark compares tokens with blocks", "manager.get_num_free_blocks() - needed >=",
           "manager.get_num_free_blocks() - num_new_tokens >="),
    # ---- 7.3 swap vs recompute ----
    Mutant("7.3", "a swap pays the bytes once", "return 2 * (costs.link_latency_s + num_tokens * costs.kv_bytes_per_token / costs.link_bytes_per_s)",
           "return 2 * costs.link_latency_s + num_tokens * costs.kv_bytes_per_token / costs.link_bytes_per_s"),
    Mutant("7.3", "swapping nothing still pays the latency", "    if num_tokens == 0:\n        return 0.0\n", ""),
    Mutant("7.3", "the crossover accepts a tie", "if swap_seconds(n, costs) < recompute_seconds(n, costs):",
           "if swap_seconds(n, costs) <= recompute_seconds(n, costs):"),
    Mutant("7.3", "the crossover never tries max_tokens", "for n in range(1, max_tokens + 1):", "for n in range(1, max_tokens):"),
    Mutant("7.3", "CPU blocks rounded down", "cpu_blocks = blocks_needed(num_computed, manager.block_size)",
           "cpu_blocks = num_computed // manager.block_size"),
    Mutant("7.3", "a CPU pool that fits exactly refuses", "cpu_blocks > self.num_free_cpu_blocks",
           "cpu_blocks >= self.num_free_cpu_blocks"),
    Mutant("7.3", "a swapped-in request stays in the waiting queue", "        self.waiting_queue.remove(request)\n", ""),
    Mutant("7.3", "a refused swap-in forgets the kept tokens",
           "        request.num_computed_tokens = kept\n        if blocks is None:\n            return None\n",
           "        if blocks is None:\n            return None\n        request.num_computed_tokens = kept\n"),
    Mutant("7.3", "the swap record is never cleared", "        del self._swapped[request.id]\n", ""),
    # ---- 7.4 abort ----
    Mutant("7.4", "an abort re-settles a request already FINISHED",
           "        request = self.active_pool.pop(request_id, None) or self._take_waiting(request_id)\n",
           "        request = (\n            self.active_pool.pop(request_id, None)\n            or self._take_waiting(request_id)\n"
           "            or next((r for r in self.finished if r.id == request_id), None)\n        )\n"),
    Mutant("7.4", "the reason is not kept", "request.status, request.reason = status, reason", "request.status = status"),
    Mutant("7.4", "an aborted waiting request stays in the queue", "or self._take_waiting(request_id)",
           "or next((r for r in self.waiting_queue if r.id == request_id), None)"),
    # ---- 7.5 reset of the prefix cache ----
    Mutant("7.5", "refuses only while a PUBLISHED block is held", "if self.get_num_free_blocks() < self.num_blocks:",
           "if any(b.ref_cnt > 0 and b.block_hash is not None for b in self.blocks):"),
    Mutant("7.5", "the blocks keep their tokens", "            block.token_ids = None\n", ""),
    Mutant("7.5", "the reset rebuilds the free queue (its order is lost)",
           "        self.cached_block_hash_to_block.clear()\n        return True",
           "        self.cached_block_hash_to_block.clear()\n        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[::-1])\n"
           "        return True"),
    # ---- the held-out examiner's last survivors (issue 24), now caught ----
    Mutant("4.6", "names every shared block to the end of the table, not only those the write falls in",
           "last = min(len(req_blocks), blocks_needed(num_tokens, self.block_size))", "last = len(req_blocks)"),
    Mutant("5.3", "the chunk's result is left in float32", "weights, values).to(query.dtype)", "weights, values)"),
    Mutant("7.4", "the status is always ABORTED, whatever it is given",
           "request.status, request.reason = status, reason", "request.status, request.reason = RequestStatus.ABORTED, reason"),
    # ---- 8.1 the CPU tier takes an evicted block (written from 8.1's contract) ----
    Mutant("8.1", "a block the tier already holds is stored again (a second save, a leaked slot)",
           "        if block.block_hash in self.entries:\n            self.entries.move_to_end(block.block_hash)  # chosen: a re-offered block counts as used\n            return\n",
           ""),
    Mutant("8.1", "a full tier drops its MOST recently used entry", "for block_hash, entry in self.entries.items():",
           "for block_hash, entry in reversed(self.entries.items()):"),
    Mutant("8.1", "a full tier drops a pinned entry (the load reading it gets another block's K/V)",
           "            if entry.slot not in self.pinned:\n", "            if True:\n"),
    Mutant("8.1", "the save (copy out) is never queued", "        self.pending_saves.append((block.block_id, slot))\n", ""),
    Mutant("8.1", "a new entry goes to the LRU end", "        self.entries[block.block_hash] = TierEntry(slot, tuple(block.token_ids))\n",
           "        self.entries[block.block_hash] = TierEntry(slot, tuple(block.token_ids))\n"
           "        self.entries.move_to_end(block.block_hash, last=False)\n"),
    Mutant("8.1", "the drop is not counted", "                self.stats.dropped += 1\n", ""),
    Mutant("8.1", "a full tier takes the next slot number past its capacity",
           "        if self.free_slots:\n            return self.free_slots.pop()\n",
           "        if self.free_slots or True:\n            return self.free_slots.pop() if self.free_slots else len(self.entries)\n"),
    # ---- 8.2 how many more tokens the tier holds ----
    Mutant("8.2", "the block holding the last token is counted too", "last = (request.num_tokens - 1) // size",
           "last = request.num_tokens // size"),
    Mutant("8.2", "the run does not stop at a miss (it counts every held block)",
           "            if entry is None or entry.token_ids != tuple(token_ids[i * size : (i + 1) * size]):\n                break\n            num_blocks += 1\n        return num_blocks * size",
           "            if entry is None or entry.token_ids != tuple(token_ids[i * size : (i + 1) * size]):\n                continue\n            num_blocks += 1\n        return num_blocks * size"),
    Mutant("8.2", "a collision loads (tokens not compared)",
           "            if entry is None or entry.token_ids != tuple(token_ids[i * size : (i + 1) * size]):\n                break\n            num_blocks += 1",
           "            if entry is None:\n                break\n            num_blocks += 1"),
    Mutant("8.2", "the count starts at block 0, not after the device hits",
           "for i in range(num_computed_tokens // size, min(last, len(hashes))):", "for i in range(0, min(last, len(hashes))):"),
    Mutant("8.2", "asking promotes the entries it finds",
           "                break\n            num_blocks += 1\n",
           "                break\n            self.entries.move_to_end(hashes[i])\n            num_blocks += 1\n"),
    Mutant("8.2", "returns blocks, not tokens", "        return num_blocks * size\n", "        return num_blocks\n"),
    # ---- 8.3 the loads after allocation ----
    Mutant("8.3", "the slots are not pinned", "            self.pinned.add(entry.slot)\n", ""),
    Mutant("8.3", "a loaded entry is not promoted", "            self.entries.move_to_end(hashes[i])\n", ""),
    Mutant("8.3", "the loads skip a lost block and go on (a hole in the prefix)",
           "                break\n            self.pending_loads.append", "                continue\n            self.pending_loads.append"),
    Mutant("8.3", "the loads start at block 0, not after the device hits", "        first = request.num_computed_tokens // size\n",
           "        first = 0\n"),
    Mutant("8.3", "the tokens are not compared again (a changed entry loads)",
           "            if entry is None or entry.token_ids != tuple(token_ids[i * size : (i + 1) * size]):\n                break\n            self.pending_loads",
           "            if entry is None:\n                break\n            self.pending_loads"),
    Mutant("8.3", "returns the tokens asked for, not those that will load", "        return num_loaded * size\n",
           "        return num_external_tokens\n"),
    Mutant("8.3", "the failed blocks are not counted", "        self.stats.failed += len(ids) - num_loaded\n", ""),
    # ---- 8.4 start the load ----
    Mutant("8.4", "the tier is asked from token 0, not after the device hits",
           "tier.get_num_new_matched_tokens(request, num_hit_tokens)", "tier.get_num_new_matched_tokens(request, 0)"),
    Mutant("8.4", "the request stays in the waiting queue while it loads", "        self.waiting_queue.remove(request)\n        request.num_computed_tokens = num_hit_tokens\n",
           "        request.num_computed_tokens = num_hit_tokens\n"),
    Mutant("8.4", "loading records the tokens asked for, not those that will load",
           "        self.loading[request.id] = (request, num_loaded)\n", "        self.loading[request.id] = (request, num_external)\n"),
    Mutant("8.4", "the tier is told before num_computed_tokens counts the hits",
           "        request.num_computed_tokens = num_hit_tokens\n        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS\n        num_loaded = tier.update_state_after_alloc(request, blocks, num_external)\n",
           "        num_loaded = tier.update_state_after_alloc(request, blocks, num_external)\n        request.num_computed_tokens = num_hit_tokens\n        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS\n"),
    Mutant("8.4", "the blocks that will not load stay published", "        manager.forget_unwritten_tail(request, num_hit_tokens + num_loaded)\n", ""),
    Mutant("8.4", "the loading request runs at once (RUNNING)", "request.status = RequestStatus.WAITING_FOR_REMOTE_KVS",
           "request.status = RequestStatus.RUNNING"),
    # ---- 8.5 proceed as a prefix hit ----
    Mutant("8.5", "the chunk ignores the budget left", "        num_new_tokens = min(request.num_uncomputed_tokens, token_budget_left)\n",
           "        num_new_tokens = request.num_uncomputed_tokens\n"),
    Mutant("8.5", "the loaded request stays in self.loaded", "        self.loaded.discard(request.id)\n", ""),
    Mutant("8.5", "a refused request leaves the queue anyway",
           "        if blocks is None:\n            return False\n        self.loaded.discard(request.id)\n        self.waiting_queue.remove(request)\n",
           "        self.waiting_queue.remove(request)\n        if blocks is None:\n            return False\n        self.loaded.discard(request.id)\n"),
    Mutant("8.5", "the chunk is sized as if nothing were computed (it recomputes the loaded tokens)",
           "blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)",
           "blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens + request.num_computed_tokens)"),
    Mutant("8.5", "it is not put in the running set", "        self.active_pool[request.id] = request\n", ""),
]
# fmt: on
