"""OpenAI's chat completions on top of the completions machinery: messages in, the assistant's message out.

    POST /v1/chat/completions   {"messages": [{"role": "user", "content": "Hi"}], ...}

A chat request is a completion request in disguise (vLLM's serving_chat does the same): the messages go
through the tokenizer's chat template into token ids, and the rest (sampling, n, stop, logprobs,
streaming, usage) is checked and served by the completions code unchanged. Only the reply's shape
differs: `chat.completion` with a `message`, or `chat.completion.chunk`s with a `delta` (the first one
carries the role), and logprobs as `{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

from kvcourse.serve.protocol import MAX_LOGPROBS, CompletionRequest, ServeError, StreamOptions, check_text, excerpt
from kvcourse.serve.reply import Choice, Reply, Update

CHAT_SUPPORTED = (
    "Supported: model, messages (role system, user or assistant; content a string or text parts), max_tokens "
    "(or max_completion_tokens), temperature, top_p, n, seed, stop (up to 4 strings), logprobs with "
    "top_logprobs (0-5), presence_penalty, frequency_penalty, stream, stream_options.include_usage, user, and "
    "vLLM's top_k, repetition_penalty and ignore_eos."
)
ROLES = ("system", "user", "assistant")
MAX_MESSAGES = 256


class ChatCompletionRequest(BaseModel):
    """POST /v1/chat/completions: OpenAI's fields (and vLLM's extras) this engine honours."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    messages: Any = None
    max_tokens: int | None = None  # None: as many as the context and the cache allow (vLLM's default)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    logprobs: bool = False
    top_logprobs: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None
    ignore_eos: bool = False

    @field_validator("n", mode="before")
    @classmethod
    def _null_means_one(cls, value: object) -> object:
        return 1 if value is None else value


def messages_of(messages: Any, max_chars: int) -> list[dict[str, str]]:
    """The conversation as [{"role", "content"}], checked (roles, text, total length) before any templating."""
    if not isinstance(messages, list) or not messages:
        raise ServeError(
            'messages is required: a non-empty list such as [{"role": "user", "content": "Hello"}].', "messages"
        )
    if len(messages) > MAX_MESSAGES:
        raise ServeError(f"messages holds {len(messages)} messages; send at most {MAX_MESSAGES}.", "messages")
    cleaned, total = [], 0
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ServeError(f"{where} must be an object with a role in {ROLES} (got {excerpt(message)}).", where)
        content = content_text(message.get("content"), where)
        check_text(content, where)
        total += len(content)
        cleaned.append({"role": message["role"], "content": content})
    if total > max_chars:
        raise ServeError(
            f"the messages hold {total} characters; this server takes at most {max_chars} (its model's context "
            "holds fewer tokens than that anyway): shorten the conversation.",
            "messages",
            "context_length_exceeded",
        )
    return cleaned


def content_text(content: Any, where: str) -> str:
    """A message's text: a string, or OpenAI's list of {"type": "text", "text": ...} parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise ServeError(
        f"{where}.content must be a string or a list of text parts (got {excerpt(content)}); this model reads text only.",
        f"{where}.content",
    )


def apply_template(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The conversation's token ids through the tokenizer's chat template, ready for the assistant's turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise ServeError(
            "this server's model has no chat template, so it cannot take messages: use POST /v1/completions "
            "with a prompt instead.",
            "messages",
        )
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    except Exception as exc:  # a template may refuse a conversation (e.g. roles out of order): the client's to fix
        raise ServeError(f"the model's chat template refused these messages: {str(exc)[:200]}", "messages") from None
    return [int(t) for t in ids]


def as_completion(chat: ChatCompletionRequest, prompt: list[int], max_tokens: int) -> CompletionRequest:
    """The completion request the chat request amounts to (its prompt the templated token ids)."""
    if chat.top_logprobs is not None and not chat.logprobs:
        raise ServeError("top_logprobs needs logprobs: true; set it, or leave top_logprobs out.", "top_logprobs")
    if chat.top_logprobs is not None and not 0 <= chat.top_logprobs <= MAX_LOGPROBS:
        raise ServeError(
            f"top_logprobs is {chat.top_logprobs}; ask for 0 to {MAX_LOGPROBS} alternatives.", "top_logprobs"
        )
    shared = chat.model_dump(
        include={"model", "stream", "stream_options", "temperature", "top_p", "top_k", "n", "stop", "seed", "user"}
        | {"presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "ignore_eos"}
    )
    if chat.stream_options is not None:
        shared["stream_options"] = chat.stream_options
    logprobs = (chat.top_logprobs or 0) if chat.logprobs else None
    return CompletionRequest(**shared, prompt=prompt, max_tokens=max_tokens, logprobs=logprobs)


def requested_max_tokens(chat: ChatCompletionRequest) -> int | None:
    """max_completion_tokens, else max_tokens (None: as many as fit); both given must agree."""
    a, b = chat.max_completion_tokens, chat.max_tokens
    if a is not None and b is not None and a != b:
        raise ServeError(
            f"max_tokens={b} and max_completion_tokens={a} disagree; give one of them.", "max_completion_tokens"
        )
    return a if a is not None else b


# ---------------------------------------------------------------------------------- replies
def chat_logprobs(chunk: dict[str, list] | None, num: int) -> dict[str, list] | None:
    """Completions-shaped logprobs (tokens, token_logprobs, top_logprobs) in the chat shape ({"content": [...]})."""
    if chunk is None:
        return None
    content = []
    for token, logprob, top in zip(chunk["tokens"], chunk["token_logprobs"], chunk["top_logprobs"]):
        alternatives = sorted(top.items(), key=lambda item: -item[1])[:num]
        content.append(
            {
                "token": token,
                "logprob": logprob,
                "bytes": list(token.encode("utf-8")),
                "top_logprobs": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))} for t, lp in alternatives
                ],
            }
        )
    return {"content": content}


class ChatReply(Reply):
    """A Reply whose bodies are chat completions: a message per choice, or deltas while streaming."""

    def _body(self, choices: list[dict[str, Any]], chunk: bool, usage: dict[str, int] | None = None) -> dict[str, Any]:
        body = super()._body(choices, chunk, usage)
        body["object"] = "chat.completion.chunk" if chunk else "chat.completion"
        return body

    def _logprobs(self, choice: Choice, logprobs: dict[str, list] | None) -> dict[str, list] | None:
        return chat_logprobs(logprobs, choice.num_logprobs or 0)

    def chunk(self, choice: Choice, update: Update, first: bool) -> dict[str, Any]:
        """One streamed chunk: the first of a choice names the role, later ones carry the new text."""
        delta: dict[str, Any] = {"role": "assistant", "content": update.text} if first else {"content": update.text}
        body = {
            "index": choice.index,
            "delta": delta,
            "logprobs": self._logprobs(choice, update.logprobs),
            "finish_reason": choice.finish_reason if update.done else None,
        }
        return self._body([body], chunk=True)

    def usage_chunk(self) -> dict[str, Any]:
        return self._body([], chunk=True, usage=self.usage)

    def whole(self) -> dict[str, Any]:
        """The answer once every choice has ended: each an assistant message."""
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": self._logprobs(c, c.logprobs if c.num_logprobs is not None else None),
                "finish_reason": c.finish_reason,
            }
            for c in self.choices
        ]
        return self._body(choices, chunk=False, usage=self.usage)
