"""Workloads for the scheduler (2.x, 7.1-7.4) and the KV-cache manager (3.x, 4.1-4.6, 7.5), as plain-data ops.

Two drivers: `run_engine` steps a StallFreeScheduler over a KVCacheManager (add, step, abort, reset) and
`run_manager` calls the manager directly (allocate, lookup, fork, free, hash). Both record, after every
call, the return value (or the exception's type) and a snapshot of everything the contract fixes.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Mapping
from types import ModuleType

from kvcourse.core.request import Request, RequestStatus
from kvcourse.core.scheduler_config import PreemptionCosts

from .core import error_record, module_files, plain, time_limit

MAX_WALK = 100_000  # a broken free queue (a cycle) must not hang the snapshot


class Canon:
    """Names hashes by first appearance ("h0", "h1", ...): the digest itself is free, only equality counts."""

    def __init__(self) -> None:
        self.names: dict[object, str] = {}

    def __call__(self, value: object) -> str | None:
        if value is None:
            return None
        try:
            key = value if isinstance(value, (bytes, str, int, tuple)) else repr(value)
            hash(key)
        except TypeError:
            key = repr(value)
        return self.names.setdefault(key, f"h{len(self.names)}")


class HashCounter:
    """Counts calls of HASH_FUNCTION in every module the manager's code reads it from (4.2/4.3: hash once).

    With `collide` > 0, hash_block_tokens collides on purpose (as the graded tests patch it): a block's hash
    ignores its parent (equal tokens, equal hash, whatever the prefix) and takes one of `collide` values, so
    a lookup must check the tokens and stop at the first miss."""

    def __init__(self, kv_module: ModuleType, collide: int = 0) -> None:
        self.count = 0
        self.patched: list[tuple[dict, str, object]] = []
        seen: set[int] = set()
        for space in _globals_of(kv_module):
            if "HASH_FUNCTION" in space and id(space) not in seen:
                seen.add(id(space))
                original = space["HASH_FUNCTION"]
                self.patched.append((space, "HASH_FUNCTION", original))
                space["HASH_FUNCTION"] = self._counting(original)
        if collide:
            for space in {id(s): s for s in _globals_of(kv_module)}.values():
                if callable(space.get("hash_block_tokens")):
                    original = space["hash_block_tokens"]
                    self.patched.append((space, "hash_block_tokens", original))
                    space["hash_block_tokens"] = self._colliding(original, collide)

    @staticmethod
    def _colliding(original, collide: int):
        def colliding(parent_block_hash, token_ids):
            return b"collides %d" % (original(None, token_ids)[0] % collide)

        return colliding

    def _counting(self, original):
        def counted(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)

        return counted

    def restore(self) -> None:
        for space, name, original in reversed(self.patched):
            space[name] = original


def _globals_of(module: ModuleType) -> list[dict]:
    """The global namespaces of a module's functions and methods (a hybrid mixes two modules)."""
    spaces = [vars(module)]
    for value in list(vars(module).values()):
        members = vars(value).values() if isinstance(value, type) else [value]
        for member in members:
            func = getattr(member, "__func__", member)
            space = getattr(func, "__globals__", None)
            if isinstance(space, dict):
                spaces.append(space)
    return spaces


# ---------------------------------------------------------------------------------------------- snapshots
def _walk(first, end, attr: str) -> list[int]:
    """Block ids from `first` following `attr` until `end` (bounded)."""
    ids, block = [], first
    for _ in range(MAX_WALK):
        if block is None or block is end:
            return ids
        ids.append(block.block_id)
        block = getattr(block, attr)
    return [*ids, -999]


def snap_manager(manager, requests: Mapping[int, Request], canon: Canon) -> dict:
    """The manager's contract-visible state: tables, free queue (both ways), ref counts, published prefixes, stats."""
    pool = manager.block_pool
    queue = pool.free_block_queue
    stats = manager.prefix_cache_stats
    return {
        "tables": [[rid, [b.block_id for b in manager.req_to_blocks.get(rid, [])]] for rid in sorted(requests)],
        "free_queue": _walk(queue.fake_head.next_free_block, queue.fake_tail, "next_free_block"),
        "free_queue_backward": _walk(queue.fake_tail.prev_free_block, queue.fake_head, "prev_free_block"),
        "num_free": queue.num_free_blocks,
        "ref_cnt": [b.ref_cnt for b in pool.blocks],
        "published": [[canon(b.block_hash), list(b.token_ids) if b.token_ids else None] for b in pool.blocks],
        "cache_map": sorted(
            [canon(h), getattr(b, "block_id", None)] for h, b in pool.cached_block_hash_to_block.items()
        ),
        "stats": [stats.requests, stats.queries, stats.hits],
        "pending": [list(c) for c in manager.pending_copies],
    }


