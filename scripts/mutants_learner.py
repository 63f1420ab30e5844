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
    Mutant("0.1", "forgets the layers", "return 2 * spec.num_layers * spec.num_kv_heads",
           "return 2 * spec.num_kv_heads"),
    Mutant("0.1", "takes the head size as hidden size over KV heads", "* spec.head_dim *",
           "* (config.hidden_size // spec.num_kv_heads) *"),
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
           "        keys = gather_kv(key_cache, block_tables[b], seq_len).float().repeat_interleave(group, dim=1)  # [S, H, D]\n"
           "        values = gather_kv(value_cache, block_tables[b], seq_len).float().repeat_interleave(group, dim=1)\n"
           '        scores = torch.einsum("hd,shd->hs", query[b].float(), keys) * scale',
           "        keys = gather_kv(key_cache, block_tables[b], seq_len).repeat_interleave(group, dim=1)  # [S, H, D]\n"
           "        values = gather_kv(value_cache, block_tables[b], seq_len).repeat_interleave(group, dim=1)\n"
           '        scores = torch.einsum("hd,shd->hs", query[b], keys) * scale'),
    Mutant("5.2", "query head h reads KV head h % KVH, not h // (H // KVH)",
           "        keys = gather_kv(key_cache, block_tables[b], seq_len).float().repeat_interleave(group, dim=1)  # [S, H, D]\n"
           "        values = gather_kv(value_cache, block_tables[b], seq_len).float().repeat_interleave(group, dim=1)\n",
           "        keys = gather_kv(key_cache, block_tables[b], seq_len).float().repeat(1, group, 1)  # [S, H, D]\n"
           "        values = gather_kv(value_cache, block_tables[b], seq_len).float().repeat(1, group, 1)\n"),
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
           "    keys = gather_kv(key_cache, block_table, seq_len).float().repeat_interleave(group, dim=1)  # [S, H, D]\n"
           "    values = gather_kv(value_cache, block_table, seq_len).float().repeat_interleave(group, dim=1)\n"
           '    scores = torch.einsum("lhd,shd->hls", query.float(), keys) * scale',
           "    keys = gather_kv(key_cache, block_table, seq_len).repeat_interleave(group, dim=1)  # [S, H, D]\n"
           "    values = gather_kv(value_cache, block_table, seq_len).repeat_interleave(group, dim=1)\n"
           '    scores = torch.einsum("lhd,shd->hls", query, keys) * scale'),
    Mutant("5.3", "query head h reads KV head h % KVH, not h // (H // KVH)",
           "    keys = gather_kv(key_cache, block_table, seq_len).float().repeat_interleave(group, dim=1)  # [S, H, D]\n"
           "    values = gather_kv(value_cache, block_table, seq_len).float().repeat_interleave(group, dim=1)\n",
           "    keys = gather_kv(key_cache, block_table, seq_len).float().repeat(1, group, 1)  # [S, H, D]\n"
           "    values = gather_kv(value_cache, block_table, seq_len).float().repeat(1, group, 1)\n"),
    Mutant("5.3", "softmax over the queries, not the keys", 'float("-inf")), dim=-1)', 'float("-inf")), dim=1)'),
    # ---- 5.4 the Triton kernel ----
    Mutant("5.4", "the running max starts at 0.0, not -inf", '    m_i = float("-inf")\n', "    m_i = 0.0\n"),
    Mutant("5.4", "the loop bound rounds down (the last partial block is skipped)", "range(0, tl.cdiv(seq_len, BLOCK_SIZE))",
           "range(0, seq_len // BLOCK_SIZE)"),
    Mutant("5.4", "the running sum is not rescaled", "l_i = l_i * alpha + tl.sum(p, axis=0)", "l_i = l_i + tl.sum(p, axis=0)"),
    Mutant("5.4", "the running max is never updated", "        m_i = m_new\n", ""),
    Mutant("5.4", "masked scores count as 0, not -inf", 'tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))',
           "tl.sum(k * q[None, :], axis=1) * scale, 0.0)"),
    Mutant("5.4", "query head h reads KV head h % QUERIES_PER_KV, not h // QUERIES_PER_KV",
           "    kv_head = head // QUERIES_PER_KV\n", "    kv_head = head % QUERIES_PER_KV\n"),
    Mutant("5.4", "every query head reads the KV head of its own number (no grouping)",
           "    kv_head = head // QUERIES_PER_KV\n", "    kv_head = head\n"),
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
    # ---- issue 35: written from the contracts' text, and every bug of the issue's "What escaped" list ----
    Mutant("2.1", "is_decode from num_computed_tokens > 0 (a recompute after preemption says prefill)",
           "            is_decode=request.is_prefill_done(),", "            is_decode=request.num_computed_tokens > 0,"),
    Mutant("2.1", "samples_token only for decodes",
           "            samples_token=start + num_new_tokens == request.num_tokens,",
           "            samples_token=request.is_prefill_done(),"),
    Mutant("2.2", "(escaped) the first chunk is cut to the budget before the prefix hits are subtracted",
           "        num_new_tokens = min(request.num_tokens - num_computed, token_budget_left)",
           "        num_new_tokens = max(0, min(request.num_tokens, token_budget_left) - num_computed)"),
    Mutant("2.2", "(escaped) prefix-hit blocks listed among the blocks new this step",
           "        output.add(self._new_sequence(request, num_new_tokens), new_blocks.get_block_ids())",
           "        output.add(self._new_sequence(request, num_new_tokens), computed_blocks.get_block_ids() + new_blocks.get_block_ids())"),
    Mutant("2.2", "(escaped) leaves the queue before allocating, re-appended at the tail when allocation fails",
           "        new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens, num_computed, computed_blocks)\n"
           "        if new_blocks is None:\n            return False\n        self.waiting_queue.remove(request)\n",
           "        self.waiting_queue.remove(request)\n"
           "        new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens, num_computed, computed_blocks)\n"
           "        if new_blocks is None:\n            self.waiting_queue.append(request)\n            return False\n"),
    Mutant("2.2", "the hits are not counted as computed",
           "        request.num_computed_tokens = num_computed\n", ""),
    Mutant("2.3", "(escaped) a finished request released through the preemption path, then marked finished",
           "        request.status = RequestStatus.FINISHED\n        del self.active_pool[request.id]\n"
           "        self.kv_cache_manager.free(request)\n",
           "        self._preempt(request)\n        request.status = RequestStatus.FINISHED\n"),
    Mutant("2.3", "the blocks are not given back", "        self.kv_cache_manager.free(request)\n", ""),
    Mutant("2.4", "the prefill pass takes the NEWEST prefilling request",
           "        prefilling = next((r for r in self.active_pool.values() if self._is_prefilling(r)), None)",
           "        prefilling = next((r for r in reversed(self.active_pool.values()) if self._is_prefilling(r)), None)"),
    Mutant("2.4", "_has_room ignores max_batch_size",
           "        return self._budget_left(output) >= num_tokens and len(output) < self.max_batch_size",
           "        return self._budget_left(output) >= num_tokens"),
    Mutant("2.5", "(escaped) is_complete() asked only after a decode: max_new_tokens=1 yields 2 tokens",
           "            if request.is_complete():", "            if sequence.is_decode and request.is_complete():"),
    Mutant("2.5", "the returned list misses requests finished by their eos token",
           "            if request.is_complete():",
           "            if len(request.output_tokens) >= request.max_new_tokens:"),
    Mutant("2.6", "(escaped) the budget left computed once before the admission loop",
           "            while not output.preempted_req_ids and self.waiting_queue and self._has_room(output):\n"
           "                if len(self.active_pool) >= self.max_batch_size:\n                    break\n"
           "                if not self._admit(self.waiting_queue[0], self._budget_left(output), output):",
           "            budget = self._budget_left(output)\n"
           "            while not output.preempted_req_ids and self.waiting_queue and self._has_room(output):\n"
           "                if len(self.active_pool) >= self.max_batch_size:\n                    break\n"
           "                if not self._admit(self.waiting_queue[0], budget, output):"),
    Mutant("2.6", "admits after a preemption in the same step",
           "            while not output.preempted_req_ids and self.waiting_queue and self._has_room(output):",
           "            while self.waiting_queue and self._has_room(output):"),
    Mutant("2.7", "the victim is the oldest admission",
           "        victim = next(reversed(self.active_pool.values()))", "        victim = next(iter(self.active_pool.values()))"),
    Mutant("2.7", "the victim is the request with the most blocks",
           "        victim = next(reversed(self.active_pool.values()))",
           "        victim = max(reversed(self.active_pool.values()), key=lambda r: r.num_computed_tokens)"),
    Mutant("2.8", "gives up after one preemption",
           "            while new_blocks is None:\n                if self._preempt_victim(output) is request:\n"
           "                    return False  # it was the lowest priority itself: it waits, and the others keep going\n"
           "                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)\n",
           "            if self._preempt_victim(output) is request:\n                return False\n"
           "            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)\n"
           "            if new_blocks is None:\n                return False\n"),
    Mutant("2.8", "plans the request even when it was the victim",
           "                    return False  # it was the lowest priority itself: it waits, and the others keep going\n",
           "                    break\n"),
    Mutant("2.9", "(escaped) longest = num_tokens + max_new_tokens (generated tokens counted twice)",
           "        needed = blocks_needed(request.num_prompt_tokens + request.max_new_tokens, manager.block_size)",
           "        needed = blocks_needed(request.num_tokens + request.max_new_tokens, manager.block_size)"),
    Mutant("2.9", "a request that fits exactly is rejected", "        if needed <= manager.num_blocks:", "        if needed < manager.num_blocks:"),
    Mutant("3.1", "remove forgets to count the block out", "        self.num_free_blocks -= 1\n", ""),
    Mutant("3.2", "get_new_blocks hands blocks out from the back of the queue",
           "            block = self.free_block_queue.popleft()\n",
           "            block = self.free_block_queue.fake_tail.prev_free_block\n            self.free_block_queue.remove(block)\n"),
    Mutant("3.3", "(escaped) blocks published at num_computed_tokens + num_new_tokens, leaving out the hit tokens",
           "        self._cache_full_blocks(request, req_blocks, num_tokens)",
           "        self._cache_full_blocks(request, req_blocks, request.num_computed_tokens + num_new_tokens)"),
    Mutant("3.3", "(escaped) admission read as num_computed_tokens == 0",
           "        is_admission = request.id not in self.req_to_blocks", "        is_admission = request.num_computed_tokens == 0"),
    Mutant("3.3", "(escaped) admission read as 'the table is empty'",
           "        is_admission = request.id not in self.req_to_blocks", "        is_admission = not self.req_to_blocks.get(request.id)"),
    Mutant("3.4", "free gives the blocks back head first",
           "        self.block_pool.free_blocks(reversed(blocks))", "        self.block_pool.free_blocks(blocks)"),
    Mutant("3.4", "free keeps the table", "        blocks = self.req_to_blocks.pop(request.id, [])",
           "        blocks = list(self.req_to_blocks.get(request.id, []))"),
    Mutant("4.1", "(escaped) tokens encoded as 2-byte integers (ids >= 65,536 overflow)",
           "    payload = repr((parent_block_hash, [int(token) for token in token_ids])).encode()",
           "    payload = (parent_block_hash or b'') + b''.join(int(t).to_bytes(2, 'little') for t in token_ids)"),
    Mutant("4.1", "the parent is left out of the hash",
           "    payload = repr((parent_block_hash, [int(token) for token in token_ids])).encode()",
           "    payload = repr([int(token) for token in token_ids]).encode()"),
    Mutant("4.1", "the tokens are hashed as a set (order lost)",
           "    payload = repr((parent_block_hash, [int(token) for token in token_ids])).encode()",
           "    payload = repr((parent_block_hash, sorted(int(token) for token in token_ids))).encode()"),
    Mutant("4.2", "(escaped) blocks published up to the end of the table, ignoring num_tokens",
           "        num_full = min(num_tokens, request.num_tokens) // self.block_size",
           "        num_full = min(len(req_blocks) * self.block_size, request.num_tokens) // self.block_size"),
    Mutant("4.2", "the hash list is rebuilt on every call",
           "        hashes = self.req_to_block_hashes[request.id][1]\n",
           "        hashes = self.req_to_block_hashes[request.id][1]\n        hashes.clear()\n"),
    Mutant("4.3", "(escaped) the lookup limit taken from the prompt alone",
           "        num_lookup = (request.num_tokens - 1) // self.block_size",
           "        num_lookup = (request.num_prompt_tokens - 1) // self.block_size"),
    Mutant("4.3", "(escaped) the lookup re-hashes the request instead of using its stored chain",
           "enumerate(self._block_hashes(request)[:num_lookup])",
           "enumerate(hash_request_tokens(self.block_size, token_ids)[:num_lookup])"),
    Mutant("4.3", "the last token's block may hit", "        num_lookup = (request.num_tokens - 1) // self.block_size",
           "        num_lookup = request.num_tokens // self.block_size"),
    Mutant("4.4", "the hash stays in the map", "        del self.cached_block_hash_to_block[block.block_hash]\n", ""),
    Mutant("4.4", "the block keeps its hash", "        block.block_hash = None\n", ""),
    Mutant("4.5", "fork does not touch the parent's blocks", "        self.block_pool.touch(blocks)\n", ""),
    Mutant("4.5", "copy-on-write records (new, old)",
           "            self.pending_copies.append((src.block_id, dst.block_id))",
           "            self.pending_copies.append((dst.block_id, src.block_id))"),
    Mutant("4.6", "(escaped) the last written block computed as num_tokens // block_size",
           "        last = min(len(req_blocks), blocks_needed(num_tokens, self.block_size))",
           "        last = min(len(req_blocks), num_tokens // self.block_size + 1)"),
    Mutant("4.6", "the first written block is the one after first_write",
           "range(first_write // self.block_size, last)", "range(first_write // self.block_size + 1, last)"),
    Mutant("7.1", "equal keys go before those already there",
           "            if (other.priority, other.arrival_time) > key:", "            if (other.priority, other.arrival_time) >= key:"),
    Mutant("7.1", "the victim is the most urgent",
           "        victim = max(reversed(list(self.active_pool.values())), key=lambda r: (r.priority, r.arrival_time))",
           "        victim = min(reversed(list(self.active_pool.values())), key=lambda r: (r.priority, r.arrival_time))"),
    Mutant("7.2", "the watermark also applies when nothing runs", "        if not self.active_pool:\n            return True\n", ""),
    Mutant("7.2", "a partial block is not counted",
           "        needed = blocks_needed(num_new_tokens, manager.block_size)", "        needed = num_new_tokens // manager.block_size"),
    Mutant("7.3", "(escaped) swap space sized by tokens instead of blocks",
           "        cpu_blocks = blocks_needed(num_computed, manager.block_size)", "        cpu_blocks = num_computed"),
    Mutant("7.3", "a swap pays the latency once", "    return 2 * (costs.link_latency_s + num_tokens * costs.kv_bytes_per_token / costs.link_bytes_per_s)",
           "    return costs.link_latency_s + 2 * num_tokens * costs.kv_bytes_per_token / costs.link_bytes_per_s"),
    Mutant("7.4", "(escaped) an abort through _finish lists the request twice",
           "        request = self.active_pool.pop(request_id, None) or self._take_waiting(request_id)\n"
           "        if request is None:\n            return None\n        self.kv_cache_manager.free(request)\n",
           "        request = self.active_pool.get(request_id)\n        if request is not None:\n"
           "            self._finish(request)\n        else:\n            request = self._take_waiting(request_id)\n"
           "        if request is None:\n            return None\n        self.kv_cache_manager.free(request)\n"),
    Mutant("7.4", "(escaped) an abort through _preempt counts as a preemption",
           "        request = self.active_pool.pop(request_id, None) or self._take_waiting(request_id)\n",
           "        if request_id in self.active_pool:\n            self._preempt(self.active_pool[request_id])\n"
           "        request = self._take_waiting(request_id)\n"),
    Mutant("7.5", "(escaped) reset returns False when nothing was published",
           "        if self.get_num_free_blocks() < self.num_blocks:\n            return False\n",
           "        if self.get_num_free_blocks() < self.num_blocks or not self.cached_block_hash_to_block:\n            return False\n"),
    Mutant("0.1", "counts the keys only (no values)",
           "    return 2 * _num_layers(config) * _kv_width(config) * _bytes_per_element(dtype)",
           "    return _num_layers(config) * _kv_width(config) * _bytes_per_element(dtype)"),
    Mutant("0.1", "assumes 2 bytes per element whatever the dtype",
           "    return 2 * _num_layers(config) * _kv_width(config) * _bytes_per_element(dtype)",
           "    return 2 * _num_layers(config) * _kv_width(config) * 2"),
    Mutant("0.2", "(escaped) float division then int(): wrong above 2**53 bytes",
           "    return memory_bytes // (seq_len * bytes_per_token)", "    return int(memory_bytes / (seq_len * bytes_per_token))"),
    Mutant("0.2", "a partial sequence counts as one", "    return memory_bytes // (seq_len * bytes_per_token)",
           "    return -(-memory_bytes // (seq_len * bytes_per_token))"),
    Mutant("1.1", "(escaped) execute and update called inside the schedule phase",
           "    with core.phase(\"schedule\"):\n        scheduler_output = core.scheduler.schedule_next_batch()\n"
           "    if not scheduler_output:\n        raise Deadlock(describe_stall(core.scheduler, core.iteration))\n"
           "    with core.phase(\"execute\", scheduler_output):\n        sampled_token_ids = core.executor.execute(scheduler_output)\n"
           "    with core.phase(\"update\", scheduler_output):\n",
           "    with core.phase(\"schedule\"):\n        scheduler_output = core.scheduler.schedule_next_batch()\n"
           "        if not scheduler_output:\n            raise Deadlock(describe_stall(core.scheduler, core.iteration))\n"
           "        sampled_token_ids = core.executor.execute(scheduler_output)\n"),
    Mutant("1.1", "(escaped) deadlock raised only while requests are unfinished: an idle engine steps empty plans",
           "    if not scheduler_output:\n", "    if not scheduler_output and core.scheduler.has_unfinished_requests():\n"),
    Mutant("1.1", "the step returns nothing instead of the finished requests",
           "        return core.scheduler.update_from_output(scheduler_output, sampled_token_ids)",
           "        core.scheduler.update_from_output(scheduler_output, sampled_token_ids)\n        return []"),
    Mutant("5.1", "(escaped) the cache cloned and .data rebound instead of written in place",
           "    key_cache.view(-1, *key_cache.shape[2:])[slots] = key.to(key_cache.dtype)\n",
           "    flat = key_cache.reshape(-1, *key_cache.shape[2:]).clone()\n    flat[slots] = key.to(key_cache.dtype)\n"
           "    key_cache.data = flat.view(key_cache.shape)\n"),
    Mutant("5.1", "the values are written into the key cache too",
           "    value_cache.view(-1, *value_cache.shape[2:])[slots] = value.to(value_cache.dtype)",
           "    key_cache.view(-1, *key_cache.shape[2:])[slots] = value.to(key_cache.dtype)"),
    Mutant("5.2", "a softmax without the running max (exp overflows past ~88 in float32)",
           "        weights = torch.softmax(scores, dim=-1)\n        out[b]",
           "        weights = scores.exp() / scores.exp().sum(dim=-1, keepdim=True)\n        out[b]"),
    Mutant("5.2", "the scale hard-coded to 1/sqrt(D)",
           "        scores = torch.einsum(\"hd,shd->hs\", query[b].float(), keys) * scale",
           "        scores = torch.einsum(\"hd,shd->hs\", query[b].float(), keys) * query.shape[-1] ** -0.5"),
    Mutant("5.2", "no float32 upcast (fp16 scores overflow past 65,504)",
           "        keys = gather_kv(key_cache, block_tables[b], seq_len).float()  # [S, H, D]\n"
           "        values = gather_kv(value_cache, block_tables[b], seq_len).float()  # [S, H, D]\n"
           "        scores = torch.einsum(\"hd,shd->hs\", query[b].float(), keys) * scale\n",
           "        keys = gather_kv(key_cache, block_tables[b], seq_len)\n"
           "        values = gather_kv(value_cache, block_tables[b], seq_len)\n"
           "        scores = torch.einsum(\"hd,shd->hs\", query[b], keys) * scale\n"),
    Mutant("5.3", "(escaped) the scale ignored (1/sqrt(D) hard-coded)",
           "    scores = torch.einsum(\"lhd,shd->hls\", query.float(), keys) * scale",
           "    scores = torch.einsum(\"lhd,shd->hls\", query.float(), keys) * query.shape[-1] ** -0.5"),
    Mutant("5.3", "the chunk's queries sit at positions 0 .. L-1 (the cached prefix forgotten)",
           "    query_pos = torch.arange(seq_len - chunk_len, seq_len, device=query.device)",
           "    query_pos = torch.arange(chunk_len, device=query.device)"),
    Mutant("5.5", "(escaped) block ids in int32 (slots past 2**31 wrap around)",
           "    slot_mapping = table[seq_of_token, positions // block_size] * block_size + positions % block_size",
           "    slot_mapping = (table[seq_of_token, positions // block_size].int() * block_size + positions % block_size).int()"),
    Mutant("5.5", "positions start at 0, not at position_ids_start",
           "    positions = starts[seq_of_token] + offset_in_chunk", "    positions = offset_in_chunk"),
]
# fmt: on
