"""A request as the scheduler and the KV-cache manager see it."""

from __future__ import annotations

import enum
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvcourse.worker.sampler import SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is in its life; the last four are final, and all but FINISHED carry a `Request.reason`."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # its blocks are being loaded from a second tier (vLLM's name)
    FINISHED = "finished"  # generated all its tokens (or its end-of-sequence token)
    REJECTED = "rejected"  # could never fit the cache: refused when added, never ran
    ABORTED = "aborted"  # stopped on request (a client went away): vLLM's FINISHED_ABORTED
    FAILED = "failed"  # a fault inside a step (scheduling, the model, the update) ended it

    def is_finished(self) -> bool:
        """Final statuses: the request holds no blocks and will never run again."""
        return self in FINAL_STATUSES


FINAL_STATUSES = frozenset(
    {RequestStatus.FINISHED, RequestStatus.REJECTED, RequestStatus.ABORTED, RequestStatus.FAILED}
)


def _describe(value: object) -> str:
    """A value and its type, short enough for an error message."""
    text = repr(value)
    return f"{text[:40]}... ({type(value).__name__})" if len(text) > 40 else f"{text} ({type(value).__name__})"


def validate_prompt_tokens(tokens: object, vocab_size: int | None = None, where: str = "the prompt") -> list[int]:
    """The prompt as a list of ints, or a ValueError naming the bad value and the valid range, before it is queued.

    Accepts a list or tuple of whole numbers (numpy and torch integers too, and a 1-D array or tensor).
    Without vocab_size (the scheduler knows no vocabulary) only types, shape and sign are checked.
    """
    valid = f"0 to {vocab_size - 1}" if vocab_size is not None else "0 or more"
    if hasattr(tokens, "tolist") and not isinstance(tokens, (list, tuple)):
        tokens = tokens.tolist()  # a numpy array or torch tensor: its numbers as plain Python
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise ValueError(f"{where} is {_describe(tokens)}; a prompt is a list of token ids (whole numbers {valid}).")
    if not tokens:
        raise ValueError(f"{where} is empty: give at least one token (the model needs one to predict from).")
    for position, token in enumerate(tokens):
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):
            raise ValueError(
                f"{where}, token {position} is {_describe(token)}; token ids are whole numbers {valid} "
                "(a list of ints, not nested lists, floats or None)."
            )
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise ValueError(f"{where}, token {position} is {int(token)}; token ids run from {valid}.")
    return [int(token) for token in tokens]


def validate_max_new_tokens(value: object, where: str = "max_new_tokens", minimum: int = 0) -> int:
    """How many tokens to generate: a whole number, at least `minimum`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{where} is {_describe(value)}; it must be a whole number, {minimum} or more.")
    return int(value)


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
    priority: int = 0  # scheduling_policy="priority": lower value = more urgent, as in vLLM
    arrival_time: float = 0.0  # when it arrived (seconds on the serving clock); breaks priority ties
    sampling_params: SamplingParams | None = None  # how the runner's sampler picks its tokens (None: greedy)

    def __post_init__(self) -> None:
        """Reject requests that could never be served, saying how to fix them."""
        self.prompt_tokens = validate_prompt_tokens(self.prompt_tokens, where=f"Request {self.id}: the prompt")
        self.max_new_tokens = validate_max_new_tokens(self.max_new_tokens, where=f"Request {self.id}: max_new_tokens")

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
        if self.status.is_finished():
            return True
        if len(self.output_tokens) >= self.max_new_tokens:
            return True
        return (
            self.eos_token_id is not None and bool(self.output_tokens) and self.output_tokens[-1] == self.eos_token_id
        )


def check_request(request: object) -> Request:
    """The request, if its fields are well formed (they may have been edited since it was built); else a ValueError."""
    if not isinstance(request, Request):
        raise ValueError(
            f"add_request takes a Request, not {_describe(request)}: build one with "
            "Request(id=..., prompt_tokens=[...], max_new_tokens=...)."
        )
    if isinstance(request.id, bool) or not isinstance(request.id, numbers.Integral):
        raise ValueError(f"the request id is {_describe(request.id)}; ids are whole numbers.")
    request.prompt_tokens = validate_prompt_tokens(request.prompt_tokens, where=f"Request {request.id}: the prompt")
    request.max_new_tokens = validate_max_new_tokens(
        request.max_new_tokens, where=f"Request {request.id}: max_new_tokens"
    )
    return request


def check_new_request(request: object, known_ids: set[int]) -> Request:
    """A request a scheduler may queue: well formed, an id not seen before, nothing computed yet."""
    request = check_request(request)
    if request.id in known_ids:
        raise ValueError(f"Request id {request.id} was already added; every request needs its own id.")
    if request.num_computed_tokens != 0:
        raise ValueError(
            f"Request {request.id} says {request.num_computed_tokens} tokens are computed, "
            "but a new request has nothing in the cache yet."
        )
    return request
