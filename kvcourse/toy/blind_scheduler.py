"""Last lesson's continuous-batching scheduler, which knows nothing about KV memory (notebook 01)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

from kvcourse.request import Request, RequestStatus, check_request


class BlindStallFreeScheduler:
    """Continuous batching with chunked prefill, planned by token budget and batch size alone."""

    def __init__(self, token_budget: int, max_batch_size: int) -> None:
        """The same knobs as last lesson: a token budget and a batch size, nothing about memory."""
        if token_budget <= 0 or max_batch_size <= 0:
            raise ValueError(
                f"token_budget ({token_budget}) and max_batch_size ({max_batch_size}) must both be positive."
            )
        self.token_budget = token_budget
        self.max_batch_size = max_batch_size
        self.kv_cache_manager = None  # blind: no KV manager, so no block tables and no memory limit
        self.waiting_queue: deque[Request] = deque()
        self.active_pool: dict[int, Request] = {}
        self.finished: list[Request] = []
        self.rejected: list[Request] = []  # never: it does not know the cache's size
        self.num_preemptions = 0  # never: it never runs out of (the memory it does not see)

    def add_request(self, request: Request) -> None:
        """Queue a request (a request with nothing to generate is finished at once)."""
        check_request(request)
        if request.is_complete():
            request.status = RequestStatus.FINISHED
            self.finished.append(request)
        else:
            self.waiting_queue.append(request)

    def schedule_next_batch(self) -> list:
        """Decodes, then the prefill in progress, then admissions: no question asked about memory."""
        from kvcourse.scheduler import ScheduledSequence  # the dataclass (never a stub)

        batch: list = []
        budget = self.token_budget
        for request in self.active_pool.values():
            if budget == 0:
                break
            if request.is_prefill_done():
                batch.append(self._advance(ScheduledSequence, request, 1, True))
                budget -= 1
            else:
                n = min(request.num_uncomputed_tokens, budget)
                batch.append(self._advance(ScheduledSequence, request, n, False))
                budget -= n
        while self.waiting_queue and budget > 0 and len(self.active_pool) < self.max_batch_size:
            request = self.waiting_queue.popleft()
            request.status = RequestStatus.RUNNING
            self.active_pool[request.id] = request
            n = min(request.num_tokens, budget)
            batch.append(self._advance(ScheduledSequence, request, n, False))
            budget -= n
        return batch

    @staticmethod
    def _advance(sequence_type: type, request: Request, n: int, is_decode: bool) -> Any:
        """The next n tokens of the request, at positions that follow its cached ones."""
        start = request.num_computed_tokens
        request.num_computed_tokens += n
        return sequence_type(
            request.id,
            request.all_token_ids[start : start + n],
            is_decode,
            start,
            samples_token=request.num_computed_tokens == request.num_tokens,
        )

    def update_from_output(self, batch: list, sampled_token_ids: dict[int, int]) -> list[Request]:
        """Append sampled tokens; finished requests leave (nothing to free: it never allocated)."""
        finished = []
        for sequence in batch:
            if sequence.samples_token:
                request = self.active_pool[sequence.request_id]
                request.output_tokens.append(sampled_token_ids[sequence.request_id])
                if request.is_complete():
                    request.status = RequestStatus.FINISHED
                    del self.active_pool[request.id]
                    self.finished.append(request)
                    finished.append(request)
        return finished

    def has_unfinished_requests(self) -> bool:
        """Whether anything is waiting or running."""
        return bool(self.waiting_queue or self.active_pool)

    def finish_requests(
        self, request_ids: int | Iterable[int], status: RequestStatus, reason: str | None = None
    ) -> list[Request]:
        """End waiting or running requests now (abort, failure); settled ones are left alone."""
        ended = []
        for request_id in [request_ids] if isinstance(request_ids, int) else list(request_ids):
            request = self.active_pool.pop(request_id, None)
            if request is None:
                request = next((r for r in self.waiting_queue if r.id == request_id), None)
                if request is None:
                    continue
                self.waiting_queue.remove(request)
            request.status, request.reason = status, reason
            self.finished.append(request)
            ended.append(request)
        return ended
