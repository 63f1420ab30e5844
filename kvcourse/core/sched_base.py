"""The scheduler's given half: its queues' bookkeeping, requests in and out, and applying a plan.

The learner's StallFreeScheduler (kvcourse/scheduler.py) inherits these and writes the policy: who is
admitted, scheduled, preempted, rejected. vLLM keeps the like in vllm/v1/core/sched/scheduler.py
(`add_request`, `finish_requests`, `has_unfinished_requests`, `_update_after_schedule`).
The state they read is set up by StallFreeScheduler.__init__ (waiting_queue, active_pool, finished, ...).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvcourse.core.request import Request, RequestStatus, check_new_request

if TYPE_CHECKING:
    from kvcourse.core.sched_output import SchedulerOutput


class SchedulerBase:
    """Given methods of the StallFreeScheduler; the learner's subclass holds the state and the policy."""

    @property
    def watermark_blocks(self) -> int:
        """Blocks that admission keeps free for the running decodes (as vLLM v1 and v0: int(watermark * num_blocks))."""
        return int(self.watermark * self.kv_cache_manager.num_blocks)

    @property
    def num_free_cpu_blocks(self) -> int:
        """Room left in the swap space."""
        return self.num_cpu_blocks - sum(self._swapped.values())

    def add_request(self, request: Request) -> None:
        """Queue a request, or settle it at once if it can never run (rejected) or needs nothing (finished)."""
        check_new_request(request, self._known_ids)  # refused in words here, before anything is queued
        self._known_ids.add(request.id)
        if self._reject_if_never_fits(request):
            return
        if request.is_complete():  # max_new_tokens == 0: nothing to generate, nothing to run
            request.status = RequestStatus.FINISHED
            self.finished.append(request)
            return
        request.status = RequestStatus.WAITING
        if self.policy == "priority":
            self._insert_by_priority(request)
        else:
            self.waiting_queue.append(request)

    def _update_after_schedule(self, output: SchedulerOutput) -> None:
        """Apply the plan (vLLM's name): each planned request's tokens count as computed, once; blocks for the executor."""
        manager = self.kv_cache_manager
        for request_id, num_scheduled in output.num_scheduled_tokens.items():
            request = self.active_pool[request_id]
            request.num_computed_tokens += num_scheduled
            output.block_ids[request_id] = manager.get_block_ids(request)
        output.blocks_to_copy = manager.take_pending_copies()
        tier = getattr(self, "kv_connector", None)
        if tier is not None:  # a second tier (lesson 10): its copies run before the model, saves first
            self.release_unadmitted_loads()
            output.kv_saves, output.kv_loads = tier.take_transfers()
            output.loading_req_ids = list(self.loading)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is still waiting or running (rejected and finished ones are settled)."""
        return bool(self.waiting_queue) or bool(self.active_pool) or bool(getattr(self, "loading", None))

    def finish_requests(
        self, request_ids: int | Iterable[int], status: RequestStatus, reason: str | None = None
    ) -> list[Request]:
        """End waiting or running requests now (vLLM's name), blocks back at once; returns those it ended."""
        if not status.is_finished() or status is RequestStatus.REJECTED:
            raise ValueError(f"status is {status}; finish requests as FINISHED, ABORTED or FAILED.")
        ended = []
        for request_id in [request_ids] if isinstance(request_ids, int) else list(request_ids):
            if request_id in getattr(self, "loading", {}):  # its load is under way: end it as a waiting one
                self.waiting_queue.append(self.loading.pop(request_id)[0])
            getattr(self, "loaded", set()).discard(request_id)
            request = self._end_request(request_id, status, reason)
            if request is None:
                if request_id not in self._known_ids:
                    raise ValueError(f"request {request_id!r} was never added to this scheduler.")
                continue  # already finished, rejected, aborted or failed: nothing to do
            self._swapped.pop(request.id, None)  # a swapped-out request also gives back its CPU blocks
            self.finished.append(request)
            ended.append(request)
        return ended

    def _take_waiting(self, request_id: int) -> Request | None:
        """Remove a request from the waiting queue by id (None if it is not waiting)."""
        for request in self.waiting_queue:
            if request.id == request_id:
                self.waiting_queue.remove(request)
                return request
        return None

    def __repr__(self) -> str:
        """Who is where, by id (no addresses, so traces are stable)."""
        return (
            f"StallFreeScheduler(running={list(self.active_pool)}, "
            f"waiting={[r.id for r in self.waiting_queue]}, finished={len(self.finished)}, "
            f"rejected={len(self.rejected)}, preemptions={self.num_preemptions})"
        )
