"""Mutation check: every exercise's graded tests must catch realistic bugs in that exercise's own code.

Each mutant is one small edit to a reference region in solutions/ (a bug a learner could plausibly
write). It is applied to a temporary copy of the checkout, never to the working tree; then only that
exercise's graded tests run there (pytest -m exN_M) against the mutated reference. A mutant that
passes its own exercise's tests "survives": the tests have a gap. The table lists every mutant;
the exit status is 1 if any survives, if a mutant no longer matches its region (the reference
moved: update the pattern), or if the unmutated copy fails its own tests.

    python scripts/mutation_check.py              # all mutants, two at a time
    python scripts/mutation_check.py --only 3.3   # one exercise's mutants
    python scripts/mutation_check.py --list       # the mutants, without running them
    python scripts/mutation_check.py --cold       # each mutant in a fresh Python (slow; to compare verdicts)

By default one warmed-up process imports what no mutant changes (torch, transformers, pytest, hypothesis,
triton) once, then forks a child per mutant that forgets every module of the checkout, enters the mutant's
copy and runs pytest.main with the same arguments and environment as `python -m pytest` there (--cold).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvcourse.course.exercises import EXERCISES  # noqa: E402
from kvcourse.course.stubs import BEGIN_MARK, END_MARK  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
from mutants_learner import LEARNER_MUTANTS, Mutant  # noqa: E402  (the mutants written from the contracts)

# Plugins a graded test never needs: nbval alone imports jsonschema for a second per run (measured: 3.2 s -> 1.2 s).
PYTEST_QUIET = ("-p", "no:randomly", "-p", "no:nbval", "-p", "no:anyio", "-p", "no:cacheprovider")
PYTEST_QUIET += ("-o", "addopts=--strict-markers")
COPIED = ("kvcourse", "solutions", "tests", "conftest.py", "pyproject.toml", "notebooks/sanitize.cfg")
TEST_ENV = {
    "KVCOURSE_SOLUTIONS": "1",
    "HF_HUB_OFFLINE": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
    # the lockstep harness's reference: this checkout's clean solutions/, never the mutated copy under test
    "KVCOURSE_REFERENCE_DIR": str(ROOT / "solutions"),
}
MUTANT_TIMEOUT, BASELINE_TIMEOUT = 600, 900  # seconds
# The warm runner imports these once; none is part of the checkout, so no mutant can change them.
WARM_IMPORTS = ("numpy", "torch", "pytest", "hypothesis", "hypothesis.stateful", "hypothesis.strategies",
                "triton", "triton.language", "transformers", "transformers.cache_utils", "transformers.pytorch_utils")  # fmt: skip
WARM_TRANSFORMERS = ("GPT2Config", "GPT2LMHeadModel", "GPT2TokenizerFast", "LlamaConfig", "AttentionInterface")
# Top-level names of the checkout's modules (tests/exercises' helpers are imported by their bare names).
PROJECT_MODULES = {"kvcourse", "solutions", "tests", "conftest", "mutants_learner", "invariants", "toy_world",
                   "contract_clauses"}  # fmt: skip


# fmt: off
MUTANTS = [
    # ---- 0.x memory arithmetic ----
    Mutant("0.1", "counts keys only, not values", "return 2 * spec.num_layers", "return spec.num_layers"),
    Mutant("0.1", "caches every query head (ignores grouped-query attention)",
           "* spec.num_kv_heads * spec.head_dim *", "* spec.num_heads * spec.head_dim *"),
    Mutant("0.1", "uses the hidden size (the multi-head formula)",
           "* spec.num_kv_heads * spec.head_dim *", "* config.hidden_size *"),
    Mutant("0.2", "rounds a partial sequence up", "memory_bytes // (seq_len * bytes_per_token)",
           "-(-memory_bytes // (seq_len * bytes_per_token))"),
    Mutant("0.2", "rounds to the nearest sequence", "memory_bytes // (seq_len * bytes_per_token)",
           "round(memory_bytes / (seq_len * bytes_per_token))"),
    # ---- 1.1 the engine's step (solutions/step.py) ----
    Mutant("1.1", "plans outside the schedule phase",
           '    with core.phase("schedule"):\n        scheduler_output = core.scheduler.schedule_next_batch()\n',
           "    scheduler_output = core.scheduler.schedule_next_batch()\n"),
    Mutant("1.1", "lets an empty plan through (loops forever on a stall)",
           "    if not scheduler_output:\n        raise Deadlock(describe_stall(core.scheduler, core.iteration))\n", ""),
    Mutant("1.1", "runs the plan outside the execute phase",
           '    with core.phase("execute", scheduler_output):\n        sampled_token_ids = core.executor.execute(scheduler_output)\n',
           "    sampled_token_ids = core.executor.execute(scheduler_output)\n"),
    Mutant("1.1", "updates outside the update phase",
           '    with core.phase("update", scheduler_output):\n        return core.scheduler.update_from_output(',
           "    if True:\n        return core.scheduler.update_from_output("),
    Mutant("1.1", "drops the finished requests", "        return core.scheduler.update_from_output(",
           "        core.scheduler.update_from_output("),
    Mutant("1.1", "hands the update no tokens", "update_from_output(scheduler_output, sampled_token_ids)",
           "update_from_output(scheduler_output, {})"),
    # ---- 2.x the scheduler (patterns follow solutions/scheduler.py's regions) ----
    Mutant("2.1", "every chunk samples a token", "samples_token=start + num_new_tokens == request.num_tokens,",
           "samples_token=True,"),
    Mutant("2.1", "positions start after the chunk", "position_ids_start=start,",
           "position_ids_start=start + num_new_tokens,"),
    Mutant("2.1", "a chunk is never a decode", "is_decode=request.is_prefill_done(),", "is_decode=False,"),
    Mutant("2.1", "feeds the prompt only (a recompute loses the outputs)",
           "tokens=request.all_token_ids[start : start + num_new_tokens],",
           "tokens=request.prompt_tokens[start : start + num_new_tokens],"),
    Mutant("2.1", "the plan forgets the new blocks",
           "output.add(self._new_sequence(request, num_new_tokens), new_blocks.get_block_ids())\n        return True",
           "output.add(self._new_sequence(request, num_new_tokens))\n        return True"),
    Mutant("2.2", "a chunk ignores the token budget",
           "num_new_tokens = min(request.num_tokens - num_computed, token_budget_left)",
           "num_new_tokens = request.num_tokens - num_computed"),
    Mutant("2.2", "an admitted request stays WAITING", "        request.status = RequestStatus.RUNNING\n", ""),
    Mutant("2.2", "admission ignores the prefix-cache hits", "        request.num_computed_tokens = num_computed\n",
           "        request.num_computed_tokens = 0\n"),
    Mutant("2.2", "admission advances the plan itself (counted twice)", "        request.num_computed_tokens = num_computed\n",
           "        request.num_computed_tokens = num_computed + num_new_tokens\n"),
    Mutant("2.3", "a finished request keeps its blocks", "        self.kv_cache_manager.free(request)\n", ""),
    Mutant("2.3", "a finished request stays RUNNING", "        request.status = RequestStatus.FINISHED\n", ""),
    Mutant("2.4", "the budget ignores what is already planned",
           "return self.token_budget - output.total_num_scheduled_tokens", "return self.token_budget"),
    Mutant("2.4", "the batch-size limit is ignored",
           "return self._budget_left(output) >= num_tokens and len(output) < self.max_batch_size",
           "return self._budget_left(output) >= num_tokens"),
    Mutant("2.4", "every prefilling request gets a chunk",
           "        prefilling = next((r for r in self.active_pool.values() if self._is_prefilling(r)), None)\n"
           "        if prefilling is not None and self._has_room(output):\n",
           "        for prefilling in [r for r in self.active_pool.values() if self._is_prefilling(r)]:\n"
           "            if not self._has_room(output):\n                continue\n"),
    Mutant("2.4", "the prefill chunk ignores the budget left",
           "num_new_tokens = min(prefilling.num_uncomputed_tokens, self._budget_left(output))",
           "num_new_tokens = prefilling.num_uncomputed_tokens"),
    Mutant("2.4", "decodes a request that is still prefilling",
           "if request.id in self.active_pool and request.is_prefill_done() and self._has_room(output):",
           "if request.id in self.active_pool and self._has_room(output):"),
    Mutant("2.5", "a complete request is never finished",
           "                self._finish(request)\n                finished.append(request)\n",
           "                finished.append(request)\n"),
    Mutant("2.5", "a mid-prompt chunk gets a token",
           "            if not sequence.samples_token:\n                continue  # a prefill chunk that does not reach the end samples nothing\n", ""),
    Mutant("2.6", "admits in a step that preempted",
           "while not output.preempted_req_ids and self.waiting_queue and self._has_room(output):",
           "while self.waiting_queue and self._has_room(output):"),
    Mutant("2.6", "admission ignores max_batch_size",
           "                if len(self.active_pool) >= self.max_batch_size:\n                    break\n", ""),
    Mutant("2.6", "skips past a head that does not fit (starves it)",
           "                if not self._admit(self.waiting_queue[0], self._budget_left(output), output):\n"
           "                    break  # the head waits, and everyone behind it waits too\n",
           "                if not any(self._admit(r, self._budget_left(output), output) for r in list(self.waiting_queue)):\n"
           "                    break\n"),
    Mutant("2.7", "preempts the oldest", "victim = next(reversed(self.active_pool.values()))",
           "victim = next(iter(self.active_pool.values()))"),
    Mutant("2.8", "gives up after one preemption",
           "                if self._preempt_victim(output) is request:\n"
           "                    return False  # it was the lowest priority itself: it waits, and the others keep going\n"
           "                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)\n",
           "                self._preempt_victim(output)\n"
           "                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)\n"
           "                if new_blocks is None:\n                    return False\n"),
    Mutant("2.8", "carries on after preempting itself",
           "                if self._preempt_victim(output) is request:\n"
           "                    return False  # it was the lowest priority itself: it waits, and the others keep going\n",
           "                if self._preempt_victim(output) is request and not self.active_pool:\n                    return False\n"),
    Mutant("2.9", "rounds the blocks needed down",
           "needed = blocks_needed(request.num_prompt_tokens + request.max_new_tokens, manager.block_size)",
           "needed = (request.num_prompt_tokens + request.max_new_tokens) // manager.block_size"),
    Mutant("2.9", "forgets max_new_tokens",
           "needed = blocks_needed(request.num_prompt_tokens + request.max_new_tokens, manager.block_size)",
           "needed = blocks_needed(request.num_prompt_tokens, manager.block_size)"),
    Mutant("2.9", "rejects a request that exactly fits", "if needed <= manager.num_blocks:", "if needed < manager.num_blocks:"),
    # ---- 1.x/2.x: the independent examiner's survivors, then more written from the contracts (issue 24) ----
    Mutant("1.1", "plans twice (the first plan is lost)",
           "        scheduler_output = core.scheduler.schedule_next_batch()\n",
           "        core.scheduler.schedule_next_batch()\n        scheduler_output = core.scheduler.schedule_next_batch()\n"),
    Mutant("1.1", "the Deadlock describes the next iteration", "describe_stall(core.scheduler, core.iteration)",
           "describe_stall(core.scheduler, core.iteration + 1)"),
    Mutant("1.1", "returns every request finished so far",
           "        return core.scheduler.update_from_output(scheduler_output, sampled_token_ids)\n",
           "        core.scheduler.update_from_output(scheduler_output, sampled_token_ids)\n"
           "        return list(core.scheduler.finished)\n"),
    Mutant("2.1", "samples once the prompt is covered (wrong after a recompute with outputs)",
           "samples_token=start + num_new_tokens == request.num_tokens,",
           "samples_token=start + num_new_tokens >= request.num_prompt_tokens,"),
    Mutant("2.1", "a one-token chunk is called a decode", "is_decode=request.is_prefill_done(),",
           "is_decode=num_new_tokens == 1,"),
    Mutant("2.1", "the plan lists the whole block table, not the new blocks",
           "new_blocks.get_block_ids())\n        return True",
           "self.kv_cache_manager.get_block_ids(request))\n        return True"),
    Mutant("2.2", "RUNNING before the None check (a failed admission changes the status)",
           "        if new_blocks is None:\n            return False\n        self.waiting_queue.remove(request)\n"
           "        request.status = RequestStatus.RUNNING\n",
           "        request.status = RequestStatus.RUNNING\n        if new_blocks is None:\n            return False\n"
           "        self.waiting_queue.remove(request)\n"),
    Mutant("2.2", "a re-admitted request's first chunk covers its prompt only",
           "num_new_tokens = min(request.num_tokens - num_computed, token_budget_left)",
           "num_new_tokens = min(request.num_prompt_tokens - num_computed, token_budget_left)"),
    Mutant("2.2", "takes the head out of the queue, not the admitted request", "        self.waiting_queue.remove(request)\n",
           "        self.waiting_queue.popleft()\n"),
    Mutant("2.3", "gives the blocks back twice", "        self.kv_cache_manager.free(request)\n",
           "        self.kv_cache_manager.free(request)\n        self.kv_cache_manager.free(request)\n"),
    Mutant("2.3", "a finished request stays in the running set", "        del self.active_pool[request.id]\n", ""),
    Mutant("2.4", "iterates the live running set (preemption changes it mid-loop)",
           "for request in list(self.active_pool.values()):", "for request in self.active_pool.values():"),
    Mutant("2.4", "a request preempted a moment ago still gets a decode",
           "if request.id in self.active_pool and request.is_prefill_done()", "if request.is_prefill_done()"),
    Mutant("2.4", "the budget counts sequences, not tokens",
           "return self.token_budget - output.total_num_scheduled_tokens", "return self.token_budget - len(output)"),
    Mutant("2.4", "prefilling means inside the prompt (a recompute with outputs is never continued)",
           "return not request.is_prefill_done() and request.num_uncomputed_tokens > 0",
           "return request.num_computed_tokens < request.num_prompt_tokens"),
    Mutant("2.4", "prefilling ignores the tokens left to feed",
           "return not request.is_prefill_done() and request.num_uncomputed_tokens > 0",
           "return not request.is_prefill_done()"),
    Mutant("2.4", "decodes go by request id, not admission order",
           "for request in list(self.active_pool.values()):",
           "for request in sorted(self.active_pool.values(), key=lambda r: r.id):"),
    Mutant("2.4", "the prefill in progress is the lowest id, not the oldest admission",
           "prefilling = next((r for r in self.active_pool.values() if self._is_prefilling(r)), None)",
           "prefilling = min((r for r in self.active_pool.values() if self._is_prefilling(r)), key=lambda r: r.id, "
           "default=None)"),
    Mutant("2.4", "room needs one token more than asked", "return self._budget_left(output) >= num_tokens and",
           "return self._budget_left(output) > num_tokens and"),
    Mutant("2.5", "the token is appended as given, not as an int",
           "request.output_tokens.append(int(sampled_token_ids[sequence.request_id]))",
           "request.output_tokens.append(sampled_token_ids[sequence.request_id])"),
    Mutant("2.5", "only a decode takes its token (the last prefill chunk's is dropped)",
           "if not sequence.samples_token:", "if not sequence.is_decode:"),
    Mutant("2.5", "takes whatever token came, samples_token or not",
           "            if not sequence.samples_token:\n                continue  # a prefill chunk that does not reach the end samples nothing\n",
           "            if sequence.request_id not in sampled_token_ids:\n                continue\n"),
    Mutant("2.5", "returns the finished requests by id", "        return finished\n",
           "        return sorted(finished, key=lambda r: r.id)\n"),
    Mutant("2.6", "an admission gets the whole budget, not what is left",
           "if not self._admit(self.waiting_queue[0], self._budget_left(output), output):",
           "if not self._admit(self.waiting_queue[0], self.token_budget, output):"),
    Mutant("2.7", "the victim is the highest request id", "victim = next(reversed(self.active_pool.values()))",
           "victim = max(self.active_pool.values(), key=lambda r: r.id)"),
    Mutant("2.7", "the victim is the request holding the most tokens", "victim = next(reversed(self.active_pool.values()))",
           "victim = max(self.active_pool.values(), key=lambda r: r.num_tokens)"),
    Mutant("2.8", "preempts one victim too many",
           "                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)\n",
           "                if self._preempt_victim(output) is request:\n                    return False\n"
           "                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)\n"),
    Mutant("2.9", "the reason gives no numbers",
           'f"it needs {needed} blocks for its prompt and max_new_tokens, "\n'
           '            f"but the whole cache has only {manager.num_blocks}"',
           '"it needs more blocks than the cache has"'),
    Mutant("2.9", "a rejected request is not listed", "        self.rejected.append(request)\n", ""),
    Mutant("2.2", "forgets the cached prefix blocks", "allocate_slots(request, num_new_tokens, num_computed, computed_blocks)",
           "allocate_slots(request, num_new_tokens, num_computed)"),
    Mutant("2.4", "chooses the prefill before the decodes (a request preempted a moment ago still gets a chunk)",
           "        for request in list(self.active_pool.values()):\n"
           "            if request.id in self.active_pool and request.is_prefill_done() and self._has_room(output):\n"
           "                self._schedule_running(request, 1, output)\n"
           "        prefilling = next((r for r in self.active_pool.values() if self._is_prefilling(r)), None)\n",
           "        prefilling = next((r for r in self.active_pool.values() if self._is_prefilling(r)), None)\n"
           "        for request in list(self.active_pool.values()):\n"
           "            if request.id in self.active_pool and request.is_prefill_done() and self._has_room(output):\n"
           "                self._schedule_running(request, 1, output)\n"),
    Mutant("2.4", "the batch size counts the running set, not the plan", "len(output) < self.max_batch_size",
           "len(self.active_pool) < self.max_batch_size"),
    Mutant("2.4", "the prefill is planned without room", "if prefilling is not None and self._has_room(output):",
           "if prefilling is not None:"),
    Mutant("2.5", "returns every request finished so far", "        return finished\n", "        return self.finished\n"),
    Mutant("2.6", "admits nobody ever again after a preemption",
           "while not output.preempted_req_ids and self.waiting_queue", "while not self.num_preemptions and self.waiting_queue"),
    Mutant("2.6", "admits without room in the plan",
           "while not output.preempted_req_ids and self.waiting_queue and self._has_room(output):",
           "while not output.preempted_req_ids and self.waiting_queue:"),
    Mutant("2.7", "the victim is the latest arrival", "victim = next(reversed(self.active_pool.values()))",
           "victim = max(reversed(list(self.active_pool.values())), key=lambda r: r.arrival_time)"),
    # ---- 3.x the allocator ----
    Mutant("3.1", "remove forgets to clear the block's pointers",
           "        block.prev_free_block = None\n        block.next_free_block = None\n", ""),
    Mutant("3.1", "append forgets the tail sentinel's back pointer",
           "        self.fake_tail.prev_free_block = block\n", ""),
    Mutant("3.1", "remove forgets to count the block out", "        self.num_free_blocks -= 1\n", ""),
    Mutant("3.2", "handing out a block keeps its stale hash", "            self._maybe_evict_cached_block(block)\n", ""),
    Mutant("3.2", "a freed block is queued while another request still holds it",
           "if block.ref_cnt == 0:\n                self.free_block_queue.append", "if block.ref_cnt <= 1:\n                self.free_block_queue.append"),
    Mutant("3.2", "touch leaves a free block in the free queue",
           "            if block.ref_cnt == 0:\n                self.free_block_queue.remove(block)\n", ""),
    Mutant("3.3", "a hit on a free block is not counted against the free blocks",
           "num_extra = len(to_copy) + sum(1 for block in hits if block.ref_cnt == 0)", "num_extra = len(to_copy)"),
    Mutant("3.3", "rounds the blocks needed down", "blocks_needed(num_tokens, self.block_size)",
           "num_tokens // self.block_size"),
    Mutant("3.3", "forgets the prefix-hit tokens when sizing the table",
           "first_write = request.num_computed_tokens + num_new_computed_tokens",
           "first_write = request.num_computed_tokens"),
    Mutant("3.4", "frees the head first", "self.block_pool.free_blocks(reversed(blocks))",
           "self.block_pool.free_blocks(blocks)"),
    Mutant("3.4", "keeps the freed table (a second free double-frees)", "self.req_to_blocks.pop(request.id, [])",
           "self.req_to_blocks.get(request.id, [])"),
    # ---- 4.x sharing ----
    Mutant("4.1", "uses Python's per-process hash()", "HASH_FUNCTION(payload).digest()", "hash(payload)"),
    Mutant("4.1", "ignores the parent block", "repr((parent_block_hash, [int(token) for token in token_ids]))",
           "repr([int(token) for token in token_ids])"),
    Mutant("4.1", "chains every block to None", "parent = hashes[-1] if hashes else None", "parent = None"),
    Mutant("4.3", "trusts the hash without checking the tokens",
           "if block is None or block.token_ids != tuple(token_ids):", "if block is None:"),
    Mutant("4.3", "skips a miss instead of stopping", "            if block is None:\n                break",
           "            if block is None:\n                continue"),
    Mutant("4.3", "lets the last token's block hit", "num_lookup = (request.num_tokens - 1) // self.block_size",
           "num_lookup = request.num_tokens // self.block_size"),
    Mutant("4.2", "rehashes the whole request on every call",
           "        token_ids = request.all_token_ids\n        while",
           "        token_ids = request.all_token_ids\n        hashes.clear()\n        while"),
    Mutant("4.2", "publishes a partly filled block",
           "num_full = min(num_tokens, request.num_tokens) // self.block_size",
           "num_full = -(-min(num_tokens, request.num_tokens) // self.block_size)"),
    Mutant("4.2", "a second block takes over a prefix already served",
           "if block.block_hash is not None or block_hash in self.cached_block_hash_to_block:",
           "if block.block_hash is not None:"),
    Mutant("4.2", "chains new blocks to the first block", "parent = hashes[-1] if hashes else None",
           "parent = hashes[0] if hashes else None"),
    Mutant("4.4", "forgets the hash-map entry", "        del self.cached_block_hash_to_block[block.block_hash]\n", ""),
    Mutant("4.4", "keeps the block's old hash", "        block.block_hash = None\n", ""),
    Mutant("4.5", "the child's table is the parent's list", "self.req_to_blocks[child.id] = list(blocks)",
           "self.req_to_blocks[child.id] = blocks"),
    Mutant("4.5", "the child shares the parent's hash list",
           "(child, list(self.req_to_block_hashes[parent.id][1]))", "(child, self.req_to_block_hashes[parent.id][1])"),
    Mutant("4.5", "fork adds no holder", "        self.block_pool.touch(blocks)\n", ""),
    Mutant("4.5", "the copied block keeps this holder", "            self.block_pool.free_blocks([src])\n", ""),
    Mutant("4.6", "copies shared blocks before the write too", "range(first_write // self.block_size, last)",
           "range(0, last)"),
    Mutant("4.6", "misses the partial block the write lands in",
           "last = min(len(req_blocks), blocks_needed(num_tokens, self.block_size))",
           "last = min(len(req_blocks), num_tokens // self.block_size)"),
    Mutant("4.6", "copies blocks nobody else holds", "if req_blocks[i].ref_cnt > 1]", "if req_blocks[i].ref_cnt >= 1]"),
    # ---- 5.1-5.3 paged attention ----
    Mutant("5.1", "writes the keys into the value cache", "value_cache.view(-1, *value_cache.shape[2:])[slots] = value.to(",
           "value_cache.view(-1, *value_cache.shape[2:])[slots] = key.to("),
    Mutant("5.1", "writes into a copy of the cache", "key_cache.view(-1, *key_cache.shape[2:])[slots] =",
           "key_cache.clone().view(-1, *key_cache.shape[2:])[slots] ="),
    Mutant("5.2", "keeps the padding of the last block", "return blocks.reshape(-1, *cache.shape[2:])[:seq_len]",
           "return blocks.reshape(-1, *cache.shape[2:])"),
    Mutant("5.2", "forgets the scale", 'torch.einsum("hd,shd->hs", query[b].float(), keys) * scale',
           'torch.einsum("hd,shd->hs", query[b].float(), keys)'),
    Mutant("5.2", "softmax over the heads", "weights = torch.softmax(scores, dim=-1)\n        out[b]",
           "weights = torch.softmax(scores, dim=0)\n        out[b]"),
    Mutant("5.3", "a query may not see itself", "future = key_pos[None, :] > query_pos[:, None]",
           "future = key_pos[None, :] >= query_pos[:, None]"),
    Mutant("5.3", "chunk positions start at 0", "torch.arange(seq_len - chunk_len, seq_len, device=query.device)",
           "torch.arange(0, chunk_len, device=query.device)"),
    # ---- 5.4 the Triton kernel, 5.5 the model runner ----
    Mutant("5.4", "forgets to rescale the running sum", "acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)",
           "acc = acc + tl.sum(p[:, None] * v, axis=0)"),
    Mutant("5.4", "forgets the scale", "tl.sum(k * q[None, :], axis=1) * scale", "tl.sum(k * q[None, :], axis=1)"),
    Mutant("5.4", "reads past seq_len", "t_mask = (offs_t < BLOCK_SIZE) & (i * BLOCK_SIZE + offs_t < seq_len)",
           "t_mask = offs_t < BLOCK_SIZE"),
    Mutant("5.5", "positions restart at 0 in every chunk", "positions = starts[seq_of_token] + offset_in_chunk",
           "positions = offset_in_chunk"),
    Mutant("5.5", "seq_lens leave out this step's tokens", "seq_lens = starts + num_tokens", "seq_lens = starts"),
    Mutant("5.5", "every token lands at offset 0", "* block_size + positions % block_size", "* block_size"),
    # ---- 7.x serving policies ----
    Mutant("7.1", "a newcomer jumps ahead of its equals", "if (other.priority, other.arrival_time) > key:",
           "if (other.priority, other.arrival_time) >= key:"),
    Mutant("7.1", "preempts the most important request", "victim = max(reversed(list(self.active_pool.values()))",
           "victim = min(reversed(list(self.active_pool.values()))"),
    Mutant("7.2", "the watermark ignores this step's blocks",
           "return manager.get_num_free_blocks() - needed >= self.watermark_blocks",
           "return manager.get_num_free_blocks() >= self.watermark_blocks"),
    Mutant("7.2", "an idle engine obeys the watermark too", "        if not self.active_pool:\n            return True\n", ""),
    Mutant("7.3", "a swap moves the cache one way only", "return 2 * (costs.link_latency_s", "return (costs.link_latency_s"),
    Mutant("7.3", "the crossover compares the wrong way", "if swap_seconds(n, costs) < recompute_seconds(n, costs):",
           "if swap_seconds(n, costs) > recompute_seconds(n, costs):"),
    Mutant("7.4", "an abort keeps the blocks",
           "        self.kv_cache_manager.free(request)\n        request.status, request.reason = status, reason",
           "        request.status, request.reason = status, reason"),
    Mutant("7.4", "only running requests can be aborted",
           "request = self.active_pool.pop(request_id, None) or self._take_waiting(request_id)",
           "request = self.active_pool.pop(request_id, None)"),
    Mutant("7.5", "resets while blocks are held", "        if self.get_num_free_blocks() < self.num_blocks:\n            return False\n", ""),
    Mutant("7.5", "keeps the hash map", "        self.cached_block_hash_to_block.clear()\n", ""),
    # ---- 4.7 eviction policies (solutions/eviction.py; helper E's block) ----
    Mutant("4.7", "hands out a block a hit revived", "if block.ref_cnt == 0 and self.freed_at[block_id] == tick:",
           "if self.freed_at[block_id] == tick:"),
    Mutant("4.7", "ranks a block by its first free, not its last", "if block.ref_cnt == 0 and self.freed_at[block_id] == tick:",
           "if block.ref_cnt == 0:"),
    Mutant("4.7", "takes the heap's last entry, not its smallest", "_, tick, block_id = heapq.heappop(self.free_heap)",
           "_, tick, block_id = self.free_heap.pop()"),
    Mutant("4.7", "FIFO lets a hit buy time (LRU)", "return (self.cached_at[block.block_id], self.freed_at[block.block_id])",
           "return (self.freed_at[block.block_id],)"),
    Mutant("4.7", "FIFO evicts the newest first", "return (self.cached_at[block.block_id],",
           "return (-self.cached_at[block.block_id],"),
    Mutant("4.7", "FIFO ties go to the most recently freed", "self.cached_at[block.block_id], self.freed_at",
           "self.cached_at[block.block_id], -self.freed_at"),
    Mutant("4.7", "LFU evicts the most shared first", "self.num_shares[block.block_id], self.freed_at",
           "-self.num_shares[block.block_id], self.freed_at"),
    Mutant("4.7", "LFU evicts cached blocks before empty ones", "(block.block_hash is not None,", "(block.block_hash is None,"),
    Mutant("4.7", "LFU ties go to the most recently freed", "self.num_shares[block.block_id], self.freed_at",
           "self.num_shares[block.block_id], -self.freed_at"),
    # ---- end of 4.7 ----
]
# fmt: on
ALL_MUTANTS = MUTANTS + LEARNER_MUTANTS  # the maintainers' own, then those written from the contracts


def regions(source: str, exercise_id: str) -> list[tuple[int, int]]:
    """(start, end) character spans of the exercise's BEGIN/END regions in a solution file."""
    pattern = re.compile(
        rf"^[ \t]*{re.escape(BEGIN_MARK)} {re.escape(exercise_id)}[ \t]*\n(.*?)^[ \t]*{END_MARK}", re.S | re.M
    )
    return [match.span(1) for match in pattern.finditer(source)]


