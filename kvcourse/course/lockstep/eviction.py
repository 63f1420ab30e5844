"""Workloads for the eviction policies (4.7): a ranked pool driven directly, and a manager on each policy.

What 4.7's contract fixes, and so what is compared: which free blocks get_new_blocks hands out, in order
(the policy's ranking, never a block a hit revived, a block freed again ranked by its LAST free), the free
queue and the holders (the victim stays queued until get_new_blocks takes it), and which heap entries are
left (each entry is looked at once: the victim's and every stale one met on the way leave the heap).
What it leaves free: the key's own form (any tuple that ranks the same), so heap entries are compared as
(tick, block id) only, never by their key.
"""

from __future__ import annotations

import random
import sys
import types
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

from .core import _load_file, error_record, module_files
from .engine import manager_ops, run_manager

POLICIES = ("LRU", "FIFO", "LFU")
POOL_CLASSES = {"LRU": "LRUBlockPool", "FIFO": "FIFOBlockPool", "LFU": "LFUBlockPool"}
_BUILT: dict[tuple, ModuleType] = {}


def policy_module(modules: Mapping[str, ModuleType]) -> ModuleType:
    """The eviction module under test, built on this side's kv_cache (the reference's): 4.7's code alone."""
    eviction, kv = modules["eviction"], modules["kv_cache"]
    path = getattr(eviction, "__file__", None)
    if not path:
        return eviction
    key = (path, id(eviction), id(kv))
    if key not in _BUILT:
        saved = sys.modules.get("kvcourse.kv_cache")
        sys.modules["kvcourse.kv_cache"] = kv  # `from kvcourse.kv_cache import BlockPool` finds this side's pool
        try:
            _BUILT[key] = _load_file(f"_kvcourse_lockstep_eviction_{len(_BUILT)}", Path(path))
        finally:
            if saved is None:
                sys.modules.pop("kvcourse.kv_cache", None)
            else:
                sys.modules["kvcourse.kv_cache"] = saved
    return _BUILT[key]


# ---------------------------------------------------------------------------------------------- the pool
def pool_ops(exercise_id: str, seed: int, size: str) -> list:
    """Seeded pool calls: allocations, publishing, frees in shuffled order, hits reviving free blocks, shares."""
    rng = random.Random(f"p{exercise_id}/{seed}")
    ops: list = [["config", {"num_blocks": rng.choice([3, 5, 8, 12])}]]
    for _ in range(45 if size == "small" else 200):
        roll = rng.random()
        if roll < 0.3:
            ops.append(["get", rng.choice([0, 1, 1, 2, 3, 5])])
        elif roll < 0.45:
            ops.append(["publish", rng.randint(1, 3)])
        elif roll < 0.65:
            ops.append(["free", [rng.randrange(1000) for _ in range(rng.choice([1, 1, 2, 4]))]])
        elif roll < 0.82:
            ops.append(["hit", rng.randrange(1000)])  # a prefix hit revives a cached FREE block: its entry goes stale
        elif roll < 0.92:
            ops.append(["share", rng.randrange(1000)])  # a second holder of a cached held block: one more share
        elif roll < 0.97:
            ops.append(["free_all"])
        else:
            ops.append(["reset"])
    return ops


def _pool_call(op: list, pool, held: list, tags: list[int]) -> object:
    """One pool call; `held` lists one entry per holder this workload owns."""
    kind = op[0]
    if kind == "get":
        blocks = pool.get_new_blocks(min(op[1], pool.get_num_free_blocks()))
        held += blocks
        return [b.block_id for b in blocks]
    if kind == "publish":
        fresh = sorted({b.block_id: b for b in held if b.block_hash is None}.values(), key=lambda b: b.block_id)
        chosen = fresh[: op[1]]
        tags[0] += 1
        pool.cache_full_blocks(chosen, [bytes([tags[0] % 256, b.block_id]) for b in chosen],
                               [[tags[0], b.block_id] for b in chosen])  # fmt: skip
        return [b.block_id for b in chosen]
    if kind in ("free", "free_all"):
        picks = [held.pop(r % len(held)) for r in op[1] if held] if kind == "free" else held[:]
        if kind == "free_all":
            held.clear()
        pool.free_blocks(picks)
        return [b.block_id for b in picks]
    if kind in ("hit", "share"):
        want = 0 if kind == "hit" else 1
        pick = [b for b in pool.blocks if b.block_hash is not None and (b.ref_cnt > 0) == bool(want)]
        if not pick:
            return None
        block = pick[op[1] % len(pick)]
        pool.touch([block])
        held.append(block)
        return block.block_id
    if kind == "reset":
        return pool.reset_prefix_cache()
    raise ValueError(f"unknown op {op!r}")


def snap_pool(pool) -> dict:
    """What 4.7 fixes of the pool: the free queue, holders, cached blocks, the heap's (tick, block id) entries."""
    queue = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    return {
        "free_queue": queue,
        "num_free": pool.get_num_free_blocks(),
        "ref_cnt": [b.ref_cnt for b in pool.blocks],
        "cached": [b.block_id for b in pool.blocks if b.block_hash is not None],
        "heap": sorted([entry[1], entry[2]] for entry in pool.free_heap),
    }


def run_pool(ops: list, modules: Mapping[str, ModuleType]) -> list[dict]:
    """The same calls on a pool of each policy (LRU through the ranked pool too); one record per call."""
    eviction = policy_module(modules)
    files = module_files(modules) | {str(getattr(eviction, "__file__", ""))}
    records: list[dict] = []
    for policy in POLICIES:
        pool = getattr(eviction, POOL_CLASSES[policy])(ops[0][1]["num_blocks"], True)
        held: list = []
        tags = [0]
        for index, op in enumerate(ops[1:], start=1):
            call = f"{policy}: {'get_new_blocks' if op[0] == 'get' else op[0]}{op[1:2]}"
            try:
                answer = _pool_call(op, pool, held, tags)
                obs = {"handed" if op[0] == "get" else "returned": answer, **snap_pool(pool)}
                records.append({"step": index, "call": call, "obs": obs})
            except Exception as error:
                records.append({"step": index, "call": call, **error_record(error, files)})
                break
    return records


# ---------------------------------------------------------------------------------------------- a manager
def policy_manager_ops(exercise_id: str, seed: int, size: str) -> list:
    """The manager workload of 3.x/4.x, on one policy per seed (all three over the local seeds)."""
    ops = manager_ops(exercise_id, seed, size)
    return [["config", {**ops[0][1], "policy": POLICIES[seed % 3]}], *ops[1:]]


def run_policy_manager(ops: list, modules: Mapping[str, ModuleType]) -> list[dict]:
    """run_manager on a manager whose pool is the seed's policy (with_policy, given)."""
    eviction = policy_module(modules)
    pool_class = getattr(eviction, POOL_CLASSES[ops[0][1]["policy"]])
    kv = modules["kv_cache"]

    def build(num_blocks: int, block_size: int, caching: bool):
        return eviction.with_policy(kv.KVCacheManager(num_blocks, block_size, caching), pool_class)

    shim = types.ModuleType("kv_cache_with_policy")
    shim.KVCacheManager = build  # type: ignore[attr-defined]
    return run_manager(ops, {**modules, "kv_cache": shim})
