"""A request as the scheduler and the KV-cache manager see it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestStatus(enum.Enum):
    """Where a request is in its life; REJECTED ones never ran (see `Request.reason`)."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    REJECTED = "rejected"


@dataclass
class Request:
    """One prompt to complete: its tokens, how far its KV cache reaches, and its status."""

    id: int
    prompt_tokens: list[int]
    max_new_tokens: int
    output_tokens: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    eos_token_id: int | None = None
    reason: str | None = None

    def __post_init__(self) -> None:
        """Reject requests that could never be served, saying how to fix them."""
        if not self.prompt_tokens:
            raise ValueError(
                f"Request {self.id}: the prompt is empty; give at least one token "
                "(the model needs a token to predict from)."
            )
        if self.max_new_tokens < 0:
            raise ValueError(f"Request {self.id}: max_new_tokens is {self.max_new_tokens}; it must be 0 or more.")
        self.prompt_tokens = list(self.prompt_tokens)

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt alone."""
        return len(self.prompt_tokens)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: everything whose K/V the request will need."""
        return len(self.prompt_tokens) + len(self.output_tokens)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by the generated tokens (what a recompute feeds again)."""
        return self.prompt_tokens + self.output_tokens

    @property
    def tokens_processed(self) -> int:
        """The source lesson's name for `num_computed_tokens`."""
        return self.num_computed_tokens

    @tokens_processed.setter
    def tokens_processed(self, value: int) -> None:
        self.num_computed_tokens = value

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to feed the model before the next one can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    def is_prefill_done(self) -> bool:
        """True once every token but the newest sampled one is in the cache (decode phase)."""
        return bool(self.output_tokens) and self.num_computed_tokens >= self.num_tokens - 1

    def is_complete(self) -> bool:
        """True when the request has all its tokens, hit its end-of-sequence token, or ended."""
        if self.status in (RequestStatus.FINISHED, RequestStatus.REJECTED):
            return True
        if len(self.output_tokens) >= self.max_new_tokens:
            return True
        return (
            self.eos_token_id is not None and bool(self.output_tokens) and self.output_tokens[-1] == self.eos_token_id
        )