def apply(mutant: Mutant, source: str) -> str:
    """The source with the mutant applied inside its exercise's regions (ValueError if it does not match once)."""
    spans = regions(source, mutant.exercise)
    hits = [(start, end, source[start:end].count(mutant.old)) for start, end in spans]
    total = sum(count for _, _, count in hits)
    if total != 1:
        raise ValueError(
            f"pattern found {total} times in the regions of {mutant.exercise} (expected once): {mutant.old!r}"
        )
    start, end, _ = next(hit for hit in hits if hit[2])
    return source[:start] + source[start:end].replace(mutant.old, mutant.new) + source[end:]


def test_file(exercise_id: str) -> str:
    """The graded test file of an exercise's notebook that marks it (tests/exercises/test_ex<major>_*.py)."""
    major, marker = exercise_id.split(".")[0], re.compile(rf"\b{EXERCISES[exercise_id].marker}\b")
    (path,) = [p for p in (ROOT / "tests" / "exercises").glob(f"test_ex{major}_*.py") if marker.search(p.read_text())]
    return str(path.relative_to(ROOT))


def copy_checkout(dest: Path) -> None:
    """A private copy of what the graded tests import (the working tree is never edited)."""
    for name in COPIED:
        src, dst = ROOT / name, dest / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, dst)