def snap_scheduler(scheduler, requests: Mapping[int, Request], canon: Canon) -> dict:
    """The scheduler's contract-visible state plus the manager's."""
    rows = []
    for rid in sorted(requests):
        r = requests[rid]
        reason = r.reason if r.status in (RequestStatus.ABORTED, RequestStatus.FAILED) else bool(r.reason)
        rows.append([rid, r.status.name, r.num_computed_tokens, list(r.output_tokens), r.num_preemptions, reason])
    return {
        "output_types": sorted({type(t).__name__ for r in requests.values() for t in r.output_tokens}),
        "reason_numbers": [_reason_numbers(r, scheduler.kv_cache_manager) for r in scheduler.rejected],
        "waiting": [r.id for r in scheduler.waiting_queue],
        "running": list(scheduler.active_pool),
        "finished": [r.id for r in scheduler.finished],
        "rejected": [r.id for r in scheduler.rejected],
        "requests": rows,
        "preemptions": scheduler.num_preemptions,
        "swap": [
            scheduler.num_swapped_out_tokens,
            scheduler.num_swapped_in_tokens,
            scheduler.num_swaps,
            sorted([k, v] for k, v in scheduler._swapped.items()),
        ],
        **snap_manager(scheduler.kv_cache_manager, requests, canon),
    }


