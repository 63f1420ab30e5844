"""The memory-aware StallFreeScheduler: it plans each step's batch and negotiates KV memory for it.

Policy lives here (who runs, in what order, who is preempted or rejected); mechanism lives in the
KV-cache manager (which blocks). The two meet only through the manager's contract:
`allocate_slots` (all or nothing, `None` on failure), `free`, `get_computed_blocks`, plus its
`num_blocks` and `block_size`.

One step, `schedule_next_batch()`:
  1. decodes first: every running request that has sampled a token feeds that token (1 token each);
  2. then at most one chunked prefill in progress (a running request whose tokens are not all cached);
  3. then admissions from the waiting queue, while the token budget and the batch size allow
     (none in a step that had to preempt: the memory just freed is for the running requests).
Never more than `token_budget` tokens or `max_batch_size` sequences, and nothing is scheduled before
`allocate_slots` has succeeded for it.

Bookkeeping that the executor and the engine rely on:
  * `request.num_computed_tokens` advances when a chunk is SCHEDULED (the executor will write those
    tokens' K/V this step), right after `allocate_slots` succeeded for it. So `allocate_slots` is
    always called before the advance, and sees the old value.
  * Positions come from `num_computed_tokens`: a chunk's `position_ids_start` is the number of the
    request's tokens already cached, and its tokens are `all_token_ids[start:start + len]`.
  * `ScheduledSequence.samples_token` is True for every decode and for the prefill chunk that reaches
    the request's `num_tokens`; the executor samples exactly one token for each such sequence and
    `update_from_output(batch, {request_id: token})` appends it. There is no placeholder token.
  * Preemption is recompute: the most recently admitted running request gives its blocks back,
    `num_computed_tokens = 0`, status PREEMPTED, and it goes back to the HEAD of the waiting queue with
    its output tokens kept; its next prefill recomputes the prompt and those outputs.
  * Rejection happens in `add_request`: a request that needs more blocks than the whole cache has
    (`ceil((len(prompt) + max_new_tokens) / block_size) > num_blocks`) gets status REJECTED and a
    `reason`, is listed in `scheduler.rejected`, and never enters the waiting queue.
  * A request with nothing to generate (`max_new_tokens == 0`) is FINISHED in `add_request` too and
    listed in `scheduler.finished` (it never runs); `update_from_output` returns the requests that
    the update itself finished. `scheduler.finished` lists every finished request, in order.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from kvcourse.kv_cache_interface import KVCacheManagerProtocol
from kvcourse.request import Request, RequestStatus

_MANAGER_METHODS = ("allocate_slots", "free", "get_computed_blocks", "get_num_free_blocks", "num_blocks", "block_size")


@dataclass
class ScheduledSequence:
    """One request's share of a step: the tokens to feed and the position of the first one."""

    request_id: int
    tokens: list[int]
    is_decode: bool
    position_ids_start: int
    samples_token: bool = False  # True when this chunk reaches the request's num_tokens (always for a decode)

    def __post_init__(self) -> None:
        """A decode always samples: that is what a decode is for."""
        if self.is_decode:
            self.samples_token = True

    @property
    def positions(self) -> range:
        """Positions of the fed tokens in the request's sequence (what the model's position ids are)."""
        return range(self.position_ids_start, self.position_ids_start + len(self.tokens))