def pytest_args(exercise_id: str) -> list[str]:
    """The pytest arguments of one exercise's graded tests, the same for the cold and the warm runner."""
    return ["-q", "-x", *PYTEST_QUIET, "-m", EXERCISES[exercise_id].marker, test_file(exercise_id)]


def baseline_args(exercise_ids: list[str]) -> list[str]:
    """The pytest arguments of the unmutated run: every listed exercise's graded tests at once."""
    markers = " or ".join(EXERCISES[i].marker for i in exercise_ids)
    return ["-q", *PYTEST_QUIET, "-m", markers, *sorted({test_file(i) for i in exercise_ids})]


def run_tests(workdir: Path, exercise_id: str) -> subprocess.CompletedProcess:
    """That exercise's graded tests against the (mutated) reference in `workdir`, in a fresh Python (--cold)."""
    command = [sys.executable, "-m", "pytest", *pytest_args(exercise_id)]
    return subprocess.run(command, cwd=workdir, env=dict(os.environ, **TEST_ENV), capture_output=True, text=True,
                          timeout=MUTANT_TIMEOUT)  # fmt: skip


def first_failure(output: str) -> str:
    """The name of the first failing test, for the table."""
    match = re.search(r"^FAILED \S+::(\S+)", output, re.M) or re.search(r"^ERROR \S+::(\S+)", output, re.M)
    return match.group(1) if match else ""


