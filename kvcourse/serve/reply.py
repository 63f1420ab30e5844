"""One request's answer as it grows: per choice, the text (stop strings cut, as OpenAI), the logprobs, the usage.

Each choice turns its token ids into text with the IncrementalDetokenizer, then looks for its stop
strings in the whole text so far: at the first one found, the choice ends with finish_reason "stop"
and the stop string is not returned (vLLM's stop checker does the same). While streaming, the last
len(longest stop) - 1 characters are held back, so a stop string split over two chunks is never
half-sent. Logprobs take OpenAI's completions shape: tokens, token_logprobs, top_logprobs, text_offset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcourse.serve.detokenize import IncrementalDetokenizer
from kvcourse.serve.loop import RequestOutput
from kvcourse.serve.protocol import choice_body, completion_body, usage_body
from kvcourse.worker.sampler import TokenLogprobs

MIN_LOGPROB = -9999.0  # what vLLM reports for -inf (JSON has no infinity)


@dataclass
class Update:
    """What one engine output added to a choice: the new text, and the new tokens' logprobs."""

    text: str
    token_ids: list[int]
    logprobs: dict[str, list] | None
    done: bool  # the choice has ended (its length, end of text, a stop string, an abort)


class Choice:
    """One completion: its tokens, its text as returned, and why it ended."""

    def __init__(self, index: int, tokenizer: Any, stop: tuple[str, ...], logprobs: int | None, echo: str) -> None:
        self.index, self.tokenizer, self.stop, self.num_logprobs = index, tokenizer, stop, logprobs
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.echo = echo  # the prompt's text, returned first (echo=true), or ""
        self.text = ""  # what has been returned so far, after the echo
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.logprobs: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        self._offset = len(echo)  # text_offset of the next token
        self._started = False  # whether anything (the echo first) has been returned

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def add(self, output: RequestOutput) -> Update:
        """Take one engine output in; what it adds to the answer."""
        if self.done:
            return Update("", [], None, True)  # a choice a stop string ended ignores what the engine still sends
        self.token_ids.extend(output.new_token_ids)
        self.detokenizer.add(output.new_token_ids, final=output.finished)
        full = self.detokenizer.text  # the completion's text so far (whole characters only, until the end)
        stop_at = self._find_stop(full)
        if stop_at is not None:
            text, self.finish_reason = full[:stop_at], "stop"
        elif output.finished:
            text, self.finish_reason = full, output.finish_reason
        else:
            text = full[: len(full) - self.holdback] if self.holdback else full
        delta = text[len(self.text) :] if len(text) > len(self.text) else ""
        self.text = max(self.text, text, key=len)
        if not self._started:
            delta, self._started = self.echo + delta, True
        return Update(delta, list(output.new_token_ids), self._add_logprobs(output.logprobs), self.done)

    def _find_stop(self, text: str) -> int | None:
        """Where the earliest stop string starts in the text, if any does."""
        found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _add_logprobs(self, entries: list[TokenLogprobs | None] | None) -> dict[str, list] | None:
        """The new tokens' logprobs in OpenAI's shape (also appended to the whole choice's)."""
        if self.num_logprobs is None or entries is None:
            return None
        chunk: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for entry in entries:
            if entry is None:
                continue
            token = self._token_text(entry.token_id)
            top = {self._token_text(t): max(lp, MIN_LOGPROB) for t, lp in entry.top[: self.num_logprobs]}
            top.setdefault(token, max(entry.logprob, MIN_LOGPROB))  # the chosen token is always there
            for key, value in (
                ("tokens", token),
                ("token_logprobs", max(entry.logprob, MIN_LOGPROB)),
                ("top_logprobs", top),
                ("text_offset", self._offset),
            ):
                chunk[key].append(value)
                self.logprobs[key].append(value)
            self._offset += len(token)
        return chunk

    def _token_text(self, token_id: int) -> str:
        """One token on its own, as vLLM reports it (a split character shows as U+FFFD)."""
        return self.tokenizer.decode([token_id], clean_up_tokenization_spaces=False)

    def body(self, return_token_ids: bool, prompt_token_ids: list[int] | None) -> dict[str, Any]:
        """The whole choice, for the non-streaming answer."""
        return choice_body(
            self.index,
            self.echo + self.text,
            self.finish_reason,
            self.logprobs if self.num_logprobs is not None else None,
            list(self.token_ids) if return_token_ids else None,
            prompt_token_ids if return_token_ids else None,
        )


class Reply:
    """All choices of one request: n per prompt, choice i * n + j answering prompt i's j-th completion."""

    def __init__(
        self,
        request_id: str,
        model: str,
        prompts: list[list[int]],
        n: int,
        tokenizer: Any,
        stop: tuple[str, ...] = (),
        logprobs: int | None = None,
        echo_texts: list[str] | None = None,
        return_token_ids: bool = False,
    ) -> None:
        self.id, self.model, self.prompts, self.n, self.return_token_ids = (
            request_id,
            model,
            prompts,
            n,
            return_token_ids,
        )
        self.choices = [
            Choice(i, tokenizer, stop, logprobs, echo_texts[i // n] if echo_texts else "")
            for i in range(len(prompts) * n)
        ]

    @property
    def usage(self) -> dict[str, int]:
        """Prompt tokens once per prompt, completion tokens summed over every choice (as vLLM counts them)."""
        return usage_body(sum(map(len, self.prompts)), sum(len(c.token_ids) for c in self.choices))

    def prompt_of(self, index: int) -> list[int]:
        return self.prompts[index // self.n]

    def _body(self, choices: list[dict[str, Any]], chunk: bool, usage: dict[str, int] | None = None) -> dict[str, Any]:
        """The object around the choices (kvcourse/serve/chat.py's ChatReply names it a chat completion)."""
        del chunk  # a completion and its streamed chunks are the same object, text_completion
        return completion_body(self.id, self.model, choices, usage=usage)

    def chunk(self, choice: Choice, update: Update, first: bool) -> dict[str, Any]:
        """One streamed `text_completion` chunk: one choice's new text."""
        ids = self.return_token_ids
        body = choice_body(
            choice.index,
            update.text,
            choice.finish_reason if update.done else None,
            update.logprobs,
            update.token_ids if ids else None,
            self.prompt_of(choice.index) if ids and first else None,
        )
        return self._body([body], chunk=True)

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk of a stream with stream_options.include_usage: no choices, the usage."""
        return self._body([], chunk=True, usage=self.usage)

    def whole(self) -> dict[str, Any]:
        """The non-streaming answer, once every choice has ended."""
        choices = [c.body(self.return_token_ids, self.prompt_of(c.index)) for c in self.choices]
        return self._body(choices, chunk=False, usage=self.usage)