def _positive_int(name: str, value: int) -> int:
    """Budgets and sizes are counts; zero or less would schedule nothing forever."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} is {value!r}; it must be a positive whole number.")
    return value


class StallFreeScheduler:
    """Continuous batching with chunked prefill that never schedules a token it has no KV memory for."""

    def __init__(self, token_budget: int, max_batch_size: int, kv_cache_manager: KVCacheManagerProtocol) -> None:
        """Check the sizes and the manager up front, so a misconfigured engine fails before it runs."""
        self.token_budget = _positive_int("token_budget", token_budget)
        self.max_batch_size = _positive_int("max_batch_size", max_batch_size)
        missing = [name for name in _MANAGER_METHODS if not hasattr(kv_cache_manager, name)]
        if missing:
            raise TypeError(
                f"kv_cache_manager {kv_cache_manager!r} lacks {', '.join(missing)}: pass a "
                "MockKVCacheManager or a KVCacheManager."
            )
        self.kv_cache_manager = kv_cache_manager
        self.waiting_queue: deque[Request] = deque()
        self.active_pool: dict[int, Request] = {}  # the running set, in admission order
        self.finished: list[Request] = []
        self.rejected: list[Request] = []
        self.num_preemptions = 0  # total over the scheduler's life
        self._known_ids: set[int] = set()

    # ----------------------------------------------------------------------------- requests in
    def add_request(self, request: Request) -> None:
        """Queue a request, or settle it at once if it can never run (rejected) or needs nothing (finished)."""
        if request.id in self._known_ids:
            raise ValueError(f"Request id {request.id} was already added; every request needs its own id.")
        if request.num_computed_tokens != 0:
            raise ValueError(
                f"Request {request.id} says {request.num_computed_tokens} tokens are computed, "
                "but a new request has nothing in the cache yet."
            )
        self._known_ids.add(request.id)
        if self._reject_if_never_fits(request):
            return
        if request.is_complete():  # max_new_tokens == 0: nothing to generate, nothing to run
            request.status = RequestStatus.FINISHED
            self.finished.append(request)
            return
        request.status = RequestStatus.WAITING
        self.waiting_queue.append(request)

    def _reject_if_never_fits(self, request: Request) -> bool:
        """A request needing more blocks than the whole cache could never finish: refuse it now, saying why."""
        manager = self.kv_cache_manager
        # Exercise 2.5: work out how many blocks the request would need at its longest
        # (prompt + max_new_tokens tokens, blocks of manager.block_size, a partial block counts).
        # If that is more than manager.num_blocks, set request.status to RequestStatus.REJECTED,
        # put a sentence in request.reason that says why, and return True; otherwise return False.
        # TODO: Exercise 2.5: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 2.5 (Reject what can never fit): not written yet: edit kvcourse/scheduler.py, StallFreeScheduler._reject_if_never_fits."
        )
        self.rejected.append(request)
        return True

    # ----------------------------------------------------------------------------- one step
    def schedule_next_batch(self) -> list[ScheduledSequence]:
        """Plan one step: decodes first, then the prefill in progress, then admissions, all within budget."""
        batch: list[ScheduledSequence] = []
        preemptions_before = self.num_preemptions
        self._schedule_decodes(batch)
        self._schedule_prefill_in_progress(batch)
        if self.num_preemptions == preemptions_before:
            self._admit_waiting(batch)
        return batch

    def _budget_left(self, batch: list[ScheduledSequence]) -> int:
        """Tokens this step may still feed."""
        return self.token_budget - sum(len(seq.tokens) for seq in batch)

    def _has_room(self, batch: list[ScheduledSequence], num_tokens: int = 1) -> bool:
        """Whether one more sequence of at least num_tokens tokens fits the budget and the batch size."""
        return self._budget_left(batch) >= num_tokens and len(batch) < self.max_batch_size

    def _schedule_decodes(self, batch: list[ScheduledSequence]) -> None:
        """Every running request past its prefill feeds its newest token, oldest admission first."""
        for request in list(self.active_pool.values()):
            if request.id not in self.active_pool or not request.is_prefill_done():
                continue  # preempted a moment ago, or still prefilling
            if not self._has_room(batch):
                return
            sequence = self._schedule_decode(request)
            if sequence is not None:
                batch.append(sequence)

    def _schedule_decode(self, request: Request) -> ScheduledSequence | None:
        """One decode: room for one more token, or (failing even after preemption) nothing."""
        # Exercise 2.1: a decode feeds exactly one token. Ask for room for it with
        # self._allocate_or_preempt(request, 1). If that fails, return None; otherwise return
        # self._advance(request, 1, is_decode=True).
        # TODO: Exercise 2.1: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 2.1 (Allocate a slot for each decode): not written yet: edit kvcourse/scheduler.py, StallFreeScheduler._schedule_decode."
        )

    def _schedule_prefill_in_progress(self, batch: list[ScheduledSequence]) -> None:
        """Continue the (at most one) running request whose tokens are not all in the cache yet."""
        request = next((r for r in self.active_pool.values() if self._is_prefilling(r)), None)
        if request is None or not self._has_room(batch):
            return
        sequence = self._schedule_prefill_chunk(request, self._budget_left(batch))
        if sequence is not None:
            batch.append(sequence)

    def _schedule_prefill_chunk(self, request: Request, token_budget_left: int) -> ScheduledSequence | None:
        """The next chunk of a running request's prefill, as big as the budget allows, if memory allows."""
        # Exercise 2.2 (a running request): the chunk is the request's uncomputed tokens
        # (request.num_uncomputed_tokens), at most token_budget_left of them. Get room for them with
        # self._allocate_or_preempt(request, n); if that fails return None, else return
        # self._advance(request, n, is_decode=False).
        # TODO: Exercise 2.2: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 2.2 (Allocate prefill chunks): not written yet: edit kvcourse/scheduler.py, StallFreeScheduler._schedule_prefill_chunk."
        )

    def _admit_waiting(self, batch: list[ScheduledSequence]) -> None:
        """Admit waiting requests in queue order; one that does not fit now is skipped this step."""
        for request in list(self.waiting_queue):
            if not self._has_room(batch) or len(self.active_pool) >= self.max_batch_size:
                return
            sequence = self._admit(request, self._budget_left(batch))
            if sequence is not None:
                batch.append(sequence)

    def _admit(self, request: Request, token_budget_left: int) -> ScheduledSequence | None:
        """Move a waiting request to the running set with its first chunk, reusing cached prefix blocks."""
        computed_blocks, num_computed = self.kv_cache_manager.get_computed_blocks(request)
        # Exercise 2.2 (a waiting request): num_computed of its tokens are already cached
        # (prefix-cache hits, in computed_blocks). Its first chunk is the rest of its tokens
        # (request.num_tokens - num_computed), at most token_budget_left of them. Ask for room with
        # self.kv_cache_manager.allocate_slots(request, n, num_computed, computed_blocks) -- a newcomer
        # preempts nobody: on None, return None and leave it waiting. On success take THIS request
        # out of self.waiting_queue (not necessarily the head), set its status to RUNNING, add it to
        # self.active_pool, set its num_computed_tokens to num_computed, and return
        # self._advance(request, n, is_decode=False).
        # TODO: Exercise 2.2: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 2.2 (Allocate prefill chunks): not written yet: edit kvcourse/scheduler.py, StallFreeScheduler._admit."
        )

    @staticmethod
    def _is_prefilling(request: Request) -> bool:
        """Running, with tokens still to feed before it can sample (a new or a recomputing request)."""
        return not request.is_prefill_done() and request.num_uncomputed_tokens > 0

    @staticmethod
    def _advance(request: Request, num_new_tokens: int, is_decode: bool) -> ScheduledSequence:
        """Describe the next num_new_tokens of the request and count them as computed (memory is secured)."""
        start = request.num_computed_tokens
        request.num_computed_tokens = start + num_new_tokens
        return ScheduledSequence(
            request_id=request.id,
            tokens=request.all_token_ids[start : request.num_computed_tokens],
            is_decode=is_decode,
            position_ids_start=start,
            samples_token=request.num_computed_tokens == request.num_tokens,
        )

    # ----------------------------------------------------------------------------- memory pressure
    def _allocate_or_preempt(self, request: Request, num_new_tokens: int) -> bool:
        """Room for a running request's next tokens, preempting the newest admissions until it fits."""
        while self.kv_cache_manager.allocate_slots(request, num_new_tokens) is None:
            victim = self._preempt_most_recent()
            if victim is request:
                return False  # it was the newest itself: it waits, and the others keep going
        return True

    def _preempt_most_recent(self) -> Request:
        """Free the most recently admitted running request's memory; it will be recomputed later."""
        # Exercise 2.4: the victim is the LAST request in self.active_pool (dicts keep admission
        # order). Take it out of the running set, give its blocks back to the manager, forget its
        # computed tokens (keep its output_tokens: they are recomputed), set its status to
        # PREEMPTED, add 1 to its num_preemptions and to self.num_preemptions, put it at the HEAD of
        # self.waiting_queue, and return it.
        # TODO: Exercise 2.4: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 2.4 (Preempt by recompute): not written yet: edit kvcourse/scheduler.py, StallFreeScheduler._preempt_most_recent."
        )

    # ----------------------------------------------------------------------------- results in
    def update_from_output(self, batch: list[ScheduledSequence], sampled_token_ids: dict[int, int]) -> list[Request]:
        """Append each sampled token; return the requests this update finished (their blocks are freed)."""
        finished = []
        for sequence in batch:
            if not sequence.samples_token:
                continue  # a prefill chunk that does not reach the end samples nothing
            request = self._running(sequence.request_id)
            if sequence.request_id not in sampled_token_ids:
                raise ValueError(
                    f"No sampled token for request {sequence.request_id}, whose chunk reaches the end of "
                    "its tokens: the executor must sample one token for every sequence with samples_token."
                )
            request.output_tokens.append(int(sampled_token_ids[sequence.request_id]))
            if request.is_complete():
                self._finish(request)
                finished.append(request)
        return finished

    def _running(self, request_id: int) -> Request:
        """The running request a batch entry refers to (a clear error for a stale batch)."""
        try:
            return self.active_pool[request_id]
        except KeyError:
            raise ValueError(
                f"Request {request_id} is in the batch but not running; pass the batch returned by the "
                "latest schedule_next_batch(), once."
            ) from None

    def _finish(self, request: Request) -> None:
        """A complete request leaves the running set and gives its blocks back at once, for others."""
        # Exercise 2.3: set the request's status to FINISHED, remove it from self.active_pool, and
        # give its blocks back with self.kv_cache_manager.free(request).
        # TODO: Exercise 2.3: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 2.3 (Free blocks on completion): not written yet: edit kvcourse/scheduler.py, StallFreeScheduler._finish."
        )
        self.finished.append(request)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is still waiting or running (rejected and finished ones are settled)."""
        return bool(self.waiting_queue) or bool(self.active_pool)

    def __repr__(self) -> str:
        """Who is where, by id (no addresses, so traces are stable)."""
        return (
            f"StallFreeScheduler(running={list(self.active_pool)}, "
            f"waiting={[r.id for r in self.waiting_queue]}, finished={len(self.finished)}, "
            f"rejected={len(self.rejected)}, preemptions={self.num_preemptions})"
        )
