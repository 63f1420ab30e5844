"""The OpenAI completions protocol as this server speaks it: the request, its checks, the replies.

The fields are OpenAI's (`/v1/completions`) plus vLLM's extras (top_k, repetition_penalty, ignore_eos,
return_token_ids). Sampling parameters become a kvcourse.worker.sampler.SamplingParams; an omitted temperature
means 1, as in OpenAI's API and vLLM. JSON types are checked strictly: `true` is not a number, `"yes"`
is not a boolean. Every refusal is a ServeError (OpenAI's error body) that names the parameter, says
what to change, and quotes at most a short excerpt of what was sent.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

from kvcourse.worker.sampler import SamplingParams, SamplingParamsError

SUPPORTED = (
    "Supported: model, prompt (a string, a list of token ids, or a list of either), max_tokens, temperature, "
    "top_p, n, best_of (= n), seed, stop (up to 4 strings), logprobs (0-5), echo, presence_penalty, "
    "frequency_penalty, stream, stream_options.include_usage, user, and vLLM's top_k, repetition_penalty, "
    "ignore_eos and return_token_ids."
)
MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_STOP_CHARS = 256  # one stop string's length
MAX_LOGPROBS = 5  # OpenAI's limit for completions
MAX_N = 16  # completions per prompt
MAX_CHOICES = 64  # prompts x n in one request
EXCERPT_CHARS = 40  # the most of a client's input an error message quotes


class ServeError(Exception):
    """A request the server refuses; becomes an OpenAI-style error body with this status code."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value", status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI's clients parse: {"error": {"message", "type", "param", "code"}}."""
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def excerpt(value: Any) -> str:
    """At most EXCERPT_CHARS characters of a client's value, for an error message (never the whole input)."""
    try:
        text = repr(value) if not isinstance(value, str) else repr(value[: EXCERPT_CHARS + 1])
    except RecursionError:
        return "a deeply nested value"
    return text if len(text) <= EXCERPT_CHARS else text[:EXCERPT_CHARS] + "..."


class StreamOptions(BaseModel):
    """OpenAI's stream_options: include_usage adds a last chunk with the token counts (with it, vLLM's
    continuous_usage_stats puts the counts so far in every chunk too)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False


class CompletionRequest(BaseModel):
    """POST /v1/completions, OpenAI's fields plus vLLM's extras; the prompt is checked by `prompts_of`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: Any = None
    max_tokens: int = 16  # OpenAI's default (also when the field is null)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None  # None: 1, as OpenAI and vLLM
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extra
    n: int = 1
    best_of: int | None = None
    logprobs: int | None = None
    echo: bool = False
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extra
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None
    seed: int | None = None
    user: str | None = None
    ignore_eos: bool = False  # vLLM's extra: keep going past end-of-text (what benchmarks use)
    return_token_ids: bool = False  # vLLM's extra: prompt_token_ids and token_ids in each choice

    @field_validator("max_tokens", "n", mode="before")
    @classmethod
    def _null_means_default(cls, value: object, info: Any) -> object:
        """OpenAI's clients may send null for "the default"."""
        return {"max_tokens": 16, "n": 1}[info.field_name] if value is None else value


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a checked request asks for: the sampling parameters of each of its n completions per prompt."""

    n: int
    params: tuple[SamplingParams, ...]  # one per completion of a prompt (seeds differ: seed + index)
    stop: tuple[str, ...]
    logprobs: int | None


def check_parameters(req: CompletionRequest) -> Plan:
    """Refuse what the server cannot honour, naming the parameter and the fix; the completions to run."""
    if req.prompt is None:
        raise ServeError("prompt is required.", "prompt", "missing_parameter")
    if req.max_tokens < 1:
        raise ServeError(f"max_tokens is {req.max_tokens}; ask for 1 token or more.", "max_tokens")
    if not 1 <= req.n <= MAX_N:
        raise ServeError(f"n is {req.n}; ask for 1 to {MAX_N} completions per prompt.", "n")
    if req.best_of is not None and req.best_of != req.n:
        raise ServeError(
            f"best_of={req.best_of} with n={req.n}: only best_of equal to n is served (every completion is "
            "returned); leave best_of out.",
            "best_of",
        )
    refusals = [
        ("logit_bias", bool(req.logit_bias), "logit_bias is not supported: leave it out"),
        ("suffix", req.suffix is not None, "suffix (insertion) is not supported: leave it out"),
        (
            "echo",
            req.echo and req.logprobs is not None,
            "echo with logprobs needs the prompt's logprobs, which this engine does not compute: leave one of them out",
        ),
    ]
    for param, refused, why in refusals:
        if refused:
            raise ServeError(f"{param} is not supported here: {why}. {SUPPORTED}", param=param)
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise ServeError(f"logprobs is {req.logprobs}; ask for 0 to {MAX_LOGPROBS} alternatives.", "logprobs")
    stop = check_stop(req.stop)
    base = {
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_k": 0 if req.top_k is None else req.top_k,
        "presence_penalty": req.presence_penalty or 0.0,
        "frequency_penalty": req.frequency_penalty or 0.0,
        "repetition_penalty": 1.0 if req.repetition_penalty is None else req.repetition_penalty,
        "logprobs": req.logprobs,
    }
    try:
        params = tuple(
            SamplingParams(**base, seed=None if req.seed is None else req.seed + index) for index in range(req.n)
        )
    except SamplingParamsError as exc:
        raise ServeError(str(exc), exc.param) from None
    return Plan(req.n, params, stop, req.logprobs)


def check_stop(stop: str | list[str] | None) -> tuple[str, ...]:
    """OpenAI's stop: a string or up to 4, none empty."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP:
        raise ServeError(f"stop has {len(stops)} sequences; give at most {MAX_STOP}.", "stop")
    for s in stops:
        if not s or len(s) > MAX_STOP_CHARS:
            raise ServeError(f"stop sequence {excerpt(s)} must have 1 to {MAX_STOP_CHARS} characters.", "stop")
        check_text(s, "stop")
    return tuple(stops)


