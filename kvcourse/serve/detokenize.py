"""Token ids to text, one streamed chunk at a time, without ever sending half a character.

GPT-2's byte-level BPE can split one UTF-8 character over two tokens: decoding the first alone gives
U+FFFD. So each chunk is the new tail of the whole output's text, held back while that text ends in
an incomplete character; the chunks then add up to exactly `decode(all tokens)`.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


def decode(tokenizer: Any, token_ids: list[int]) -> str:
    """The text of some tokens; end-of-text and other special tokens are not text (as in vLLM)."""
    return tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.text = ""  # what has been sent so far

    def add(self, new_token_ids: list[int], final: bool = False) -> str:
        """The text the new tokens add; at the end (final=True) everything left, even a broken character."""
        self.token_ids.extend(new_token_ids)
        full = decode(self.tokenizer, self.token_ids)
        if (full.endswith(REPLACEMENT) and not final) or not full.startswith(self.text):
            return ""
        delta = full[len(self.text) :]
        self.text = full
        return delta
