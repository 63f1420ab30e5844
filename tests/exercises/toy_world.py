"""A toy serving loop over the learner's KV manager, whose outputs must equal a run with unlimited memory.

`ToyWorld` admits requests FCFS (prefix-cache lookup, then `allocate_slots`), decodes every running
request one token per step, preempts the newest admission when a decode finds no room (recompute),
forks parallel samples (`fork`, then copy-on-write), and "executes" each step on a simulated paged
memory: every token is written into the slot its block table gives, and the next token is a
function of the context READ BACK through the table. A block shared or handed out while someone
still uses it, a missed copy-on-write, or a prefix hit on the wrong block changes what is read, so
the outputs differ from `expected_outputs` (the same model with all the memory in the world) or the
read-back check fails at once, saying which request read whose token.

`stand_ins(manager, learner_upto)`: graded tests of an early exercise must not need later ones
(check("3.3") before notebook 04 is written). The methods of exercises AFTER `learner_upto` are
replaced, on this one manager, by the test-side versions below, written from the contracts.
"""

from __future__ import annotations

import hashlib
import random
import types
from collections import deque

from kvcourse.core.contract import KVCacheBlocks
from kvcourse.core.request import Request, RequestStatus
from kvcourse.toy.model import TOY_VOCAB_SIZE, toy_next_token

# ------------------------------------------------------------------------------------------ the toy model


def salted_next_token(context: list[int], salt: int) -> int:
    """The toy model's next token; a parallel sample (salt > 0) draws another token from the same context."""
    return (toy_next_token(context) + 7919 * salt) % TOY_VOCAB_SIZE


def expected_outputs(prompt: list[int], max_new_tokens: int, salt: int) -> list[int]:
    """What the request generates with unlimited memory, no caching and no sharing."""
    context, out = list(prompt), []
    for _ in range(max_new_tokens):
        out.append(salted_next_token(context, salt))
        context.append(out[-1])
    return out


# ------------------------------------------------------------------------------------------ stand-ins

ORDER = ("3.1", "3.2", "3.3", "3.4", "4.1", "4.2", "4.3", "4.4", "4.5", "4.6")


def _key(exercise_id: str) -> tuple[int, int]:
    major, minor = exercise_id.split(".")
    return int(major), int(minor)


def _blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def _sa_get_new_blocks(pool, num_blocks: int) -> list:
    if num_blocks > pool.free_block_queue.num_free_blocks:
        raise ValueError(f"asked for {num_blocks} blocks but only {pool.free_block_queue.num_free_blocks} are free.")
    blocks = [pool.free_block_queue.popleft() for _ in range(num_blocks)]
    for block in blocks:
        pool._maybe_evict_cached_block(block)
        block.ref_cnt = 1
    return blocks


def _sa_free_blocks(pool, ordered_blocks) -> None:
    for block in list(ordered_blocks):
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            pool.free_block_queue.append(block)


def _sa_touch(pool, blocks) -> None:
    for block in blocks:
        if block.ref_cnt == 0:
            pool.free_block_queue.remove(block)
        block.ref_cnt += 1


def _sa_cache_full_blocks(pool, blocks, block_hashes, token_ids) -> None:
    if not pool.enable_caching:
        return
    for block, block_hash, tokens in zip(blocks, block_hashes, token_ids):
        if block.block_hash is None and block_hash not in pool.cached_block_hash_to_block:
            block.block_hash, block.token_ids = block_hash, tuple(tokens)
            pool.cached_block_hash_to_block[block_hash] = block


def _sa_get_cached_block(pool, block_hash, token_ids):
    block = pool.cached_block_hash_to_block.get(block_hash)
    return block if block is not None and block.token_ids == tuple(token_ids) else None


def _sa_maybe_evict(pool, block) -> None:
    if block.block_hash is not None:
        pool.cached_block_hash_to_block.pop(block.block_hash, None)
        block.block_hash = block.token_ids = None


def _sa_hash(parent, tokens) -> bytes:
    return hashlib.sha256(repr((parent, tuple(int(t) for t in tokens))).encode()).digest()


def _sa_block_hashes(manager, request) -> list:
    known = manager.req_to_block_hashes.get(request.id)
    if known is None or known[0] is not request:
        manager.req_to_block_hashes[request.id] = (request, [])
    hashes, tokens, size = manager.req_to_block_hashes[request.id][1], request.all_token_ids, manager.block_size
    hash_fn = manager._stand_in_hash
    while (len(hashes) + 1) * size <= len(tokens):
        start = len(hashes) * size
        hashes.append(hash_fn(hashes[-1] if hashes else None, tokens[start : start + size]))
    return hashes