def _reason_numbers(request: Request, manager) -> list:
    """[id, the reason names the blocks it needs, the reason names the cache's blocks] of a rejected request."""
    import re

    needed = -(-(request.num_prompt_tokens + request.max_new_tokens) // manager.block_size)
    numbers = re.findall(r"\d+", request.reason) if isinstance(request.reason, str) else []
    return [request.id, str(needed) in numbers, str(manager.num_blocks) in numbers]


def plan(output) -> dict:
    """A SchedulerOutput as plain data, in plan order."""
    return {
        "seqs": [[s.request_id, list(s.tokens), s.is_decode, s.position_ids_start, s.samples_token] for s in output],
        "new_block_ids": [[k, list(v)] for k, v in output.new_block_ids.items()],
        "block_ids": [[k, list(v)] for k, v in (output.block_ids or {}).items()],
        "preempted": list(output.preempted_req_ids),
        "finished_req_ids": list(output.finished_req_ids),
        "blocks_to_copy": [list(c) for c in output.blocks_to_copy],
        "swapped_out": [[k, v] for k, v in output.swapped_out.items()],
        "swapped_in": [[k, v] for k, v in output.swapped_in.items()],
        "total": output.total_num_scheduled_tokens,
    }


def sampled_token(request_id: int, position: int) -> int:
    """The token the fake executor samples: a fixed function of the request and the position."""
    return 7 + (request_id * 31 + position * 17) % 23


# ---------------------------------------------------------------------------------------------- generators
BLOCK_SIZES = [1, 2, 3, 4, 4, 8, 16, 64]
BUDGETS = [1, 2, 3, 5, 8, 16, 32, 64, 10**6]


def _prompt(rng: random.Random, bases: list[list[int]], block_size: int) -> list[int]:
    """A prompt that often shares a prefix with others (prefix-cache hits), sometimes with huge token ids."""
    length = rng.choice([1, 2, block_size - 1, block_size, block_size + 1, 2 * block_size, 3 * block_size + 2])
    length = max(1, min(length, 4 * block_size + 3, 200))
    if rng.random() < 0.6:
        base = rng.choice(bases)
        cut = rng.randint(0, len(base))
        tokens = base[:cut] + [rng.randint(1, 40) for _ in range(max(0, length - cut))]
    else:
        tokens = [rng.randint(1, 40) for _ in range(length)]
    if rng.random() < 0.15:
        tokens = [t + 65_536 * rng.randint(1, 6) for t in tokens]  # ids past 2 bytes (Mooncake's go to 365,579)
    return tokens or [1]


SCENARIOS = ("pressure", "budget", "prefix", "tiny", "mixed")
PRESSURE_FIRST = ("pressure", "budget", "pressure", "prefix", "pressure")
PREEMPTING = {"2.3", "2.6", "2.7", "2.8", "7.1", "7.3", "7.4"}  # exercises whose code runs under memory pressure


def engine_config(rng: random.Random, exercise_id: str, scenario: str) -> dict:
    """Sizes and knobs for the scenario: heavy preemption, a tight budget, shared prefixes, tiny caches, a mix."""
    if scenario == "pressure":
        config = {
            "block_size": rng.choice([1, 2, 3, 4]),
            "num_blocks": rng.choice([6, 8, 12]),
            "budget": rng.choice([7, 16, 10**6]),
            "batch": rng.choice([4, 8, 64]),
        }
    elif scenario == "budget":
        config = {
            "block_size": rng.choice([2, 4, 8]),
            "num_blocks": rng.choice([30, 60]),
            "budget": rng.choice([3, 5, 9, 13, 20]),
            "batch": rng.choice([3, 8, 64]),
        }
    elif scenario == "prefix":
        config = {
            "block_size": rng.choice([1, 2, 3, 4]),
            "num_blocks": rng.choice([8, 12, 20]),
            "budget": rng.choice([4, 9, 10**6]),
            "batch": rng.choice([2, 8]),
        }
    elif scenario == "tiny":
        config = {
            "block_size": rng.choice([1, 1, 16, 64]),
            "num_blocks": rng.choice([1, 2, 3]),
            "budget": rng.choice([1, 2, 3, 10**6]),
            "batch": rng.choice([1, 2, 64]),
        }
    else:
        config = {
            "block_size": rng.choice(BLOCK_SIZES),
            "num_blocks": rng.choice([2, 4, 8, 12, 20, 40]),
            "budget": rng.choice(BUDGETS),
            "batch": rng.choice([1, 2, 3, 4, 8, 64]),
        }
    if exercise_id == "7.3" and scenario == "pressure":  # blocks hold several tokens: CPU blocks != tokens
        config["block_size"] = rng.choice([2, 3, 4])
    caching = scenario == "prefix" or exercise_id.startswith(("3.", "4.", "7.5")) or rng.random() < 0.5
    config.update(
        caching=caching,
        policy="priority" if exercise_id == "7.1" else "fcfs",
        watermark=rng.choice([0.1, 0.2, 0.34, 0.5]) if exercise_id == "7.2" else 0.0,
        mode="swap" if exercise_id == "7.3" else "recompute",
        cpu_blocks=rng.choice([1, 2, 3, 4, 5, 6, 50]) if exercise_id == "7.3" else 0,
    )
    return config


def engine_ops(exercise_id: str, seed: int, size: str) -> list:
    """One seeded engine workload (scenario = seed mod 5): a config, then bursts of adds, steps, aborts, resets."""
    rng = random.Random(f"{exercise_id}/{seed}")
    extra = random.Random(f"w{exercise_id}/{seed}")  # the widening draws: the first stream stays as it was
    scenarios = PRESSURE_FIRST if exercise_id in PREEMPTING else SCENARIOS
    scenario = scenarios[seed % len(scenarios)]
    config = engine_config(rng, exercise_id, scenario)
    _widen_config(extra, exercise_id, scenario, config)
    bs = config["block_size"]
    bases = [[rng.randint(1, 40) for _ in range(4 * bs + 3)] for _ in range(2)]
    ids = _request_ids(extra)
    seeds = _seed_ops(extra, exercise_id, seed, config, bases, ids)
    ops: list = [["config", {**config, "scenario": scenario}], ["reset"], ["step"], *seeds]  # an idle engine first
    count = 45 if size == "small" else 180
    next_id = len(seeds)
    while len(ops) < count:
        roll = rng.random()
        if roll < 0.4 or next_id == 0:
            for _ in range(rng.choice([1, 1, 2, 3, 5])):
                ops.append(_add_op(rng, exercise_id, scenario, config, bases, ids[next_id]))
                next_id += 1
        elif roll < 0.85:
            ops += [["step"]] * rng.choice([1, 1, 2])
            if exercise_id == "2.2" and extra.random() < 0.3:  # _admit on a request behind the head
                ops.append(["admit_at", extra.choice([1, 1, 2, 0])])
        elif (roll < 0.92 and exercise_id in ("7.4", "2.3", "3.4")) or roll < 0.88:
            ops.append(["abort", ids[rng.randrange(next_id + 1)], rng.choice(["ABORTED", "FAILED", "FINISHED"])])
        elif roll < 0.95:
            ops.append(["reset"])
        else:
            ops.append(["stale" if rng.random() < 0.5 else "missing"])
    ops += [["step"]] * (10 if size == "small" else 40)
    return [*ops, ["reset"], ["reset"]]  # drained: the first reset unpublishes, the second finds nothing


# exercises whose workloads start from a seeded running set, on these seeds (mod 5; the others run as before)
SEEDING = {"2.4": (0, 1, 3, 4), "2.5": (1, 3, 4), "2.6": (1, 3), "2.7": (1, 3, 4), "2.8": (1, 3, 4)}


def _widen_config(extra: random.Random, exercise_id: str, scenario: str, config: dict) -> None:
    """Knobs the contracts' edge cases need: tokens handed back as numpy/torch integers, tokens for sequences
    that sample nothing (to be ignored), swap mode under pressure for the planning exercises, blocks of
    several tokens where the watermark counts blocks, free() calls counted where 2.3's contract fixes them."""
    config["tokens_as"] = extra.choice(["int", "int", "numpy", "torch"])
    config["extra_tokens"] = extra.random() < 0.5
    config["count_frees"] = exercise_id == "2.3"  # "given back once": only 2.3's contract counts the calls
    if exercise_id == "7.2" and config["block_size"] == 1:
        config["block_size"] = extra.choice([2, 3, 4])  # tokens and blocks differ


def _request_ids(extra: random.Random) -> list[int]:
    """Request ids in arrival order: ascending, descending or shuffled (so "by id" differs from "by admission")."""
    ids = list(range(400))
    order = extra.choice(["up", "down", "shuffled"])
    if order == "down":
        ids.reverse()
    elif order == "shuffled":
        extra.shuffle(ids)
    return ids


def _seed_ops(extra: random.Random, exercise_id: str, seed: int, config: dict, bases: list, ids: list) -> list:
    """For SEEDING exercises on some seeds: requests put straight into the running set; then, often, a batch
    size they exceed, a cache they fill (every step preempts), swap mode (a victim keeps its tokens)."""
    if seed % 5 not in SEEDING.get(exercise_id, ()):
        return []
    count = extra.randint(2, 5)
    head = extra.random() < 0.6  # a long prefill at the head, or a random mix
    if ids[0] < ids[1]:
        ids.reverse()  # the oldest admission is not the lowest id
    seeds = [_seed_op(extra, config, bases, ids[i], first=head and i == 0) for i in range(count)]
    if extra.random() < 0.5:
        config["batch"] = extra.randint(1, count - 1)  # more running than the batch holds
    if extra.random() < 0.6:  # the cache the seeds fill, give or take a block
        bs = config["block_size"]
        held = sum(-(-op[5] // bs) for op in seeds)
        config["num_blocks"] = max(1, held + extra.choice([0, 0, 1]))
    if exercise_id in ("2.4", "2.6", "2.8") and extra.random() < 0.7:
        config.update(mode="swap", cpu_blocks=extra.choice([2, 4, 50]))
    return seeds


def _seed_op(extra: random.Random, config: dict, bases: list, rid: int, first: bool) -> list:
    """A request put straight into the running set (as the graded tests' helpers do): decoding, prefilling
    (several at once, which the scheduler alone never makes), or holding every token computed but no sample."""
    bs = config["block_size"]
    kind = "prefill" if first else extra.choice(["decode", "decode", "prefill", "prefill", "stuck"])
    prompt = _prompt(extra, bases, bs)
    if first:
        prompt = (prompt * (3 * bs + 2))[: 3 * bs + 2]  # a long prefill at the head: several victims may be needed
    outputs = [extra.randint(1, 40) for _ in range(extra.choice([1, 2]))] if kind == "decode" else []
    if kind == "prefill" and extra.random() < 0.4:
        outputs = [extra.randint(1, 40)]  # a recompute with outputs to re-feed
    if kind == "decode" and extra.random() < 0.5:  # its next decode starts a new block
        prompt = (prompt * (bs + 1))[: max(1, bs * extra.randint(1, 2) + 1 - len(outputs))]
    total = len(prompt) + len(outputs)
    if kind == "decode":
        computed = total - 1
    elif kind == "stuck":
        computed = total
    elif first:
        computed = extra.randint(0, bs)
    else:
        computed = extra.randint(0, max(0, total - 2))
    max_new = len(outputs) + extra.choice([1, 2, 5])
    return ["seed", rid, prompt, max_new, outputs, computed]


def _add_op(rng: random.Random, exercise_id: str, scenario: str, config: dict, bases: list, rid: int) -> list:
    """One request: a prompt that may share a prefix, may never fit, may come with outputs (resumed)."""
    bs = config["block_size"]
    prompt = _prompt(rng, bases, bs)
    if scenario == "prefix" and rng.random() < 0.5:
        prompt = list(rng.choice(bases)[: rng.choice([bs, 2 * bs, 2 * bs + 1, 4 * bs + 3])])
    if scenario == "budget":
        prompt = prompt[: rng.choice([1, 2, 5, 8, 13, 20])]
    if scenario == "pressure":
        prompt = prompt[: rng.choice([1, bs, 2 * bs])]
    if rng.random() < 0.08:  # can never fit
        prompt = prompt * (config["num_blocks"] * bs // len(prompt) + 2)
    outputs = [rng.randint(1, 40) for _ in range(rng.choice([0, 0, 0, 1, 3]))]
    extra = rng.choice([1, 1, 2, 3, 6] if scenario != "pressure" else [3, 5, 8, 12])
    max_new = len(outputs) + (extra if rng.random() < 0.95 else 0)
    if scenario == "pressure":  # long enough to grow into the others' memory, short enough to fit alone
        room = config["num_blocks"] * bs - len(prompt) - len(outputs)
        max_new = len(outputs) + max(1, min(extra, room * 3 // 4))
    if rng.random() < 0.12:  # at the edge: prompt + max_new fills the whole cache exactly, or one token more
        total = config["num_blocks"] * bs + rng.choice([-bs + 1, 0, 0, 1])
        outputs = [rng.randint(1, 40) for _ in range(rng.choice([1, 2, 3]))]
        prompt = (prompt * total)[: max(1, total // 2)]
        max_new = max(len(outputs) + 1, total - len(prompt))
    eos = rng.choice([None, None, None, sampled_token(rid, len(prompt) + len(outputs) + 1)])
    priority = rng.choice([0, 1, 2]) if exercise_id == "7.1" else 0
    arrival = float(rng.choice([0, 1, 2, rid]))
    return ["add", rid, prompt, max_new, outputs, eos, priority, arrival]


def manager_ops(exercise_id: str, seed: int, size: str) -> list:
    """One seeded manager workload: requests allocated chunk by chunk, sampled, looked up, forked, freed."""
    rng = random.Random(f"m{exercise_id}/{seed}")
    extra = random.Random(f"wm{exercise_id}/{seed}")  # the widening draws: the first stream stays as it was
    bs = rng.choice(BLOCK_SIZES)
    config = {"block_size": bs, "num_blocks": rng.choice([3, 5, 8, 16, 30]), "caching": True}
    # a hash that collides (4.1's own check runs without it: its hash is the one under test): blocks with equal
    # tokens get equal hashes whatever their prefix, and unequal tokens share one of `collide` values
    config["collide"] = 0 if exercise_id == "4.1" else extra.choice([0, 0, 3, 16])
    bases = [[rng.randint(1, 40) for _ in range(4 * bs + 3)] for _ in range(2)]
    ops: list = [["config", config]]
    alive: list[int] = []
    next_id = 0
    for _ in range(50 if size == "small" else 200):
        roll = rng.random()
        if roll < 0.2 or not alive:
            ops.append(["new", next_id, _prompt(rng, bases, bs)])
            if rng.random() < 0.3:  # an empty first allocation, then the real one: still ONE admission
                ops += [["alloc", next_id, 0], ["alloc", next_id, rng.choice([1, bs, 1000])]]
            elif extra.random() < 0.25:  # tokens computed elsewhere (a second tier), no prefix hits
                ops.append(["admit_ext", next_id, extra.choice([1, bs, bs + 1]), extra.choice([1, bs, 1000])])
            alive.append(next_id)
            next_id += 1
            continue
        rid = rng.choice(alive)
        if roll < 0.35:
            ops.append(["admit", rid, rng.choice([1, 2, bs, 3 * bs, 1000])])
        elif roll < 0.45:
            ops.append(["alloc", rid, rng.choice([0, 1, 1, 2, bs - 1, bs, bs + 1, 5 * bs])])
            if extra.random() < 0.5:  # could the rest come now? (computed tokens count)
                ops.append(["can", rid, extra.choice([bs, 3 * bs, 1000])])
            if extra.random() < 0.2:  # slots for tokens not sampled yet: only known tokens are published
                ops.append(["ahead", rid, extra.choice([1, bs, 2 * bs + 1])])
            if extra.random() < 0.1:
                ops.append(["offer", extra.randrange(8)])
        elif roll < 0.65:
            ops.append(["decode", rid] if rng.random() < 0.7 else ["sample", rid])
        elif roll < 0.72:
            ops.append(["free", rid])
        elif roll < 0.78:
            ops.append(["lookup", rid])
        elif roll < 0.9:
            if rng.random() < 0.5:
                parent = rid
                ops.append(["fork", rid, next_id])
            else:  # the parent's table already covers its planned tokens: the child writes into shared blocks
                parent = next_id  # a new parent whose table covers its planned prompt, not computed yet
                ops += [["new", parent, _prompt(rng, bases, bs) + [1] * (2 * bs + 1)], ["reserve", parent]]
                alive.append(parent)
                next_id += 1
                ops += [["forknow", parent, next_id], ["alloc_b", next_id]]
            n = rng.choice([0, 1, bs - 1, bs, bs + 1, 2 * bs])
            ops += [["can", next_id, n], ["alloc", next_id, n]]
            if extra.random() < 0.5:  # parent and child grow apart past a block boundary, taking turns
                ops += [["decode", who] for _ in range(min(bs + 1, 4)) for who in (parent, next_id)]
            alive.append(next_id)
            next_id += 1
        elif roll < 0.92:
            ops.append(["can", rid, rng.choice([0, 1, bs, 4 * bs])])
        elif roll < 0.94:
            ops.append(["take"])
        elif roll < 0.97:
            ops.append(["reset"])
        else:
            ops.append(["finish", rid])
    return ops


def hash_ops(exercise_id: str, seed: int, size: str) -> list:
    """Hash-chain calls: equal inputs, neighbours that differ by one token, order, parent, huge ids, and
    blocks whose tokens' digits read alike ([1, 23] and [12, 3])."""
    rng = random.Random(f"h{exercise_id}/{seed}")
    extra = random.Random(f"wh{exercise_id}/{seed}")
    ops: list = [["config", {}]]
    for _ in range(2):
        digits = "".join(str(extra.randint(1, 9)) for _ in range(extra.randint(3, 6)))
        cuts = sorted(extra.sample(range(1, len(digits)), 2))
        one = [int(digits[: cuts[0]]), int(digits[cuts[0] :])]
        two = [int(digits[: cuts[1]]), int(digits[cuts[1] :])]
        ops += [["block", None, one], ["block", None, two]]
    for _ in range(12 if size == "small" else 60):
        bs = rng.choice([1, 2, 3, 4, 16])
        tokens = [rng.choice([rng.randint(0, 40), rng.randint(65_536, 400_000), 2**31 + 5]) for _ in range(bs)]
        ops.append(["chain", bs, tokens * rng.randint(1, 3) + tokens[: rng.randint(0, bs)]])
        swapped = tokens[::-1] if len(set(tokens)) > 1 else [tokens[0] + 65_536]
        ops.append(["chain", bs, swapped * 2])
        ops.append(["block", rng.choice([None, 0, 1]), tokens])
    return ops


def costs_ops(exercise_id: str, seed: int, size: str) -> list:
    """7.3's cost model: latencies and bandwidths from tiny to huge, token counts from 0."""
    rng = random.Random(f"c{exercise_id}/{seed}")
    ops: list = [["config", {}]]
    for _ in range(6 if size == "small" else 30):
        costs = [
            rng.choice([36_864, 147_456, 1]),
            rng.choice([1e6, 16e9, 64e9]),
            rng.choice([0.0, 1e-5, 1e-3, 0.05]),
            rng.choice([2.5e8, 1e9, 2e6]),
            rng.choice([1e9, 1e12, 3e14]),
        ]
        ops.append(["costs", costs, rng.choice([0, 1, 7, 500, 4096]), rng.choice([1, 10, 300, 5000])])
    # exact ties (every number exact in binary): equal at every n, so never strictly cheaper; equal at n = 1 only
    ops += [["costs", [1, 2.0, 0.0, 1.0, 1.0], 3, 10], ["costs", [1, 1.0, 1.0, 4.0, 1.0], 1, 10]]
    return ops


# ---------------------------------------------------------------------------------------------- drivers
def _request(op: list) -> Request:
    """A Request from an "add" op."""
    _, rid, prompt, max_new, outputs, eos, priority, arrival = op
    return Request(
        id=rid,
        prompt_tokens=list(prompt),
        max_new_tokens=max_new,
        output_tokens=list(outputs),
        eos_token_id=eos,
        priority=priority,
        arrival_time=arrival,
    )


def run_engine(ops: list, modules: Mapping[str, ModuleType]) -> list[dict]:
    """Drive scheduler + manager with the ops; one record per call."""
    config = ops[0][1]
    files = module_files(modules)
    records: list[dict] = []
    canon = Canon()
    manager = modules["kv_cache"].KVCacheManager(config["num_blocks"], config["block_size"], config["caching"])
    scheduler = modules["scheduler"].StallFreeScheduler(
        config["budget"],
        config["batch"],
        manager,
        policy=config["policy"],
        watermark=config["watermark"],
        preemption_mode=config["mode"],
        num_cpu_blocks=config["cpu_blocks"],
    )
    requests: dict[int, Request] = {}
    last = None
    frees = _count_frees(manager) if config.get("count_frees") else None
    counter = HashCounter(modules["kv_cache"])
    try:
        for index, op in enumerate(ops[1:], start=1):
            kind = op[0]
            try:
                if kind == "add":
                    request = _request(op)
                    requests[request.id] = request
                    scheduler.add_request(request)
                    records.append({"step": index, "call": "add_request", "obs": {"returned": None}})
                elif kind == "seed":
                    placed = _seed(op, scheduler, manager, requests)
                    records.append({"step": index, "call": "a running request placed", "obs": {"returned": placed}})
                elif kind in ("step", "admit_at"):
                    if kind == "step":
                        output = scheduler.schedule_next_batch()
                    else:  # one admission of the request at this place in the queue, applied as a step
                        if len(scheduler.waiting_queue) <= op[1]:
                            continue
                        output = _admit_one(scheduler, scheduler.waiting_queue[op[1]])
                    last = output
                    records.append({"step": index, "call": _call_name(op), "obs": plan(output)})
                    sampled = _executor_tokens(output, config)
                    done = scheduler.update_from_output(output, sampled)
                    records.append({"step": index, "call": "update_from_output", "obs": {"returned": _ids(done)}})
                elif kind == "abort":
                    status = RequestStatus[op[2]]
                    done = scheduler.finish_requests(op[1], status, f"stopped ({op[2].lower()})")
                    records.append(
                        {"step": index, "call": f"finish_requests({op[1]})", "obs": {"returned": _ids(done)}}
                    )
                elif kind == "reset":
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        answer = manager.reset_prefix_cache()
                    records.append({"step": index, "call": "reset_prefix_cache", "obs": {"returned": plain(answer)}})
                elif kind in ("stale", "missing") and last is not None:
                    sampled = {} if kind == "missing" else {s.request_id: 5 for s in last}
                    done = scheduler.update_from_output(last, sampled)
                    call = (
                        "update_from_output (the same plan again)"
                        if kind == "stale"
                        else "update_from_output (no tokens)"
                    )
                    records.append({"step": index, "call": call, "obs": {"returned": _ids(done)}})
                else:
                    continue
            except Exception as error:
                records.append({"step": index, "call": _call_name(op), **error_record(error, files)})
            try:
                state = snap_scheduler(scheduler, requests, canon)
                state["hashes_computed"] = counter.count
                if frees is not None:
                    state["frees"] = sorted([k, v] for k, v in frees.items())
                records.append({"step": index, "call": "state after " + _call_name(op), "obs": state})
            except Exception as error:
                records.append({"step": index, "call": "state", **error_record(error, files)})
                break
    finally:
        counter.restore()
    return records


def _token(value: int, kind: str) -> object:
    """A sampled token as the executor hands it back: a Python int, a numpy integer or a torch scalar."""
    if kind == "numpy":
        import numpy

        return numpy.int64(value)
    if kind == "torch":
        import torch

        return torch.tensor(value)
    return value


def _executor_tokens(output, config: Mapping) -> dict:
    """The fake executor's tokens: one per sampling sequence; with extra_tokens, also one for each sequence
    that samples nothing (a prefill chunk short of the end), which update_from_output must ignore."""
    kind = config.get("tokens_as", "int")
    return {
        s.request_id: _token(sampled_token(s.request_id, s.position_ids_start + len(s.tokens)), kind)
        for s in output
        if s.samples_token or config.get("extra_tokens")
    }


def _seed(op: list, scheduler, manager, requests: dict[int, Request]) -> bool:
    """Put a request straight into the running set with its computed tokens' blocks (False: no room)."""
    _, rid, prompt, max_new, outputs, computed = op
    request = Request(id=rid, prompt_tokens=list(prompt), max_new_tokens=max_new, output_tokens=list(outputs))
    if manager.allocate_slots(request, computed) is None:
        return False
    request.num_computed_tokens = computed
    request.status = RequestStatus.RUNNING
    requests[rid] = request
    scheduler._known_ids.add(rid)
    scheduler.active_pool[rid] = request
    return True


def _admit_one(scheduler, request: Request):
    """_admit (2.2) on one waiting request, wherever it is in the queue, then the plan applied: a step."""
    from kvcourse.core.sched_output import SchedulerOutput

    output = SchedulerOutput(block_ids={}, finished_req_ids=[])
    scheduler._admit(request, scheduler.token_budget, output)
    scheduler._update_after_schedule(output)
    return output


def _count_frees(manager) -> dict[int, int]:
    """Count manager.free() calls per request id (2.3: a request's blocks are given back once)."""
    counts: dict[int, int] = {}
    original = manager.free

    def free(request):
        counts[request.id] = counts.get(request.id, 0) + 1
        return original(request)

    manager.free = free
    return counts


def _ids(done) -> object:
    """The ids of a returned list of requests (plain data), or the value itself."""
    try:
        return [r.id for r in done]
    except Exception:
        return plain(done)


def _call_name(op: list) -> str:
    """A readable name for an op."""
    return {
        "add": "add_request",
        "step": "schedule_next_batch",
        "admit_at": "_admit (a request behind the head), then the plan applied",
        "seed": "a running request placed",
        "ahead": "allocate_slots (past the known tokens)",
        "admit_ext": "allocate_slots (tokens computed elsewhere, no hits)",
        "offer": "block_pool.cache_full_blocks (a published block offered again)",
        "abort": "finish_requests",
        "reset": "reset_prefix_cache",
        "stale": "update_from_output",
        "missing": "update_from_output",
        "admit": "get_computed_blocks + allocate_slots",
        "alloc": "allocate_slots",
        "reserve": "allocate_slots (planned, not computed yet)",
        "alloc_b": "allocate_slots (up to a block boundary)",
        "forknow": "fork",
        "decode": "a sampled token, then allocate_slots(request, 1)",
        "lookup": "get_computed_blocks",
        "can": "can_allocate",
        "take": "take_pending_copies",
        "chain": "hash_request_tokens",
        "block": "hash_block_tokens",
        "costs": "swap_seconds / recompute_seconds / swap_crossover",
    }.get(op[0], op[0])


def run_manager(ops: list, modules: Mapping[str, ModuleType]) -> list[dict]:
    """Drive the KV-cache manager directly with the ops; one record per call."""
    config = ops[0][1]
    files = module_files(modules)
    kv = modules["kv_cache"]
    manager = kv.KVCacheManager(config["num_blocks"], config["block_size"], config["caching"])
    canon = Canon()
    requests: dict[int, Request] = {}
    records: list[dict] = []
    counter = HashCounter(kv, config.get("collide", 0))
    try:
        for index, op in enumerate(ops[1:], start=1):
            try:
                answer = _manager_call(op, manager, requests, canon)
                if answer is _SKIP:
                    continue
                records.append({"step": index, "call": _call_name(op) + f"{op[1:2]}", "obs": {"returned": answer}})
            except Exception as error:
                records.append({"step": index, "call": _call_name(op), **error_record(error, files)})
            try:
                state = snap_manager(manager, requests, canon)
                state["computed"] = [[rid, r.num_computed_tokens] for rid, r in sorted(requests.items())]
                state["hashes_computed"] = counter.count
                records.append({"step": index, "call": "state after " + _call_name(op), "obs": state})
            except Exception as error:
                records.append({"step": index, "call": "state", **error_record(error, files)})
                break
    finally:
        counter.restore()
    return records


_SKIP = object()


def _manager_call(op: list, manager, requests: dict[int, Request], canon: Canon) -> object:
    """One manager op (the scheduler's side of it done by hand); returns plain data, or _SKIP."""
    kind = op[0]
    if kind == "new":
        requests[op[1]] = Request(id=op[1], prompt_tokens=list(op[2]), max_new_tokens=10_000)
        return _SKIP
    if kind == "take":
        return [list(c) for c in manager.take_pending_copies()]
    if kind == "reset":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return plain(manager.reset_prefix_cache())
    if kind == "offer":
        return _offer(manager, op[1])
    request = requests.get(op[1])
    if request is None or request.status.is_finished():
        return _SKIP
    if kind == "admit_ext":  # an admission whose first tokens were computed elsewhere: no hits
        if op[1] in manager.req_to_blocks or request.num_computed_tokens or request.num_tokens < 2:
            return _SKIP
        k = min(op[2], request.num_tokens - 1)
        n = min(op[3], request.num_tokens - k)
        blocks = manager.allocate_slots(request, n, k)
        if blocks is not None:
            request.num_computed_tokens = k + n
        return None if blocks is None else blocks.get_block_ids()
    if kind == "admit":
        if op[1] in manager.req_to_blocks or request.num_computed_tokens:
            return _SKIP
        hits, num_hit = manager.get_computed_blocks(request)
        n = min(op[2], request.num_tokens - num_hit)
        blocks = manager.allocate_slots(request, n, num_hit, hits)
        if blocks is not None:
            request.num_computed_tokens = num_hit + n
        return [num_hit, [b.block_id for b in hits.blocks], None if blocks is None else blocks.get_block_ids()]
    if kind in ("alloc", "alloc_b"):  # alloc_b: up to the next block boundary
        to_boundary = manager.block_size - request.num_computed_tokens % manager.block_size
        n = min(op[2] if kind == "alloc" else to_boundary, request.num_uncomputed_tokens)
        blocks = manager.allocate_slots(request, n)
        if blocks is not None:
            request.num_computed_tokens += n
        return None if blocks is None else blocks.get_block_ids()
    if kind in ("sample", "decode"):
        if request.num_uncomputed_tokens:
            return _SKIP
        request.output_tokens.append(sampled_token(request.id, request.num_tokens))
        if kind == "sample":
            return None
        blocks = manager.allocate_slots(request, 1)
        if blocks is not None:
            request.num_computed_tokens += 1
        return None if blocks is None else blocks.get_block_ids()
    if kind == "free":
        manager.free(request)
        request.num_computed_tokens = 0
        return None
    if kind == "finish":
        request.status = RequestStatus.FINISHED
        manager.free(request)
        return None
    if kind == "lookup":
        if op[1] in manager.req_to_blocks:
            return _SKIP
        hits, num_hit = manager.get_computed_blocks(request)
        return [num_hit, [b.block_id for b in hits.blocks]]
    if kind == "can":
        return plain(manager.can_allocate(request, min(op[2], request.num_uncomputed_tokens)))
    if kind == "ahead":  # slots past the known tokens (not computed): only blocks of known tokens are published
        blocks = manager.allocate_slots(request, request.num_uncomputed_tokens + op[2])
        return None if blocks is None else blocks.get_block_ids()
    if kind == "reserve":  # a step planned (its blocks allocated) but not computed yet
        blocks = manager.allocate_slots(request, request.num_uncomputed_tokens)
        return None if blocks is None else blocks.get_block_ids()
    if kind == "forknow" and op[1] not in manager.req_to_blocks:
        return _SKIP
    if kind == "fork":  # the parent is first computed to its end (admitted, or its rest allocated)
        ready = _compute_all(manager, request)
        if ready is not True:
            return ready
    if kind in ("fork", "forknow"):
        child = Request(id=op[2], prompt_tokens=list(request.prompt_tokens), max_new_tokens=10_000)
        child.output_tokens = list(request.output_tokens)
        child.num_computed_tokens = request.num_computed_tokens
        requests[child.id] = child
        manager.fork(request, child)
        return None
    raise ValueError(f"unknown op {op!r}")


def _offer(manager, which: int) -> object:
    """4.2's pool contract: a block already published, offered again under another hash, keeps its first one."""
    published = [b for b in manager.block_pool.blocks if b.block_hash is not None]
    if not published:
        return _SKIP
    block = published[which % len(published)]
    manager.block_pool.cache_full_blocks([block], [b"offered again %d" % which], [list(block.token_ids)])
    return block.block_id


def _compute_all(manager, request: Request) -> object:
    """Allocate whatever the request has not computed (admitting it if it holds nothing): True, or the refusal."""
    if request.id not in manager.req_to_blocks and not request.num_computed_tokens:
        hits, num_hit = manager.get_computed_blocks(request)
        blocks = manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, hits)
        if blocks is None:
            return ["admission refused", num_hit]
        request.num_computed_tokens = request.num_tokens
        return True
    if request.num_uncomputed_tokens:
        n = request.num_uncomputed_tokens
        if manager.allocate_slots(request, n) is None:
            return ["refused", n]
        request.num_computed_tokens += n
    return True


def run_hashes(ops: list, modules: Mapping[str, ModuleType]) -> list[dict]:
    """Call the hash chain directly; hashes are named by first appearance (the digest itself is free)."""
    kv = modules["kv_cache"]
    files = module_files(modules)
    canon = Canon()
    records: list[dict] = []
    chains: list = []
    for index, op in enumerate(ops[1:], start=1):
        try:
            if op[0] == "chain":
                chain = kv.hash_request_tokens(op[1], list(op[2]))
                chains.append(chain)
                again = kv.hash_request_tokens(op[1], list(op[2]))
                obs = {"returned": [canon(h) for h in chain], "again": [canon(h) for h in again]}
                obs["types"] = sorted({type(h).__name__ for h in chain})
            else:
                parent = None if op[1] is None or not chains or not chains[-1] else chains[-1][0]
                if op[1] == 1 and parent is not None:
                    parent = kv.hash_block_tokens(None, [1])
                value = kv.hash_block_tokens(parent, list(op[2]))
                as_tuple = kv.hash_block_tokens(parent, tuple(op[2]))
                obs = {"returned": canon(value), "tuple_input": canon(as_tuple), "types": type(value).__name__}
            records.append({"step": index, "call": _call_name(op), "obs": obs})
        except Exception as error:
            records.append({"step": index, "call": _call_name(op), **error_record(error, files)})
    return records


def run_costs(ops: list, modules: Mapping[str, ModuleType]) -> list[dict]:
    """7.3's three functions on each cost model."""
    sched = modules["scheduler"]
    files = module_files(modules)
    records: list[dict] = []
    for index, op in enumerate(ops[1:], start=1):
        costs = PreemptionCosts(*op[1])
        try:
            obs = {
                "swap_seconds": float(sched.swap_seconds(op[2], costs)),
                "recompute_seconds": float(sched.recompute_seconds(op[2], costs)),
                "swap_crossover": plain(sched.swap_crossover(costs, op[3])),
            }
            records.append({"step": index, "call": _call_name(op), "obs": obs})
        except Exception as error:
            records.append({"step": index, "call": _call_name(op), **error_record(error, files)})
    return records


def guarded(runner):
    """Run a driver under the time limit; a timeout becomes the last record."""

    def run(ops: list, modules: Mapping[str, ModuleType]) -> list[dict]:
        from .core import OBSERVE_TIMEOUT_S, WorkloadTimeout

        try:
            with time_limit(OBSERVE_TIMEOUT_S):
                return runner(ops, modules)
        except WorkloadTimeout as error:
            return [{"step": -1, "call": "the whole workload", "error": "WorkloadTimeout", "message": str(error)}]

    return run
