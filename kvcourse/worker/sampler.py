"""Sampling: from each sequence's logits to its next token, batched, as vLLM v1's Sampler does it.

vLLM's order (vllm/v1/sample/sampler.py), for every sequence of the batch at once:

    raw logprobs = log_softmax(logits)                 what `logprobs` reports (vLLM's default, raw_logprobs)
    logits -= penalties                                presence, frequency (output tokens), repetition (all)
    greedy rows: argmax                                temperature 0
    random rows: logits / temperature -> top-k and top-p masks -> softmax -> one draw per row

Each row's draw takes one uniform number from its request's own `torch.Generator`, seeded from `seed`
when given: the same seed gives the same tokens whatever else shares the batch. (vLLM draws V
exponentials per row and takes argmax(probs / q); `random_sample` says why this one differs.)
The engine's default is greedy (GREEDY), so its output still equals Hugging Face's
`generate(do_sample=False)`; the server, like OpenAI's API, samples at temperature 1 when the client
says nothing.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

SAMPLING_EPS = 1e-5  # a temperature below this is greedy (vLLM's _SAMPLING_EPS)
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
PENALTY_RANGE = (-2.0, 2.0)  # presence and frequency penalties, as OpenAI and vLLM bound them
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes
DEFAULTS = {  # what None means for each parameter (OpenAI's and vLLM's defaults)
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
}


class SamplingParamsError(ValueError):
    """A sampling parameter out of range; `param` names it (the server's 400 says which)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens (vLLM's SamplingParams, the sampling part).

    temperature: 0 is greedy; otherwise logits are divided by it before the draw (OpenAI's default is 1).
    top_p: keep the smallest set of most likely tokens whose probability reaches top_p (1: all).
    top_k: keep the k most likely tokens (0 or -1: all).
    seed: the request's own random stream (None: a fresh nondeterministic one).
    presence_penalty, frequency_penalty: subtracted from the logit of each token already generated,
        once, and once per occurrence (-2 to 2).
    repetition_penalty: divides a positive logit (multiplies a negative one) of every token seen in
        the prompt or the output (vLLM's; 1 is off).
    logprobs: return the chosen token's log-probability and this many top alternatives' (None: none).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        """Refuse every value the sampler cannot honour, saying which and what is allowed (None: the default)."""
        for name in ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, DEFAULTS[name])
        temperature = _real("temperature", self.temperature)
        if temperature < 0:
            raise SamplingParamsError("temperature", f"temperature is {temperature}; it must be 0 (greedy) or more.")
        top_p = _real("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise SamplingParamsError("top_p", f"top_p is {top_p}; it must be in (0, 1] (1 keeps every token).")
        top_k = _whole("top_k", self.top_k)
        if top_k < -1:
            raise SamplingParamsError("top_k", f"top_k is {top_k}; it must be 1 or more, or 0 or -1 for all tokens.")
        if self.seed is not None:
            seed = _whole("seed", self.seed)
            if not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
                raise SamplingParamsError("seed", f"seed is {seed}; it must fit in 64 bits ({SEED_RANGE}).")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _real(name, getattr(self, name))
            if not PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1]:
                raise SamplingParamsError(name, f"{name} is {value}; it must be between -2 and 2.")
        if _real("repetition_penalty", self.repetition_penalty) <= 0:
            raise SamplingParamsError(
                "repetition_penalty", f"repetition_penalty is {self.repetition_penalty}; it must be above 0 (1: off)."
            )
        if self.logprobs is not None:
            logprobs = _whole("logprobs", self.logprobs)
            if not 0 <= logprobs <= MAX_LOGPROBS:
                raise SamplingParamsError(
                    "logprobs", f"logprobs is {logprobs}; ask for 0 to {MAX_LOGPROBS} alternatives per token."
                )

    @property
    def is_greedy(self) -> bool:
        """Temperature 0: the most likely token, no randomness."""
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        """Whether any penalty changes the logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)


def _real(name: str, value: Any) -> float:
    """A finite real number (not a bool), or a SamplingParamsError naming the parameter."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise SamplingParamsError(name, f"{name} is {_short(value)}; it must be a finite number.")
    return float(value)


def _whole(name: str, value: Any) -> int:
    """A whole number (not a bool), or a SamplingParamsError naming the parameter."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise SamplingParamsError(name, f"{name} is {_short(value)}; it must be a whole number.")
    return int(value)


def _short(value: Any) -> str:
    """A value and its type, cut short for an error message."""
    text = repr(value)
    return f"{text[:40]}... ({type(value).__name__})" if len(text) > 40 else f"{text} ({type(value).__name__})"


GREEDY = SamplingParams(temperature=0.0)  # the engine's default: equal to Hugging Face's greedy generate


# ---------------------------------------------------------------------------------- the batched operations
def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    presence: Sequence[float],
    frequency: Sequence[float],
    repetition: Sequence[float],
) -> torch.Tensor:
    """vLLM's penalties on [B, V] logits: repetition on prompt and output tokens, then presence/frequency on output.

    Only the tokens a row has seen change, so each row touches those columns alone (no [B, V] count table).
    """
    logits = logits.clone()
    for row in range(logits.shape[0]):
        rep = float(repetition[row])
        if rep != 1:
            seen = torch.tensor(sorted(set(prompt_ids[row]) | set(output_ids[row])), device=logits.device)
            values = logits[row, seen]
            logits[row, seen] = torch.where(values > 0, values / rep, values * rep)
        if output_ids[row]:
            ids, counts = torch.tensor(output_ids[row], device=logits.device).unique(return_counts=True)
            logits[row, ids] -= float(frequency[row]) * counts + float(presence[row])
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (-inf) what top-k, then top-p, leave out, per row; top_k [B] holds V (and top_p 1) for "all".

    vLLM's rule: top-k keeps the k largest logits (ties with the k-th too); top-p then keeps the most
    likely tokens, in order, while the probability before each is below p (the most likely always stays).
    """
    vocab = logits.shape[1]
    limited = top_k < vocab if top_k is not None else None
    if limited is not None and bool(limited.any()):
        k_max = int(top_k[limited].max())  # rows without a limit must not make topk sort the whole vocabulary
        kth = logits.topk(k_max, dim=-1).values.gather(1, (top_k.long().clamp(1, k_max) - 1)[:, None])
        logits = logits.masked_fill((logits < kth) & limited[:, None], -math.inf)
    if top_p is not None and bool((top_p < 1).any()):
        probs = logits.softmax(dim=-1)
        descending = _sort_descending(probs)
        before = descending.cumsum(dim=-1) - descending  # probability of the tokens ahead of each one
        last_kept = ((before < top_p[:, None]).sum(dim=-1) - 1).clamp(min=0)
        threshold = descending.gather(1, last_kept[:, None])
        logits = logits.masked_fill(probs < threshold, -math.inf)
    return logits


def _sort_descending(values: torch.Tensor) -> torch.Tensor:
    """Each row's values, largest first (on a CPU through numpy's sort, several times faster than torch's there)."""
    if values.device.type == "cpu":
        return torch.from_numpy(np.ascontiguousarray(np.sort(values.numpy(), axis=-1)[:, ::-1]))
    return values.sort(dim=-1, descending=True).values


def random_sample(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row, drawn from its probabilities with one uniform number from the row's own generator.

    Inverse-CDF sampling (what torch.multinomial does): the first token whose cumulative probability
    passes u. vLLM draws V exponentials per row instead (argmax(probs / q), no host sync on a GPU); on a
    CPU the V logarithms cost more than the whole rest of the step, and one number per token keeps each
    request's stream just as independent of the batch.
    """
    cumulative = probs.cumsum(dim=-1, dtype=torch.float64)
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64, device=probs.device) for g in generators])
    targets = (u * cumulative[:, -1]).unsqueeze(1)
    return torch.searchsorted(cumulative, targets, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


# ---------------------------------------------------------------------------------- per-request state
@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled position: the chosen token's log-probability and the top alternatives', most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass
class _RequestState:
    """What the sampler keeps for one request: its parameters, its random stream, its logprobs so far."""

    request: Any  # kvcourse.core.request.Request: its prompt and output tokens feed the penalties
    params: SamplingParams
    generator: torch.Generator | None = None
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)  # output position -> its logprobs


class Sampler:
    """Samples a batch's next tokens, each row by its request's SamplingParams (GREEDY if it has none)."""

    def __init__(self) -> None:
        self._states: dict[int, _RequestState] = {}

    def add_request(self, request: Any) -> None:
        """Follow a request (its `sampling_params`, None for greedy) until it finishes."""
        params = request.sampling_params or GREEDY
        if params != GREEDY:  # plain greedy needs no state: its rows take the argmax
            self._states[request.id] = _RequestState(request, params)

    def logprobs(self, request_id: int) -> dict[int, TokenLogprobs]:
        """The logprobs recorded for a request, by output position (empty when it asked for none)."""
        state = self._states.get(request_id)
        return state.logprobs if state is not None else {}

    def __call__(self, logits: torch.Tensor, request_ids: list[int]) -> list[int]:
        """The next token of each row of logits [B, V]; row i belongs to request_ids[i]."""
        self._forget_finished()
        states = [self._states.get(rid) for rid in request_ids]
        if not any(states):
            return logits.argmax(dim=-1).tolist()  # all greedy: the fast path, bit for bit the old one
        params = [s.params if s is not None else GREEDY for s in states]
        logits = logits.float()
        want_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits[want_logprobs], dim=-1) if want_logprobs else None
        logits = self._penalized(logits, states, params)
        rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if len(rows) == len(params):  # every row samples: no argmax, no copies of row subsets
            tokens = self._sample_rows(logits, states)
        else:
            tokens = logits.argmax(dim=-1)
            if rows:
                tokens[rows] = self._sample_rows(logits[rows], [states[i] for i in rows])
        token_list = tokens.tolist()
        if raw_logprobs is not None:
            self._record_logprobs(raw_logprobs, [(states[i], token_list[i]) for i in want_logprobs])
        return token_list

    # ---- helpers ----
    def _forget_finished(self) -> None:
        """Drop the state of requests that have ended (their logprobs were read after their last step)."""
        for rid in [rid for rid, s in self._states.items() if s.request.status.is_finished()]:
            del self._states[rid]

    def _penalized(self, logits: torch.Tensor, states: list, params: list[SamplingParams]) -> torch.Tensor:
        """The logits with each row's penalties applied (rows without any are left as they are)."""
        rows = [i for i, p in enumerate(params) if p.has_penalties]
        if not rows:
            return logits

        def column(name: str) -> list[float]:
            return [getattr(params[i], name) for i in rows]

        logits = logits.clone()
        logits[rows] = apply_penalties(
            logits[rows],
            [list(states[i].request.prompt_tokens) for i in rows],
            [list(states[i].request.output_tokens) for i in rows],
            column("presence_penalty"),
            column("frequency_penalty"),
            column("repetition_penalty"),
        )
        return logits

    def _sample_rows(self, logits: torch.Tensor, states: list[_RequestState]) -> torch.Tensor:
        """Temperature, top-k and top-p, then one draw from each request's own generator."""
        vocab, device = logits.shape[1], logits.device
        params = [s.params for s in states]
        logits = logits / torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
        top_k = [p.top_k if p.top_k > 0 else vocab for p in params]
        top_p = [p.top_p for p in params]
        logits = apply_top_k_top_p(
            logits,
            torch.tensor(top_k, device=device) if any(k < vocab for k in top_k) else None,
            torch.tensor(top_p, device=device) if any(p < 1 for p in top_p) else None,
        )
        return random_sample(torch.softmax(logits, dim=-1), [self._generator(s, device) for s in states])

    @staticmethod
    def _generator(state: _RequestState, device: torch.device) -> torch.Generator:
        """The request's random stream, made on first use: seeded, or from the OS's entropy."""
        if state.generator is None:
            state.generator = torch.Generator(device=device)
            if state.params.seed is None:
                state.generator.seed()
            else:
                state.generator.manual_seed(state.params.seed)
        return state.generator

    @staticmethod
    def _record_logprobs(raw: torch.Tensor, rows: list[tuple[_RequestState, int]]) -> None:
        """Keep each row's chosen-token logprob and top alternatives, at the output position the token takes."""
        widest = max(s.params.logprobs or 0 for s, _ in rows)
        top_values, top_ids = raw.topk(widest, dim=-1) if widest else (raw[:, :0], raw[:, :0].long())
        for row, (state, token) in enumerate(rows):
            k = state.params.logprobs or 0
            top = tuple(zip(top_ids[row, :k].tolist(), top_values[row, :k].tolist()))
            position = len(state.request.output_tokens)
            state.logprobs[position] = TokenLogprobs(token, float(raw[row, token]), top)