def check_text(text: str, param: str) -> None:
    """A string the tokenizer can encode: UTF-8, so no lone surrogate (JSON allows "\\ud800", UTF-8 does not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ServeError(
            f"{param} has a lone surrogate ({exc.object[exc.start : exc.end]!r} at character {exc.start}), which "
            "is not text: send valid Unicode (pair surrogates, or escape the character properly).",
            param,
        ) from None


def prompts_of(prompt: Any, max_chars: int, max_tokens_per_prompt: int) -> list[str | list[int]]:
    """The request's prompts (one or several), each a string or token ids, checked before any tokenizing."""
    shape = "a string, a list of token ids, or a list of strings or of token-id lists"
    if prompt == "" or prompt == []:
        raise ServeError("prompt is empty: give at least one character or token id.", "prompt")
    if isinstance(prompt, str) or _is_token_list(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_list(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise ServeError(f"prompt is {excerpt(prompt)}; it must be {shape} (token ids are whole numbers).", "prompt")
    if len(prompts) > MAX_CHOICES:
        raise ServeError(f"prompt holds {len(prompts)} prompts; send at most {MAX_CHOICES} per request.", "prompt")
    for p in prompts:
        if not p:
            raise ServeError("prompt is empty: give at least one character or token id.", "prompt")
        if isinstance(p, str):
            if len(p) > max_chars:
                raise ServeError(
                    f"prompt has {len(p)} characters; this server takes at most {max_chars} (its model's context "
                    "holds fewer tokens than that anyway): shorten the prompt.",
                    "prompt",
                    "context_length_exceeded",
                )
            check_text(p, "prompt")
        elif len(p) > max_tokens_per_prompt:
            raise ServeError(
                f"prompt has {len(p)} token ids, but this model's context holds {max_tokens_per_prompt}: shorten it.",
                "prompt",
                "context_length_exceeded",
            )
    return prompts


def _is_token_list(value: Any) -> bool:
    """A non-empty JSON list of integers (booleans are not token ids)."""
    return (
        isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


# ---------------------------------------------------------------------------------- replies
def completion_body(
    request_id: str,
    model: str,
    choices: list[dict[str, Any]],
    usage: dict[str, int] | None = None,
) -> dict[str, Any]:
    """One `text_completion` object: the whole answer, or one streamed chunk of it."""
    body: dict[str, Any] = {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        body["usage"] = usage
    return body


def choice_body(
    index: int,
    text: str,
    finish_reason: str | None,
    logprobs: dict[str, list] | None = None,
    token_ids: list[int] | None = None,
    prompt_token_ids: list[int] | None = None,
) -> dict[str, Any]:
    """One choice: its text, why it ended (None while streaming), and the extras asked for."""
    choice: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = prompt_token_ids
    return choice


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's usage object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
