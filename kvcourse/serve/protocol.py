"""The OpenAI completions protocol as this server speaks it: the request, the checks, the replies.

Only greedy decoding exists in the course's engine, so every sampling parameter that would change
the output (temperature > 0, top_p < 1, n > 1, best_of > 1, logprobs, penalties, stop, echo,
suffix) is refused with a 400 that says what is supported, instead of being silently ignored.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

SUPPORTED = (
    "Supported: model, prompt (a string or a list of token ids), max_tokens, stream, "
    "stream_options.include_usage, temperature 0 (greedy), top_p 1, n 1, best_of 1, seed, user, "
    "and the extra fields ignore_eos and return_token_ids."
)


class ServeError(Exception):
    """A request the server refuses; becomes an OpenAI-style error body with this status code."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value", status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI's clients parse: {"error": {"message", "type", "param", "code"}}."""
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    """OpenAI's stream_options: include_usage adds a last chunk with the token counts."""

    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class CompletionRequest(BaseModel):
    """POST /v1/completions, OpenAI's fields plus vLLM's extras (ignore_eos, return_token_ids)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = 16  # OpenAI's default (also when the field is null)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    best_of: int | None = None
    logprobs: int | None = None
    echo: bool | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None
    seed: int | None = None  # accepted: greedy decoding is deterministic anyway
    user: str | None = None
    ignore_eos: bool = False  # vLLM's extra: keep going past end-of-text (what benchmarks use)
    return_token_ids: bool = False  # vLLM's extra: prompt_token_ids and token_ids in each choice

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _null_means_default(cls, value: object) -> object:
        """OpenAI's clients may send max_tokens: null for "the default"."""
        return 16 if value is None else value


def check_sampling(req: CompletionRequest) -> None:
    """Refuse every parameter the greedy engine cannot honour, naming the parameter and the fix."""
    refusals = [
        ("temperature", req.temperature not in (None, 0), "only greedy decoding is served: set temperature to 0"),
        ("top_p", req.top_p not in (None, 1), "only greedy decoding is served: leave top_p at 1"),
        ("n", req.n not in (None, 1), "one completion per request: set n to 1 and send several requests"),
        ("best_of", req.best_of not in (None, 1), "one completion per request: set best_of to 1"),
        ("logprobs", req.logprobs is not None, "logprobs are not computed by this engine: leave logprobs out"),
        ("echo", bool(req.echo), "echo is not supported: leave it out (the prompt is yours already)"),
        ("stop", bool(req.stop), "stop sequences are not supported: leave stop out and cut the text yourself"),
        ("presence_penalty", req.presence_penalty not in (None, 0), "penalties change sampling: leave them at 0"),
        ("frequency_penalty", req.frequency_penalty not in (None, 0), "penalties change sampling: leave them at 0"),
        ("logit_bias", bool(req.logit_bias), "logit_bias is not supported: leave it out"),
        ("suffix", req.suffix is not None, "suffix (insertion) is not supported: leave it out"),
    ]
    for param, refused, why in refusals:
        if refused:
            raise ServeError(f"{param}={getattr(req, param)!r} is not supported: {why}. {SUPPORTED}", param=param)


def one_prompt(req: CompletionRequest) -> str | list[int]:
    """The single prompt of a request (a list of one prompt is unwrapped; several are refused)."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise ServeError(
                f"prompt is a list of {len(prompt)} prompts; send one prompt per request (they are batched "
                "on the server anyway).",
                param="prompt",
            )
        prompt = prompt[0]
    if not prompt:
        raise ServeError("prompt is empty: give at least one character or token id.", param="prompt")
    return prompt


def completion_body(
    request_id: str,
    model: str,
    text: str,
    finish_reason: str | None,
    token_ids: list[int] | None = None,
    prompt_token_ids: list[int] | None = None,
    usage: dict[str, int] | None = None,
) -> dict[str, Any]:
    """One `text_completion` object: the whole answer, or one streamed chunk of it."""
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = prompt_token_ids
    body: dict[str, Any] = {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }
    if usage is not None:
        body["usage"] = usage
    return body


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's usage object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
