"""Last lesson's continuous-batching scheduler, which knows nothing about KV memory (notebook 01)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from kvcourse.core.request import Request, RequestStatus, check_request
from kvcourse.core.sched_output import ScheduledSequence, SchedulerOutput


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
        self._num_finished_reported = 0  # how much of self.finished earlier steps' outputs reported

    def add_request(self, request: Request) -> None:
        """Queue a request (a request with nothing to generate is finished at once)."""
        check_request(request)
        if request.is_complete():
            request.status = RequestStatus.FINISHED
            self.finished.append(request)
        else:
            self.waiting_queue.append(request)

    def schedule_next_batch(self) -> SchedulerOutput:
        """Decodes, then the prefill in progress, then admissions: no question asked about memory."""
        output = SchedulerOutput(finished_req_ids=[r.id for r in self.finished[self._num_finished_reported :]])
        self._num_finished_reported = len(self.finished)
        for request in self.active_pool.values():
            if output.total_num_scheduled_tokens == self.token_budget:
                break
            n = 1 if request.is_prefill_done() else request.num_uncomputed_tokens
            output.add(self._new_sequence(request, min(n, self.token_budget - output.total_num_scheduled_tokens)))
        while self.waiting_queue and output.total_num_scheduled_tokens < self.token_budget:
            if len(self.active_pool) >= self.max_batch_size:
                break
            request = self.waiting_queue.popleft()
            request.status = RequestStatus.RUNNING
            self.active_pool[request.id] = request
            output.add(
                self._new_sequence(
                    request, min(request.num_tokens, self.token_budget - output.total_num_scheduled_tokens)
                )
            )
        for request_id, n in output.num_scheduled_tokens.items():  # plan, then apply
            self.active_pool[request_id].num_computed_tokens += n
        return output

    @staticmethod
    def _new_sequence(request: Request, n: int) -> ScheduledSequence:
        """The next n tokens of the request, at positions that follow its cached ones."""
        start = request.num_computed_tokens
        return ScheduledSequence(
            request.id,
            request.all_token_ids[start : start + n],
            request.is_prefill_done(),
            start,
            samples_token=start + n == request.num_tokens,
        )

    def update_from_output(self, scheduler_output: SchedulerOutput, sampled_token_ids: dict[int, int]) -> list[Request]:
        """Append sampled tokens; finished requests leave (nothing to free: it never allocated)."""
        finished = []
        for sequence in scheduler_output:
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
