"""The models the course serves, by name: `load_model(name) -> (model, tokenizer)`, offline (vLLM: the model registry).

    smollm2                 SmolLM2-135M-Instruct, a Llama (GQA, RoPE) chat model: the default for real text.
                            Converted once by ./course setup (kvcourse/models/smollm2.py).
    gpt2 ... gpt2-xl        GPT-2, pretrained when a local copy or the Hub is there, else seeded random weights.
    tiny                    a 2-layer GPT-2 with seeded random weights, for tests.

Every tokenizer returned has a chat template: SmolLM2's own; GPT-2 was never trained on one, so its
tokenizers get PLAIN_CHAT_TEMPLATE ("user: ...\\nassistant:") for the server's chat endpoint, and
`is_instruct(name)` tells callers (the generate command) to send GPT-2 the raw prompt instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

DEFAULT_MODEL = "smollm2"
INSTRUCT_MODELS = frozenset({"smollm2"})
GPT2_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")  # kvcourse/models/gpt2.py's GPT2_SIZES (tested)
# A template for models trained without one: each message as "role: content", then "assistant:".
PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)


def model_names() -> list[str]:
    """Every name load_model accepts."""
    return ["smollm2", *GPT2_NAMES, "tiny"]


def is_instruct(name: str) -> bool:
    """Whether the model was trained to chat (its prompts go through the chat template)."""
    return name in INSTRUCT_MODELS


def gpt2_tokenizer() -> Any:
    """A fresh GPT-2 tokenizer (not the shared cached one) carrying PLAIN_CHAT_TEMPLATE."""
    from kvcourse.models.gpt2 import load_tokenizer

    tokenizer = load_tokenizer.__wrapped__()
    tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
    return tokenizer


def load_model(name: str = DEFAULT_MODEL, *, verbose: bool = False) -> tuple[Any, Any]:
    """(model, tokenizer) for a name of model_names(); a ValueError names the choices, ModelNotAvailable says how to fix."""
    if name == "smollm2":
        from kvcourse.models.smollm2 import load_smollm2

        return load_smollm2()
    if name in GPT2_NAMES or name == "tiny":
        from kvcourse.models.gpt2 import load_gpt2

        return load_gpt2(name, verbose=verbose), gpt2_tokenizer()
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(model_names())}.")


def chat_prompt(tokenizer: Any, messages: Sequence[dict[str, Any]]) -> list[int]:
    """The token ids of a conversation through the tokenizer's chat template, ready for the assistant's turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this tokenizer has no chat template: send the raw prompt instead (no chat formatting).")
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True, return_dict=False)
    return [int(t) for t in ids]


def stop_token_id(model: Any) -> int | None:
    """The end-of-sequence id Hugging Face's generate stops at for this model (None: it never stops early)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return None if eos is None else int(eos)
