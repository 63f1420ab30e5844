"""Workloads for the second tier (8.1-8.5): a CPUOffloadTier driven directly, and a scheduler with a tier.

8.1-8.3: `run_tier` offers evicted blocks (new, already held, colliding, into a full or pinned tier), asks
how much of a request the tier holds, and queues loads after an allocation during which offers may drop
entries. What 8.1 leaves free is normalised after every offer, on both sides alike, so the runs stay in
lockstep: a re-offered block is made the most recently used (the contract lets it stay where it was), and
a full tier that refused a newcomer is made to drop as the contract describes (it may refuse). Which free
slot a newcomer takes is free too: a slot is named by the entry holding it, never by its number.
8.4-8.5: `run_tier_engine` steps a StallFreeScheduler whose manager evicts into a tier: prompts share
prefixes, a small device pool evicts them, later requests load them back (WAITING_FOR_REMOTE_KVS).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from types import ModuleType

from kvcourse.core.contract import KVCacheBlocks
from kvcourse.core.kv_cache_utils import KVCacheBlock
from kvcourse.core.request import Request, RequestStatus

from .core import error_record, module_files, plain
from .engine import Canon, plan, sampled_token, snap_scheduler


# ---------------------------------------------------------------------------------------------- 8.1-8.3
def chain_of(block_size: int) -> Callable[[list[int]], list[bytes]]:
    """A hash per full block naming its whole prefix; ids 1000 apart collide (same hash, other tokens)."""

    def chain(token_ids: list[int]) -> list[bytes]:
        folded = [t % 1000 for t in token_ids]
        return [repr(tuple(folded[: (i + 1) * block_size])).encode() for i in range(len(folded) // block_size)]

    return chain


def tier_ops(exercise_id: str, seed: int, size: str) -> list:
    """Seeded tier calls: offers (runs of a prompt, held, colliding), steps ending, questions, loads after offers."""
    rng = random.Random(f"t{exercise_id}/{seed}")
    bs = rng.choice([1, 2, 3, 4])
    prompts = [[rng.randint(1, 40) for _ in range(7 * bs + 2)] for _ in range(3)]
    prompts[1][: 3 * bs] = prompts[0][: 3 * bs]  # a shared prefix
    config = {"block_size": bs, "num_blocks": rng.choice([1, 2, 3, 5, 8]), "prompts": prompts}
    ops: list = [["config", config]]
    device, run = 0, [0, 0, 1]  # the latest run offered: (prompt, first block, blocks): questions aim at it
    for _ in range(40 if size == "small" else 160):
        roll = rng.random()
        if roll < 0.25:
            device += 1
            ops.append(["offer", device, rng.randrange(3), rng.randrange(7), rng.random() < 0.12])
        elif roll < 0.42:  # a finished request's blocks evicted in order, as the pool does
            prompt, first, count = rng.randrange(3), rng.randrange(4), rng.randint(2, 4)
            for i in range(first, first + count):
                device += 1
                ops.append(["offer", device, prompt, i, False])
            held = min(count, config["num_blocks"])  # a small tier keeps the run's last blocks only
            run = [prompt, first + count - held, held]
            if rng.random() < 0.6:  # ... and a request wants them back at once
                device = _load(rng, ops, bs, run, device)
        elif roll < 0.55:
            ops.append(["take"])
        elif roll < 0.7:
            ops.append(["ask", *_question(rng, bs, run)])
        else:
            device = _load(rng, ops, bs, run, device)
    return ops


def _load(rng: random.Random, ops: list, bs: int, run: list, device: int) -> int:
    """A load op: a question, the evictions its allocation causes (a drop, an asked block colliding), new ids."""
    question = _question(rng, bs, run)
    between = []
    for own in rng.choice([[], [False], [False, True], [False, True], [True], [False, False, True], [True, False]]):
        device += 1
        where = [question[0], question[2], rng.random() < 0.7] if own else [rng.randrange(3), rng.randrange(7), False]
        between.append([device, *where])
    ops.append(["load", *question, between, device + 1])
    return device + 8


def _question(rng: random.Random, bs: int, run: list) -> list:
    """(prompt, length, device hit blocks, outputs, collide): mostly a request whose next blocks the tier got."""
    if rng.random() < 0.7:
        prompt, hits = run[0], rng.choice([run[1], run[1], run[1], max(0, run[1] - 1), run[1] + 1])
        length = min(7 * bs + 2, (run[1] + run[2]) * bs + rng.choice([0, 1, bs, 2 * bs]))
        length = max(length, hits * bs + 1)
    else:
        prompt, length = rng.randrange(3), rng.randint(1, 7 * bs + 2)
        hits = rng.choice([0, 0, 1, 2]) if length > 2 * bs else 0
    return [prompt, length, hits, rng.choice([0, 0, 1, 3]), rng.random() < 0.1]


def _tokens(config: dict, prompt: int, length: int, collide: bool) -> list[int]:
    """A request's tokens, a prompt's prefix; `collide` shifts one block by 1000 (same hashes, other tokens)."""
    tokens = list(config["prompts"][prompt][:length])
    if collide and len(tokens) > config["block_size"]:
        bs = config["block_size"]
        i = (len(tokens) // bs - 1) * bs
        tokens[i : i + bs] = [t + 1000 for t in tokens[i : i + bs]]
    return tokens


def _evicted(config: dict, block_id: int, prompt: int, index: int, collide: bool) -> KVCacheBlock:
    """The device block `index` of a prompt, full and published, being evicted."""
    bs, tokens = config["block_size"], config["prompts"][prompt]
    own = tokens[index * bs : (index + 1) * bs]
    own = [t + 1000 for t in own] if collide else own
    block_hash = chain_of(bs)(tokens[: (index + 1) * bs])[index]
    return KVCacheBlock(block_id, block_hash=block_hash, token_ids=tuple(own))


def _request(config: dict, rid: int, question: list) -> Request:
    """A Request for a question (prompt, length, hits, outputs, collide): its last `outputs` tokens generated."""
    prompt, length, _, outputs, collide = question
    tokens = _tokens(config, prompt, length, collide)
    cut = max(1, len(tokens) - outputs)
    return Request(id=rid, prompt_tokens=tokens[:cut], max_new_tokens=outputs + 4, output_tokens=tokens[cut:])


def offer(tier, block: KVCacheBlock, entry_class: type) -> None:
    """tier.offer(block), then what 8.1 leaves free made canonical (the reference's choice) on either side."""
    held, full = block.block_hash in tier.entries, not tier.free_slots
    before = list(tier.entries)
    victim = next((h for h, e in tier.entries.items() if e.slot not in tier.pinned), None)
    num_saves = len(tier.pending_saves)
    tier.offer(block)
    if held and block.block_hash in tier.entries:
        tier.entries.move_to_end(block.block_hash)  # free: whether a re-offer refreshes recency
    refused = list(tier.entries) == before and len(tier.pending_saves) == num_saves
    if not held and full and victim is not None and refused:  # free: a full tier may refuse the newcomer
        slot = tier.entries.pop(victim).slot
        tier.stats.dropped += 1
        tier.entries[block.block_hash] = entry_class(slot, tuple(block.token_ids))
        tier.pending_saves.append((block.block_id, slot))


def snap_tier(tier, canon: Canon) -> dict:
    """What 8.1-8.3 fix of the tier: entries in LRU order with their tokens, transfers, pins, slots, stats."""
    holder = {entry.slot: canon(h) for h, entry in tier.entries.items()}

    def slot(number: int) -> str:
        return f"slot of {holder[number]}" if number in holder else "a slot no entry holds"

    used = [entry.slot for entry in tier.entries.values()]
    stats = tier.stats
    return {
        "lru": [[canon(h), list(entry.token_ids)] for h, entry in tier.entries.items()],
        "saves": [[block, slot(s)] for block, s in tier.pending_saves],
        "loads": [[slot(s), block] for s, block in tier.pending_loads],
        "pinned": sorted(slot(s) for s in tier.pinned),
        "slots": sorted(used + list(tier.free_slots)) == list(range(tier.num_blocks)),
        "tier_stats": [stats.offered, stats.saved, stats.dropped, stats.loaded, stats.failed],
    }


def run_tier(ops: list, modules: Mapping[str, ModuleType]) -> list[dict]:
    """Drive a CPUOffloadTier directly; one record per call, the tier's state after each."""
    config = ops[0][1]
    offload, files = modules["offload"], module_files(modules)
    tier = offload.CPUOffloadTier(config["num_blocks"], config["block_size"],
                                  lambda r: chain_of(config["block_size"])(r.all_token_ids))  # fmt: skip
    canon, records, bs = Canon(), [], config["block_size"]
    for index, op in enumerate(ops[1:], start=1):
        kind = op[0]
        try:
            if kind == "offer":
                block = _evicted(config, *op[1:])
                offer(tier, block, offload.TierEntry)
                obs: dict = {"returned": canon(block.block_hash)}
            elif kind == "take":
                saves, loads = tier.take_transfers()
                obs = {"returned": [len(saves), len(loads)]}
            else:
                request = _request(config, index, op[1:6])
                hits = op[3] * bs
                found = tier.get_num_new_matched_tokens(request, hits)
                obs = {"matched": plain(found)}
                if kind == "load":
                    for block_id, *where in op[6]:  # the allocation evicts blocks into the tier meanwhile
                        offer(tier, _evicted(config, block_id, *where), offload.TierEntry)
                    request.num_computed_tokens = hits
                    count = found // bs if isinstance(found, int) else 0
                    if count:  # the scheduler asks for loads only when the tier said it holds some
                        blocks = KVCacheBlocks([KVCacheBlock(op[7] + i) for i in range(count)])
                        obs["will_load"] = plain(tier.update_state_after_alloc(request, blocks, count * bs))
            records.append({"step": index, "call": _name(op), "obs": {**obs, **snap_tier(tier, canon)}})
        except Exception as error:
            records.append({"step": index, "call": _name(op), **error_record(error, files)})
            break
    return records


def _name(op: list) -> str:
    """A readable name for a tier op."""
    return {
        "offer": "offer",
        "take": "take_transfers (the step ends)",
        "ask": "get_num_new_matched_tokens",
        "load": "get_num_new_matched_tokens, offers, update_state_after_alloc",
    }[op[0]] + f"{op[1:3]}"


# ---------------------------------------------------------------------------------------------- 8.4-8.5
_SCHEDULERS: dict[tuple, type] = {}


def tier_scheduler(modules: Mapping[str, ModuleType]) -> type:
    """StallFreeScheduler with THIS side's SecondTierScheduling (the exercise's module, not kvcourse.offload),
    each 8.4 / 8.5 call logged with the state it leaves (a slip the next step hides still shows)."""
    base, mixin = modules["scheduler"].StallFreeScheduler, modules["offload"].SecondTierScheduling
    key = (id(base), id(mixin))
    if key not in _SCHEDULERS:
        methods = {name: value for name, value in vars(mixin).items() if callable(value)}
        start_load, admit_loaded = methods["_start_load"], methods["_admit_loaded"]

        def _start_load(self, request: Request) -> bool | None:
            result = start_load(self, request)
            self.calls.append(["_start_load", request.id, plain(result), *_where(self, request)])
            return result

        def _admit_loaded(self, request: Request, token_budget_left: int, output) -> bool:
            result = admit_loaded(self, request, token_budget_left, output)
            self.calls.append(["_admit_loaded", request.id, plain(result), *_where(self, request)])
            return result

        methods.update(_start_load=_start_load, _admit_loaded=_admit_loaded)
        _SCHEDULERS[key] = type("TierScheduler", (base,), methods)
    return _SCHEDULERS[key]


def _where(scheduler, request: Request) -> list:
    """Right after an 8.4 / 8.5 call: status, computed tokens, queued, loading, loaded, running, its table."""
    return [
        request.status.name,
        request.num_computed_tokens,
        any(r is request for r in scheduler.waiting_queue),
        plain(scheduler.loading[request.id][1]) if request.id in scheduler.loading else None,
        request.id in scheduler.loaded,
        request.id in scheduler.active_pool,
        scheduler.kv_cache_manager.get_block_ids(request),
    ]


def tier_engine_ops(exercise_id: str, seed: int, size: str) -> list:
    """A small device pool that evicts into a tier, prompts sharing long prefixes, preemption and aborts."""
    rng = random.Random(f"e{exercise_id}/{seed}")
    bs = rng.choice([1, 2, 3, 4])
    config = {"block_size": bs, "num_blocks": rng.choice([6, 8, 10, 14]), "tier_blocks": rng.choice([2, 4, 8, 30]),
              "budget": rng.choice([3, 5, 8, 10**6]), "batch": rng.choice([2, 3, 8])}  # fmt: skip
    bases = [[rng.randint(1, 40) for _ in range(4 * bs + 1)] for _ in range(3)]
    ops: list = [["config", config]]
    next_id = 0
    while len(ops) < (50 if size == "small" else 200):
        roll = rng.random()
        if roll < 0.35 or next_id == 0:
            base = rng.choice(bases)
            cut = rng.choice([bs + 1, 2 * bs + 1, 3 * bs, 4 * bs + 1, len(base)])
            prompt = base[:cut] + [rng.randint(1, 40) for _ in range(rng.choice([0, 0, 1, bs]))]
            ops.append(["add", next_id, prompt, rng.choice([1, 2, 3, 5])])
            next_id += 1
        elif roll < 0.92:
            ops += [["step"]] * rng.choice([1, 2, 3])
        else:
            ops.append(["abort", rng.randrange(next_id)])
    return [*ops, *[["step"]] * (12 if size == "small" else 40)]


def run_tier_engine(ops: list, modules: Mapping[str, ModuleType]) -> list[dict]:
    """Step a scheduler whose manager evicts into a tier; the plan, its transfers and the state after each call."""
    config = ops[0][1]
    files = module_files(modules)
    manager = modules["kv_cache"].KVCacheManager(config["num_blocks"], config["block_size"], True)
    tier = modules["offload"].make_tier(manager, config["tier_blocks"])
    scheduler = tier_scheduler(modules)(config["budget"], config["batch"], manager, kv_connector=tier)
    scheduler.calls = []
    requests: dict[int, Request] = {}
    canon, records = Canon(), []
    for index, op in enumerate(ops[1:], start=1):
        try:
            if op[0] == "add":
                requests[op[1]] = Request(id=op[1], prompt_tokens=list(op[2]), max_new_tokens=op[3])
                scheduler.add_request(requests[op[1]])
                obs: dict = {"returned": None}
            elif op[0] == "abort":
                done = scheduler.finish_requests(op[1], RequestStatus.ABORTED, "stopped")
                obs = {"returned": [r.id for r in done]}
            else:
                scheduler.calls = []
                output = scheduler.schedule_next_batch()
                obs = {"calls": scheduler.calls, **plan(output), "kv_saves": plain(output.kv_saves), "kv_loads": plain(output.kv_loads),
                       "loading_req_ids": list(output.loading_req_ids)}  # fmt: skip
                sampled = {s.request_id: sampled_token(s.request_id, s.position_ids_start + len(s.tokens))
                           for s in output if s.samples_token}  # fmt: skip
                obs["returned"] = [r.id for r in scheduler.update_from_output(output, sampled)]
            records.append({"step": index, "call": _engine_name(op), "obs": obs})
        except Exception as error:
            records.append({"step": index, "call": _engine_name(op), **error_record(error, files)})
        try:
            state = snap_scheduler(scheduler, requests, canon)
            state["loading"] = [[rid, tokens] for rid, (_, tokens) in scheduler.loading.items()]
            state["loaded"] = sorted(scheduler.loaded)
            state["lru"] = [canon(h) for h in tier.lru_order()]
            records.append({"step": index, "call": "state after " + _engine_name(op), "obs": state})
        except Exception as error:
            records.append({"step": index, "call": "state", **error_record(error, files)})
            break
    return records


def _engine_name(op: list) -> str:
    """A readable name for an engine op."""
    return {"add": "add_request", "abort": "finish_requests", "step": "schedule_next_batch + update_from_output"}[op[0]]