def prepare(mutant: Mutant, workdir: Path) -> str:
    """Copy the checkout into `workdir` and apply the mutant there: '' when applied, else why it is STALE."""
    copy_checkout(workdir)
    target = workdir / "solutions" / f"{EXERCISES[mutant.exercise].module}.py"
    try:
        target.write_text(apply(mutant, target.read_text()))
    except ValueError as error:
        return str(error)
    return ""


def verdict(mutant: Mutant, done: subprocess.CompletedProcess, seconds: float) -> tuple[Mutant, str, str]:
    """Read pytest's exit status: 1 caught, 0 SURVIVED, anything else (or no status: timed out) ERROR."""
    if done.returncode == 1:
        return mutant, "caught", f"{first_failure(done.stdout)} ({seconds:.0f} s)"
    if done.returncode == 0:
        return mutant, "SURVIVED", "every test of the exercise passed"
    if done.returncode is None:
        return mutant, "ERROR", f"timed out after {MUTANT_TIMEOUT} s: {done.stdout[-300:]}{done.stderr[-300:]}"
    return mutant, "ERROR", f"pytest exit {done.returncode}: {done.stdout[-300:]}{done.stderr[-300:]}"


def check_mutant(mutant: Mutant) -> tuple[Mutant, str, str]:
    """Apply one mutant in a fresh copy and run its exercise's tests in a new process (the --cold path)."""
    with tempfile.TemporaryDirectory(prefix="kvcourse-mutant-") as tmp:
        stale = prepare(mutant, Path(tmp))
        if stale:
            return mutant, "STALE", stale
        started = time.perf_counter()
        done = run_tests(Path(tmp), mutant.exercise)
        seconds = time.perf_counter() - started
    return verdict(mutant, done, seconds)