def _sa_cache_full(manager, request, req_blocks, num_tokens) -> None:
    if not manager.enable_prefix_caching:
        return
    size, done = manager.block_size, manager.num_cached_block.get(request.id, 0)
    full = min(num_tokens, request.num_tokens) // size
    if full > done:
        tokens = request.all_token_ids
        chunks = [tokens[i * size : (i + 1) * size] for i in range(done, full)]
        hashes = manager._block_hashes(request)
        manager.block_pool.cache_full_blocks(req_blocks[done:full], hashes[done:full], chunks)
        manager.num_cached_block[request.id] = full


def _sa_get_computed_blocks(manager, request):
    if not manager.enable_prefix_caching:
        return KVCacheBlocks.empty(), 0
    size, tokens, hits = manager.block_size, request.all_token_ids, []
    for i, block_hash in enumerate(manager._block_hashes(request)[: (request.num_tokens - 1) // size]):
        block = manager.block_pool.get_cached_block(block_hash, tokens[i * size : (i + 1) * size])
        if block is None:
            break
        hits.append(block)
    return KVCacheBlocks(hits), len(hits) * size


def _sa_shared_to_write(manager, request, first_write, num_tokens) -> list[int]:
    table = manager.req_to_blocks.get(request.id, [])
    if num_tokens <= first_write:
        return []
    last = min(len(table), _blocks_needed(num_tokens, manager.block_size))
    return [i for i in range(first_write // manager.block_size, last) if table[i].ref_cnt > 1]


def _sa_copy_on_write(manager, req_blocks, indices) -> list:
    if not indices:
        return []
    copies = manager.block_pool.get_new_blocks(len(indices))
    for i, dst in zip(indices, copies):
        manager.block_pool.free_blocks([req_blocks[i]])
        manager.pending_copies.append((req_blocks[i].block_id, dst.block_id))
        req_blocks[i] = dst
    return copies


def _sa_take_pending_copies(manager) -> list:
    copies, manager.pending_copies = manager.pending_copies, []
    return copies


def _sa_fork(manager, parent, child) -> None:
    blocks = manager.req_to_blocks[parent.id]
    manager.block_pool.touch(blocks)
    manager.req_to_blocks[child.id] = list(blocks)
    if parent.id in manager.req_to_block_hashes:
        manager.req_to_block_hashes[child.id] = (child, list(manager.req_to_block_hashes[parent.id][1]))
    manager.num_cached_block[child.id] = manager.num_cached_block.get(parent.id, 0)


def _sa_num_new_blocks(manager, request, num_tokens, num_hits, num_extra):
    held = len(manager.req_to_blocks.get(request.id, [])) + num_hits
    new = max(0, _blocks_needed(num_tokens, manager.block_size) - held)
    return None if new + num_extra > manager.block_pool.get_num_free_blocks() else new


def _sa_can_allocate(manager, request, num_new_tokens) -> bool:
    num_tokens = request.num_computed_tokens + num_new_tokens
    to_copy = manager._shared_blocks_to_write(request, request.num_computed_tokens, num_tokens)
    return manager._num_new_blocks(request, num_tokens, 0, len(to_copy)) is not None


def _sa_allocate_slots(manager, request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None):
    hits = list(new_computed_blocks.blocks) if new_computed_blocks is not None else []
    first_write = request.num_computed_tokens + num_new_computed_tokens
    num_tokens = first_write + num_new_tokens
    to_copy = manager._shared_blocks_to_write(request, first_write, num_tokens)
    extra = len(to_copy) + sum(block.ref_cnt == 0 for block in hits)
    num_new = manager._num_new_blocks(request, num_tokens, len(hits), extra)
    if num_new is None:
        return None
    admission = request.id not in manager.req_to_blocks
    table = manager.req_to_blocks.setdefault(request.id, [])
    manager.block_pool.touch(hits)
    table.extend(hits)
    copies = manager._copy_on_write(table, to_copy)
    new = manager.block_pool.get_new_blocks(num_new)
    table.extend(new)
    manager._cache_full_blocks(request, table, num_tokens)
    if admission:
        manager._record_admission(request, num_new_computed_tokens if hits else 0)
    return KVCacheBlocks(copies + new)


def _sa_free(manager, request) -> None:
    manager.num_cached_block.pop(request.id, None)
    if request.is_complete():
        manager.req_to_block_hashes.pop(request.id, None)
    manager.block_pool.free_blocks(reversed(manager.req_to_blocks.pop(request.id, [])))


# exercise -> (object: "pool" or "manager", method name, stand-in)
STAND_INS = {
    "3.2": [("pool", "get_new_blocks", _sa_get_new_blocks), ("pool", "free_blocks", _sa_free_blocks),
            ("pool", "touch", _sa_touch)],
    "3.3": [("manager", "allocate_slots", _sa_allocate_slots), ("manager", "can_allocate", _sa_can_allocate),
            ("manager", "_num_new_blocks", _sa_num_new_blocks)],
    "3.4": [("manager", "free", _sa_free)],
    "4.2": [("pool", "cache_full_blocks", _sa_cache_full_blocks), ("manager", "_block_hashes", _sa_block_hashes),
            ("manager", "_cache_full_blocks", _sa_cache_full)],
    "4.3": [("pool", "get_cached_block", _sa_get_cached_block),
            ("manager", "get_computed_blocks", _sa_get_computed_blocks)],
    "4.4": [("pool", "_maybe_evict_cached_block", _sa_maybe_evict)],
    "4.5": [("manager", "fork", _sa_fork), ("manager", "_copy_on_write", _sa_copy_on_write),
            ("manager", "take_pending_copies", _sa_take_pending_copies)],
    "4.6": [("manager", "_shared_blocks_to_write", _sa_shared_to_write)],
}  # fmt: skip


def stand_ins(manager, learner_upto: str):
    """Use the learner's code for exercises up to `learner_upto`, the test's own for every later one."""
    import kvcourse.kv_cache as kv_cache

    later = [eid for eid in STAND_INS if _key(eid) > _key(learner_upto)]
    for eid in later:
        for owner, name, function in STAND_INS[eid]:
            target = manager.block_pool if owner == "pool" else manager
            setattr(target, name, types.MethodType(function, target))
    learner_hash = _key(learner_upto) >= _key("4.1")
    manager._stand_in_hash = kv_cache.hash_block_tokens if learner_hash else _sa_hash
    return manager


# ------------------------------------------------------------------------------------------ the toy loop


class ReadBackError(AssertionError):
    """A request read back a token it never wrote: its memory was shared or reused wrongly."""


class ToyWorld:
    """The serving loop: admission FCFS, one decode per running request per step, preempt the newest."""

    def __init__(self, manager, max_running: int = 8) -> None:
        self.manager = manager
        self.max_running = max_running
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self.salt: dict[int, int] = {}
        self.forks: dict[int, int] = {}
        self.memory: dict[tuple[int, int], int] = {}  # (block id, offset) -> token written there
        self.finished: list[Request] = []
        self.admissions = 0
        self.num_preemptions = 0
        self.children: list[Request] = []  # the forked parallel samples
        self.next_id = 1000
        self.steps = 0

    def add(self, request: Request, salt: int = 0, forks: int = 0) -> None:
        """Queue a request (parallel samples are forked off it after its first token)."""
        self.salt[request.id], self.forks[request.id] = salt, forks
        self.waiting.append(request)

    # ---- one step ----

    def step(self) -> None:
        """Decode every running request, admit what fits, run the batch on the simulated memory."""
        self.steps += 1
        preemptions_before = self.num_preemptions
        batch: list[tuple[Request, int, list[int]]] = []
        for request in list(self.running):
            waiting_for = request.num_tokens - request.num_computed_tokens
            if request in self.running and waiting_for > 0 and self._make_room(request, waiting_for):
                batch.append(self._advance(request))
        preempted = self.num_preemptions != preemptions_before  # memory just freed is for the running ones
        while self.waiting and len(self.running) < self.max_running and not preempted:
            request = self.waiting[0]
            hits, num_hit = self.manager.get_computed_blocks(request)
            new = self.manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, hits)
            if new is None:
                break
            self.waiting.popleft()
            self.admissions += 1
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            request.num_computed_tokens = num_hit
            batch.append(self._advance(request))
        self._execute(batch)

    def _make_room(self, request: Request, num_tokens: int) -> bool:
        """Allocate for a running request, preempting the newest admissions until it fits (or it steps back)."""
        while self.manager.allocate_slots(request, num_tokens) is None:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _advance(self, request: Request) -> tuple[Request, int, list[int]]:
        start = request.num_computed_tokens
        tokens = request.all_token_ids[start:]
        request.num_computed_tokens = request.num_tokens
        return request, start, tokens

    def _execute(self, batch: list[tuple[Request, int, list[int]]]) -> None:
        """Copies first, then each sequence writes its tokens and reads its context back through its table."""
        for src, dst in self.manager.take_pending_copies():
            for offset in range(self.manager.block_size):
                if (src, offset) in self.memory:
                    self.memory[(dst, offset)] = self.memory[(src, offset)]
                else:
                    self.memory.pop((dst, offset), None)
        size = self.manager.block_size
        tables = {request.id: self.manager.get_block_ids(request) for request, _, _ in batch}
        for request, start, tokens in batch:
            table = tables[request.id]
            if len(table) * size < start + len(tokens):
                raise ReadBackError(f"request {request.id}'s block table cannot hold the tokens it was given room for")
            for position, token in enumerate(tokens, start):
                self.memory[(table[position // size], position % size)] = (request.id, position, token)
        for request, _, _ in batch:
            table, context = tables[request.id], []
            for position, token in enumerate(request.all_token_ids):
                stored = self.memory.get((table[position // size], position % size))
                if stored is None or stored[1:] != (position, token):
                    raise ReadBackError(
                        f"request {request.id} read position {position} through its block table and found "
                        f"{'nothing' if stored is None else 'another token'}: block "
                        f"{table[position // size]} was shared, reused or copied wrongly"
                    )
                context.append(token)
            self._sample(request, context)

    def _sample(self, request: Request, context: list[int]) -> None:
        request.output_tokens.append(salted_next_token(context, self.salt[request.id]))
        if self.forks.get(request.id) and len(request.output_tokens) == 1:
            for _ in range(self.forks.pop(request.id)):
                self._fork(request)
        if request.is_complete():
            self.running.remove(request)
            self.manager.free(request)
            request.status = RequestStatus.FINISHED
            self.finished.append(request)

    def _fork(self, parent: Request) -> None:
        """A parallel sample: shares every block of the parent, then samples its own first token."""
        self.next_id += 1
        child = Request(self.next_id, list(parent.prompt_tokens), parent.max_new_tokens)
        child.num_computed_tokens = parent.num_computed_tokens
        self.salt[child.id] = len([r for r in self.salt if r >= 1000]) + 1
        self.manager.fork(parent, child)
        context = parent.all_token_ids[: parent.num_computed_tokens]
        child.output_tokens.append(salted_next_token(context, self.salt[child.id]))
        self.children.append(child)
        if child.is_complete():  # its one token is the one just sampled
            self.manager.free(child)
            child.status = RequestStatus.FINISHED
            self.finished.append(child)
        else:
            child.status = RequestStatus.RUNNING
            self.running.append(child)

    def run(self, max_steps: int = 2000) -> None:
        """Step until every request has finished."""
        while self.waiting or self.running:
            if self.steps >= max_steps:
                raise AssertionError("the toy run did not finish: requests are admitted and preempted forever")
            self.step()


def shared_prompt_workload(seed: int, num_requests: int = 16, num_prompts: int = 3, block_size: int = 4):
    """`num_requests` requests over `num_prompts` shared prefixes (some identical), seeded."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(TOY_VOCAB_SIZE) for _ in range(rng.randint(block_size, 3 * block_size))]
                for _ in range(num_prompts)]  # fmt: skip
    requests = []
    for i in range(num_requests):
        suffix = [rng.randrange(TOY_VOCAB_SIZE) for _ in range(rng.choice([0, 1, 2, 3, 5]))]
        prompt = rng.choice(prefixes) + suffix
        requests.append(Request(i, prompt, max_new_tokens=rng.randint(2, 9)))
    return requests


def check_outputs(world: ToyWorld, requests: list[Request]) -> None:
    """Every request (and every forked sample) generated exactly what unlimited memory gives."""
    for request in [*requests, *world.children]:
        assert request.status is RequestStatus.FINISHED, f"request {request.id} never finished"
        expected = expected_outputs(request.prompt_tokens, request.max_new_tokens, world.salt[request.id])
        assert request.output_tokens == expected, (
            f"request {request.id} generated other tokens than a run without caching or sharing: its K/V "
            "memory was shared, reused or copied wrongly somewhere"
        )
