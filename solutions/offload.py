"""A second KV tier in CPU memory (exercises 8.1-8.5): evicted blocks are kept there and loaded back, not recomputed.

Two halves, as vLLM's KV connector (`KVConnectorBase_V1`, vllm/distributed/kv_transfer/kv_connector/v1/base.py):
  * the tier (`CPUOffloadTier`, exercises 8.1-8.3): when the device pool evicts a FULL, HASHED block, the
    pool offers it here (8.1); at admission, after the device prefix hits, the scheduler asks how many more
    prompt tokens the tier holds (8.2, vLLM's `get_num_new_matched_tokens`); once device blocks are
    allocated for them, the tier queues their loads (8.3, vLLM's `update_state_after_alloc`);
  * the scheduler's side (`SecondTierScheduling`, exercises 8.4-8.5, mixed into StallFreeScheduler): a
    request with tokens in the tier waits in its own status, WAITING_FOR_REMOTE_KVS, while its blocks are
    copied, without holding up the batch; then it proceeds as a prefix hit.
The copies themselves are given: `take_transfers()` hands the step's (device block, CPU slot) saves and
(CPU slot, device block) loads to the executor, which copies real K/V tensors (kvcourse/worker/model_runner.py)
before the step's forward pass: saves first, then loads. A load therefore completes within the step that
planned it, and the request runs from the next step on.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kvcourse.core.contract import KVCacheBlocks, check_cache_shape
from kvcourse.core.kv_cache_utils import BlockHash, KVCacheBlock
from kvcourse.core.request import Request, RequestStatus
from kvcourse.core.sched_output import SchedulerOutput


@dataclass
class TierEntry:
    """One block kept in the tier: the CPU slot holding its K/V and the tokens it caches."""

    slot: int
    token_ids: tuple[int, ...]


@dataclass
class TierStats:
    """What the tier did: blocks offered, saved (copied out), dropped, loaded back, and loads that failed."""

    offered: int = 0
    saved: int = 0
    dropped: int = 0
    loaded: int = 0
    failed: int = 0
    events: list[tuple[str, int, int]] = field(default_factory=list)  # (kind, device block, slot), for the widget


class CPUOffloadTier:
    """A CPU pool of num_blocks blocks, keyed by block hash, in LRU order (vLLM's CPU offloading connector)."""

    def __init__(
        self, num_blocks: int, block_size: int, block_hashes: Callable[[Request], list[BlockHash]] | None = None
    ) -> None:
        check_cache_shape(num_blocks, block_size)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.entries: OrderedDict[BlockHash, TierEntry] = OrderedDict()  # least recently used first
        self.free_slots: list[int] = list(range(num_blocks))  # slots holding nothing
        self.pinned: set[int] = set()  # slots a load planned this step reads: never dropped or reused before it runs
        self.pending_saves: list[tuple[int, int]] = []  # (device block id, CPU slot): copy out, this step
        self.pending_loads: list[tuple[int, int]] = []  # (CPU slot, device block id): copy in, this step
        self.block_hashes = block_hashes  # request -> its hash chain (the manager's _block_hashes)
        self.last_saves: list[tuple[int, int]] = []  # the saves the latest take_transfers() handed out
        self.stats = TierStats()

    # ---- given read-outs ----
    def __len__(self) -> int:
        """Blocks the tier holds now."""
        return len(self.entries)

    def holds(self, block_hash: BlockHash) -> bool:
        """Whether a block with this hash is in the tier."""
        return block_hash in self.entries

    def lru_order(self) -> list[BlockHash]:
        """The hashes held, least recently used first (what a full tier drops first)."""
        return list(self.entries)

    def _request_hashes(self, request: Request) -> list[BlockHash]:
        """The request's hash chain, from the manager (the tier hashes nothing itself)."""
        if self.block_hashes is None:
            raise ValueError(
                "this tier has no block_hashes: build it with make_tier(manager, num_blocks), which passes the "
                "manager's hash chains."
            )
        return self.block_hashes(request)

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's copies for the executor, (saves, loads), in order; the pins end with the step."""
        saves, loads = self.pending_saves, self.pending_loads
        self.pending_saves, self.pending_loads, self.pinned, self.last_saves = [], [], set(), saves
        self.stats.saved += len(saves)
        self.stats.loaded += len(loads)
        self.stats.events += [("save", block, slot) for block, slot in saves]
        self.stats.events += [("load", block, slot) for slot, block in loads]
        return saves, loads

    def forget_unwritten(self) -> None:
        """After a failed step: drop the entries that step saved (their copies may never have run) and its plans."""
        slots = {slot for _, slot in self.pending_saves + self.last_saves}
        for block_hash, entry in list(self.entries.items()):
            if entry.slot in slots:
                del self.entries[block_hash]
                self.free_slots.append(entry.slot)
        self.pending_saves, self.pending_loads, self.pinned, self.last_saves = [], [], set(), []

    # ---- exercises ----
    def offer(self, block: KVCacheBlock) -> None:
        """The device pool evicts a full, hashed block: keep its K/V here, if the tier takes it."""
        self.stats.offered += 1
        # Exercise 8.1 (contract): `block` is full and published (block.block_hash, block.token_ids) and
        #   is about to be reused; its K/V is still intact until the step runs. Fixed by the contract:
        #   * the tier never holds more than self.num_blocks entries, and never two entries for one hash;
        #   * a block stored now is an entry self.entries[hash] = TierEntry(slot, token_ids) in a slot no
        #     other entry uses, it is the MOST recently used, and (block.block_id, slot) is appended to
        #     self.pending_saves (the copy out; exactly one per stored block);
        #   * a block whose hash the tier already holds is not copied again (no second save);
        #   * a full tier makes room only by dropping its LEAST recently used entry that is not pinned
        #     (self.pinned: slots a planned load reads this step); the slot goes to the newcomer and
        #     self.stats.dropped counts the drop. If every entry is pinned, the block is not stored.
        #   Left to you: whether re-offering a held hash refreshes its recency; whether a full tier drops
        #   (as above) or refuses the newcomer. Helpers: self.free_slots, OrderedDict.popitem(last=False),
        #   move_to_end.
        # BEGIN SOLUTION 8.1
        if block.block_hash in self.entries:
            self.entries.move_to_end(block.block_hash)  # chosen: a re-offered block counts as used
            return
        slot = self._free_slot()
        if slot is None:
            return  # every slot is pinned by a load this step: the block is simply not kept
        self.entries[block.block_hash] = TierEntry(slot, tuple(block.token_ids))
        self.pending_saves.append((block.block_id, slot))
        # END SOLUTION

    def _free_slot(self) -> int | None:
        """A slot for a newcomer: a free one, else the least recently used unpinned entry's (dropped)."""
        # Exercise 8.1 (the room): returns a slot no entry uses any more, taken from self.free_slots
        #   when there is one; else the slot of the least recently used entry whose slot is not pinned,
        #   which leaves self.entries (count it in self.stats.dropped); None when every slot is pinned.
        # BEGIN SOLUTION 8.1
        if self.free_slots:
            return self.free_slots.pop()
        for block_hash, entry in self.entries.items():  # least recently used first
            if entry.slot not in self.pinned:
                del self.entries[block_hash]
                self.stats.dropped += 1
                return entry.slot
        return None
        # END SOLUTION

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Prompt tokens after the device's prefix hits that the tier can load (vLLM's name)."""
        # Exercise 8.2 (contract): num_computed_tokens (a multiple of block_size) are the device's prefix
        #   hits. Returns the tokens of the LONGEST run of the request's full blocks right after them
        #   that the tier holds (hash in self.entries AND the entry's token_ids equal the block's tokens:
        #   a collision never loads), stopping at the first miss: a multiple of block_size, 0 for none.
        #   As in 4.3, the block holding token request.num_tokens - 1 never counts: the last token is
        #   always recomputed. Changes nothing (no recency, no pin). Hashes: self._request_hashes(request).
        # BEGIN SOLUTION 8.2
        size, token_ids = self.block_size, request.all_token_ids
        last = (request.num_tokens - 1) // size  # the block holding the last token is recomputed
        hashes = self._request_hashes(request)
        num_blocks = 0
        for i in range(num_computed_tokens // size, min(last, len(hashes))):
            entry = self.entries.get(hashes[i])
            if entry is None or entry.token_ids != tuple(token_ids[i * size : (i + 1) * size]):
                break
            num_blocks += 1
        return num_blocks * size
        # END SOLUTION

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> int:
        """Device blocks now wait for the tier's tokens: queue their loads; returns the tokens that will load."""
        # Exercise 8.3 (contract): request.num_computed_tokens counts the device hits; `blocks` are the
        #   device blocks allocated for the next num_external_tokens tokens (one per block, in order), as
        #   get_num_new_matched_tokens reported them. Since then the allocation may have evicted device
        #   blocks into the tier and dropped some of these. For the leading blocks whose entry is still
        #   there (same hash, same tokens), in order, stopping at the first that is not: append
        #   (entry.slot, device block id) to self.pending_loads, pin the slot (self.pinned) so nothing
        #   reuses it before the copy runs, and make the entry the most recently used (a hit promotes).
        #   Returns the tokens those loads bring (a multiple of block_size): the rest are recomputed,
        #   nothing is lost. Count the blocks that will not load in self.stats.failed.
        # BEGIN SOLUTION 8.3
        size, token_ids = self.block_size, request.all_token_ids
        first = request.num_computed_tokens // size
        hashes = self._request_hashes(request)
        ids = blocks.get_block_ids()[: num_external_tokens // size]
        num_loaded = 0
        for i, block_id in enumerate(ids, start=first):
            entry = self.entries.get(hashes[i])
            if entry is None or entry.token_ids != tuple(token_ids[i * size : (i + 1) * size]):
                break
            self.pending_loads.append((entry.slot, block_id))
            self.pinned.add(entry.slot)
            self.entries.move_to_end(hashes[i])
            num_loaded += 1
        self.stats.failed += len(ids) - num_loaded
        return num_loaded * size
        # END SOLUTION


class SecondTierScheduling:
    """The scheduler's side of the tier, mixed into StallFreeScheduler (self.kv_connector is the tier)."""

    kv_connector: CPUOffloadTier | None
    loading: dict[int, tuple[Request, int]]  # request id -> (request, tokens its load brings): WAITING_FOR_REMOTE_KVS
    loaded: set[int]  # ids whose load has run: they proceed as a prefix hit at admission

    def collect_finished_loads(self) -> None:
        """Given: the loads planned last step have run; their requests go back to the head of the queue."""
        for request, num_tokens in reversed(list(self.loading.values())):
            request.num_computed_tokens += num_tokens
            request.status = RequestStatus.WAITING
            self.loaded.add(request.id)
            self.waiting_queue.appendleft(request)
        self.loading.clear()

    def abandon_loads(self) -> None:
        """Given: after a failed step, loads it planned may never have run: their requests recompute instead."""
        for request, _ in self.loading.values():
            self.kv_cache_manager.forget_unwritten_tail(request, request.num_computed_tokens)  # only its hits hold K/V
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            self.waiting_queue.appendleft(request)
        self.loading.clear()
        self.kv_connector.forget_unwritten()

    def release_unadmitted_loads(self) -> None:
        """Given: a loaded request not admitted in the step after its load gives its blocks back (no deadlock).

        Its blocks stay cached on the device (free, still published), so its next admission hits them there.
        """
        for request_id in list(self.loaded):
            request = next((r for r in self.waiting_queue if r.id == request_id), None)
            self.loaded.discard(request_id)
            if request is not None:
                self.kv_cache_manager.free(request)
                request.num_computed_tokens = 0

    def _start_load(self, request: Request) -> bool | None:
        """Admission with a tier: when it holds more of the prompt, allocate for it and wait for the load."""
        # Exercise 8.4 (contract): `request` is waiting and holds nothing. Take the device prefix hits
        #   (self.kv_cache_manager.get_computed_blocks, as in 2.2), then ask the tier for more
        #   (self.kv_connector, the tier: get_num_new_matched_tokens(request, device hit tokens)).
        #   * The tier holds nothing more: return None and change nothing (2.2 admits it as usual).
        #   * Else allocate device blocks for the hits plus exactly those tier tokens (allocate_slots with
        #     the hits as in 2.2, and the tier tokens as the new tokens). Refused: return False, nothing
        #     changed. Granted: the request leaves the waiting queue, counts its device hits as computed,
        #     is WAITING_FOR_REMOTE_KVS, and the tier is told (tier.update_state_after_alloc with the
        #     blocks allocate_slots returned); self.loading[request.id] = (request, the tokens it said will
        #     load); blocks past those (they failed) go through manager.forget_unwritten_tail(request,
        #     tokens really there). Return True. It takes no token of this step's budget and no plan entry.
        # BEGIN SOLUTION 8.4
        manager, tier = self.kv_cache_manager, self.kv_connector
        hits, num_hit_tokens = manager.get_computed_blocks(request)
        num_external = tier.get_num_new_matched_tokens(request, num_hit_tokens)
        if num_external == 0:
            return None
        blocks = manager.allocate_slots(request, num_external, num_hit_tokens, hits)
        if blocks is None:
            return False
        self.waiting_queue.remove(request)
        request.num_computed_tokens = num_hit_tokens
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        num_loaded = tier.update_state_after_alloc(request, blocks, num_external)
        self.loading[request.id] = (request, num_loaded)
        manager.forget_unwritten_tail(request, num_hit_tokens + num_loaded)
        return True
        # END SOLUTION

    def _admit_loaded(self, request: Request, token_budget_left: int, output: SchedulerOutput) -> bool:
        """A request whose load has run proceeds as a prefix hit: its next chunk, on the blocks it holds."""
        # Exercise 8.5 (contract): `request` is waiting, its id in self.loaded; it holds device blocks and
        #   request.num_computed_tokens counts its device hits plus what the tier loaded. Its chunk is as
        #   many of its uncomputed tokens as token_budget_left allows; allocate_slots(request, chunk)
        #   covers the rest (the table it holds counts). Refused: return False, nothing changed (it keeps
        #   its blocks and its place). Granted: its id leaves self.loaded, it leaves the waiting queue, is
        #   RUNNING and the newest in self.active_pool, and its chunk (self._new_sequence) is in `output`
        #   with the ids of the blocks allocate_slots returned. Return True.
        # BEGIN SOLUTION 8.5
        num_new_tokens = min(request.num_uncomputed_tokens, token_budget_left)
        blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
        if blocks is None:
            return False
        self.loaded.discard(request.id)
        self.waiting_queue.remove(request)
        request.status = RequestStatus.RUNNING
        self.active_pool[request.id] = request
        output.add(self._new_sequence(request, num_new_tokens), blocks.get_block_ids())
        return True
        # END SOLUTION


def make_tier(manager: object, num_blocks: int) -> CPUOffloadTier:
    """A tier wired to a manager: its evictions are offered to the tier, its hash chains are the tier's."""
    if not getattr(manager, "enable_prefix_caching", False):
        raise ValueError("a CPU tier keeps hashed blocks: build the manager with enable_prefix_caching=True.")
    tier = CPUOffloadTier(num_blocks, manager.block_size, manager._block_hashes)
    manager.block_pool.on_evict = tier.offer
    return tier


def check_tier_blocks(name: str, value: int) -> int:
    """A tier size: a whole number of blocks, 0 (off) or more."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} is {value!r}; it is a count of CPU blocks, 0 (no tier) or more.")
    return value


__all__ = ["CPUOffloadTier", "SecondTierScheduling", "TierEntry", "TierStats", "check_tier_blocks", "make_tier"]