def baseline(exercise_ids: list[str]) -> str:
    """The failures of the exercises' graded tests on the UNMUTATED copy, in one run ('' when all pass; --cold)."""
    with tempfile.TemporaryDirectory(prefix="kvcourse-mutant-") as tmp:
        copy_checkout(Path(tmp))
        command = [sys.executable, "-m", "pytest", *baseline_args(exercise_ids)]
        env = dict(os.environ, **TEST_ENV)
        done = subprocess.run(command, cwd=tmp, env=env, capture_output=True, text=True, timeout=BASELINE_TIMEOUT)
    return "" if done.returncode == 0 else done.stdout[-2000:] + done.stderr[-1000:]


# ---- the warm runner: heavy imports once, then one fork per mutant ------------------------------------------------
def warm_up() -> None:
    """Set the cold run's environment, then import what every graded test imports and no mutant changes, once."""
    os.environ.update(TEST_ENV)  # before the imports: huggingface_hub reads HF_HUB_OFFLINE when it is imported
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as conftest.py sets it
    sys.dont_write_bytecode = True  # what PYTHONDONTWRITEBYTECODE=1 does at a fresh interpreter's start
    # TRITON_INTERPRET is left as it is: the cold pytest process imports triton with the caller's environment too
    # (the 5.4 test sets it only for the subprocess it starts). Imports only: no torch op runs before a fork.
    for name in WARM_IMPORTS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if name == "transformers":
            for attribute in WARM_TRANSFORMERS:
                getattr(module, attribute, None)  # its lazy module imports the model code here


def is_project_module(name: str, module: object) -> bool:
    """A module of the checkout (kvcourse, solutions, tests, conftest, a test helper): a child must import its own."""
    if name.partition(".")[0] in PROJECT_MODULES:
        return True
    path = getattr(module, "__file__", None) or ""
    return path.startswith(str(ROOT) + os.sep) and not path.startswith(sys.prefix + os.sep)


def forget_project(workdir: Path) -> None:
    """In a forked child: drop every module, import hook and sys.path entry of the checkout; `workdir` comes first."""
    for name, module in list(sys.modules.items()):
        if name not in ("__main__", __name__) and is_project_module(name, module):
            del sys.modules[name]
    # kvcourse/__init__ installs the KVCOURSE_SOLUTIONS finder, which points at ROOT/solutions: the copy installs its own.
    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__module__.partition(".")[0] not in PROJECT_MODULES]
    ours = {str(ROOT), str(ROOT / "scripts"), ""}
    sys.path[:] = [str(workdir), *(p for p in sys.path if p not in ours)]
    sys.path_importer_cache.clear()
    importlib.invalidate_caches()


def child_main(workdir: Path, args: list[str]) -> NoReturn:
    """In a forked child: run pytest in `workdir` as `python -m pytest` would there, then exit with its status."""
    code = 70
    try:
        os.setpgid(0, 0)  # its own group: a timeout kills it and anything it started (the 5.4 Triton process)
        for fd, name in ((1, "stdout"), (2, "stderr")):
            os.dup2(os.open(workdir.parent / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.stdout = sys.__stdout__ = os.fdopen(1, "w", buffering=1, closefd=False)  # not a wrapper the parent had
        sys.stderr = sys.__stderr__ = os.fdopen(2, "w", buffering=1, closefd=False)
        os.chdir(workdir)
        forget_project(workdir)
        import hypothesis.configuration
        import pytest

        hypothesis.configuration.set_hypothesis_home_dir(Path.cwd() / ".hypothesis")  # as if imported here
        code = int(pytest.main(args))
    except BaseException:  # a child must reach os._exit: never return into the parent's loop
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def fork_pytest(workdir: Path, args: list[str]) -> int:
    """Start one child running pytest in `workdir`; its pid (it is also its process group)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        child_main(workdir, args)
    with contextlib.suppress(OSError):
        os.setpgid(pid, pid)  # the child does it too; whichever runs first
    return pid


def collect(pid: int, workdir: Path, status: int | None) -> subprocess.CompletedProcess:
    """What a finished (or killed: status None) child printed, as subprocess.run would report it."""
    code = None if status is None else os.waitstatus_to_exitcode(status)
    out, err = ((workdir.parent / n).read_text(errors="replace") for n in ("stdout", "stderr"))
    return subprocess.CompletedProcess(["pytest"], code, out, err)


def run_forked(items: list, start: Callable[[object, Path], list[str] | str], jobs: int, timeout: float) -> list:
    """For each item, in its own temp dir: `start` copies and returns pytest's args (or a str: no run, that result).

    Up to `jobs` children at once; one past `timeout` is killed with its group. Results in the items' order:
    (item, str) or (item, CompletedProcess with returncode None when killed, seconds).
    """
    results: list = [None] * len(items)
    queue = deque(enumerate(items))
    running: dict[int, tuple[int, tempfile.TemporaryDirectory, float]] = {}
    try:
        while queue or running:
            while queue and len(running) < jobs:
                index, item = queue.popleft()
                tmp = tempfile.TemporaryDirectory(prefix="kvcourse-mutant-")
                workdir = Path(tmp.name) / "checkout"  # pytest's output goes beside it, not into the copy
                args = start(item, workdir)
                if isinstance(args, str):
                    results[index] = (item, args)
                    tmp.cleanup()
                    continue
                running[fork_pytest(workdir, args)] = (index, tmp, time.perf_counter())
            for pid, (index, tmp, started) in list(running.items()):
                done, status = os.waitpid(pid, os.WNOHANG)
                if not done and time.perf_counter() - started < timeout:
                    continue
                if not done:
                    with contextlib.suppress(OSError):
                        os.killpg(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    status = None
                done = collect(pid, Path(tmp.name) / "checkout", status)
                results[index] = (items[index], done, time.perf_counter() - started)
                tmp.cleanup()
                del running[pid]
            time.sleep(0.05)
    finally:
        for pid, (_, tmp, _) in running.items():  # interrupted: leave no child behind
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            tmp.cleanup()
    return results


def check_mutants_warm(mutants: list[Mutant], jobs: int) -> list[tuple[Mutant, str, str]]:
    """Every mutant as check_mutant does it, but each in a child forked from this warmed-up process."""

    def start(mutant: Mutant, workdir: Path) -> list[str] | str:
        return prepare(mutant, workdir) or pytest_args(mutant.exercise)

    results = []
    for mutant, *run in run_forked(mutants, start, jobs, MUTANT_TIMEOUT):
        results.append((mutant, "STALE", run[0]) if isinstance(run[0], str) else verdict(mutant, *run))
    return results


def baseline_warm(exercise_ids: list[str]) -> str:
    """baseline(), in a child forked from this warmed-up process."""

    def start(_: object, workdir: Path) -> list[str]:
        copy_checkout(workdir)
        return baseline_args(exercise_ids)

    ((_, done, _),) = run_forked([None], start, 1, BASELINE_TIMEOUT)
    return "" if done.returncode == 0 else done.stdout[-2000:] + done.stderr[-1000:]


def main(argv: list[str] | None = None) -> int:
    """Run the mutants (two at a time), print the table, exit 1 on any survivor, stale pattern or error."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", help="exercise id(s) to check, e.g. --only 3.3")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--jobs", type=int, default=2, help="mutants run in parallel (default 2)")
    parser.add_argument("--cold", action="store_true", help="one fresh Python per mutant (the slow, old path)")
    args = parser.parse_args(argv)
    mutants = [m for m in ALL_MUTANTS if not args.only or m.exercise in args.only]
    unknown = sorted({m.exercise for m in mutants} - set(EXERCISES))
    if unknown:
        print(f"mutants name unknown exercises {unknown}: update MUTANTS in {Path(__file__).name}.")
        return 1
    if args.list:
        for m in mutants:
            print(f"{m.exercise:>4}  {m.description}")
        return 0
    start = time.perf_counter()
    exercise_ids = sorted({m.exercise for m in mutants}, key=lambda i: tuple(map(int, i.split("."))))
    if not args.cold:
        warm_up()  # once: every child forked below starts with torch, pytest, transformers... imported
    broken = baseline(exercise_ids) if args.cold else baseline_warm(exercise_ids)
    if broken:
        print(f"the unmutated reference fails its own graded tests; fix that first:\n{broken}")
        return 1
    if args.cold:
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            results = list(pool.map(check_mutant, mutants))
    else:
        results = check_mutants_warm(mutants, max(1, args.jobs))
    results.sort(key=lambda r: tuple(map(int, r[0].exercise.split("."))))  # stable: the list's order within one
    print(f"{'exercise':<9} {'mutant':<58} {'result':<9} caught by")
    for mutant, verdict, detail in results:
        print(f"{mutant.exercise:<9} {mutant.description[:58]:<58} {verdict:<9} {detail}")
    bad = [r for r in results if r[1] != "caught"]
    missing = sorted(
        (eid for eid in EXERCISES if sum(m.exercise == eid for m in ALL_MUTANTS) < 2),
        key=lambda i: tuple(map(int, i.split("."))),
    )
    learner = sum(m in LEARNER_MUTANTS for m in mutants)
    print(f"({len(mutants) - learner} from this file's MUTANTS, {learner} from mutants_learner.py)")
    print(
        f"\n{len(results) - len(bad)} of {len(results)} mutants caught by their own exercise's tests "
        f"in {time.perf_counter() - start:.0f} s."
    )
    if missing and not args.only:
        print(f"exercises with fewer than two mutants: {', '.join(missing)}")
    return 1 if bad or (missing and not args.only) else 0


if __name__ == "__main__":
    sys.exit(main())
