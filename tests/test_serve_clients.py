"""The server's parameters and its defences, as real clients see them (the `openai` package and httpx).

Sampling (seeded runs repeat whatever else is in the batch), n completions sharing the prompt's blocks
through the prefix cache, stop strings, logprobs, echo, usage; then hostile input: a 50 MB body and huge
prompts must not freeze /health or other streams, and every malformed request is a 400 in OpenAI's
shape that quotes little of it. Servers listen on a free 127.0.0.1 port and stop after the module; every
wait is bounded in time. The 1 s bounds below are the issue's responsiveness contract (a frozen event
loop stalls for tens of seconds), not speed measurements.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from kvcourse.course.solutions_switch import solutions_enabled

if not solutions_enabled():
    pytest.skip(
        "the maintainers' tests run against the reference: set KVCOURSE_SOLUTIONS=1 (./course test does)",
        allow_module_level=True,
    )

import httpx
import openai

from kvcourse.engine.llm_engine import hf_greedy
from kvcourse.models.gpt2 import load_gpt2, load_tokenizer
from kvcourse.serve import ServerThread, build_app
from kvcourse.serve.__main__ import parse_args
from kvcourse.serve.blocks import snapshot_from_json
from kvcourse.serve.detokenize import decode
from kvcourse.serve.metrics import metric, parse_metrics
from kvcourse.serve.server import exposure_warning

torch.set_num_threads(1)
WAIT_S = 20.0  # the longest any wait in this file may take
BLOCK_SIZE = 16
PROMPT = "The KV cache of a serving engine"
SAMPLED = {"temperature": 0.8, "top_p": 0.9, "seed": 7}


@pytest.fixture(scope="module")
def model():
    return load_gpt2("tiny", verbose=False)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def server(model) -> Iterator[ServerThread]:
    app = build_app(model, num_blocks=64, block_size=BLOCK_SIZE, token_budget=256, max_batch_size=8, model_name="tiny")
    with ServerThread(app) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=WAIT_S)


@pytest.fixture
def slow_steps(server) -> Iterator[None]:
    """Each engine step takes 20 ms longer, so a long request is surely mid-stream when we act."""
    engine = server.engine_loop.engine
    step = engine.step

    def slow_step(*args, **kwargs):
        time.sleep(0.02)
        return step(*args, **kwargs)

    engine.step = slow_step
    yield
    del engine.step


def wait_until(condition: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting until {what}")
        time.sleep(0.02)


def metrics(server: ServerThread) -> dict[str, float]:
    return parse_metrics(httpx.get(server.url + "/metrics", timeout=WAIT_S).text)


def all_blocks_free(server: ServerThread) -> bool:
    state = httpx.get(server.url + "/health", timeout=WAIT_S).json()
    return state["num_free_blocks"] == state["num_blocks"] and state["num_running"] == state["num_waiting"] == 0


def ids_of(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def create(client, **kwargs):
    """A completion of PROMPT that runs its full length and returns its token ids."""
    extra = {"ignore_eos": True, "return_token_ids": True, **kwargs.pop("extra_body", {})}
    return client.completions.create(model="tiny", **{"prompt": PROMPT, "max_tokens": 16, **kwargs}, extra_body=extra)


def streamed(client, **kwargs) -> list:
    return list(create(client, stream=True, stream_options={"include_usage": True}, **kwargs))


# ------------------------------------------------------------------------------- sampling
def test_default_parameters_sample_at_temperature_one_in_openais_shape(client, model, tokenizer):
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16)
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-") and reply.model == "tiny"
    [choice] = reply.choices
    assert choice.index == 0 and choice.logprobs is None and choice.finish_reason in ("length", "stop")
    assert reply.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    greedy = hf_greedy(model, tokenizer.encode(PROMPT), 16)
    sampled = [ids_of(create(client, seed=s).choices[0]) for s in range(3)]
    assert any(s != greedy for s in sampled), "an omitted temperature is 1 (OpenAI's default), not greedy"


def test_seeded_sampling_repeats_alone_crowded_and_streamed(client):
    alone = ids_of(create(client, **SAMPLED).choices[0])
    assert alone == ids_of(create(client, **SAMPLED).choices[0])
    crowd: list = []
    others = [
        threading.Thread(target=lambda i=i: crowd.append(create(client, prompt=[i + 5] * (i + 3), seed=i)))
        for i in range(6)
    ]
    for thread in others:
        thread.start()
    crowded = ids_of(create(client, **SAMPLED).choices[0])  # in a batch with six other sampled requests
    for thread in others:
        thread.join(WAIT_S)
    assert len(crowd) == 6 and crowded == alone
    chunks = streamed(client, **SAMPLED)
    assert [t for c in chunks if c.choices for t in ids_of(c.choices[0])] == alone
    assert ids_of(create(client, **{**SAMPLED, "seed": 8}).choices[0]) != alone


def test_temperature_zero_is_hugging_face_greedy_and_top_k_one_too(client, model, tokenizer):
    greedy = hf_greedy(model, tokenizer.encode(PROMPT), 16)
    assert ids_of(create(client, temperature=0).choices[0]) == greedy
    assert ids_of(create(client, temperature=1.5, extra_body={"top_k": 1}).choices[0]) == greedy


def test_penalties_change_a_greedy_answer(client, model, tokenizer):
    prompt = [464] * 8  # a repetitive prompt: the repetition penalty discourages its token
    plain = ids_of(create(client, prompt=prompt, temperature=0, max_tokens=12).choices[0])
    penalized = create(client, prompt=prompt, temperature=0, max_tokens=12, frequency_penalty=2.0, presence_penalty=2.0)
    tokens = ids_of(penalized.choices[0])
    assert tokens != plain and len(set(tokens)) >= len(set(plain))
    assert ids_of(create(client, prompt=prompt, temperature=0, extra_body={"repetition_penalty": 1.3}).choices[0])


# ------------------------------------------------------------------------------- n > 1 through the prefix cache
@pytest.mark.usefixtures("slow_steps")
def test_n_completions_share_the_prompts_blocks_and_stream_their_index(server, client):
    prompt = list(range(1000, 1040))  # 40 tokens: two full blocks to share, never sent before
    hits_before = metric(metrics(server), "vllm:prefix_cache_hits_total")
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 30, "n": 4, "seed": 3, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=WAIT_S) as response:
        lines = response.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        parent = int(first["id"].removeprefix("cmpl-"))
        snap = snapshot_from_json(httpx.get(server.url + "/debug/blocks", timeout=WAIT_S).json())
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    tables = [snap.tables[rid] for rid in range(parent, parent + 4)]
    assert all(t[:2] == tables[0][:2] for t in tables), "the 4 children hold the same two prompt blocks"
    assert all(snap.blocks[b].ref_cnt == 4 for b in tables[0][:2])
    assert len({t[2] for t in tables}) == 4, "each child writes its own third block (its tokens differ)"
    hits = metric(metrics(server), "vllm:prefix_cache_hits_total") - hits_before
    assert hits == 3 * 32, "the prompt is computed once: each of the other three children hits 32 tokens"
    chunks = [first, *events]
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1, 2, 3}
    finals = [c["choices"][0] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(c["index"] for c in finals) == [0, 1, 2, 3] and {c["finish_reason"] for c in finals} == {"length"}
    wait_until(lambda: all_blocks_free(server), "the four children give their blocks back")


def test_n_choices_and_several_prompts_count_usage_per_choice(client, tokenizer):
    reply = create(client, n=3, seed=1, max_tokens=5)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({tuple(ids_of(c)) for c in reply.choices}) > 1, "seeds seed, seed + 1, seed + 2 differ"
    assert reply.usage.completion_tokens == 15 and reply.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    two = client.completions.create(model="tiny", prompt=["Hello", [5, 6, 7]], n=2, max_tokens=3, temperature=0)
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert two.choices[0].text == two.choices[1].text, "greedy: a prompt's two completions agree"
    assert two.usage.prompt_tokens == len(tokenizer.encode("Hello")) + 3
    assert two.usage.completion_tokens == sum(u for u in [3] * 4)  # 3 tokens each, unless end of text came first
    chunks = streamed(client, n=2, max_tokens=4, seed=2)
    assert chunks[-1].usage.completion_tokens == sum(len(ids_of(c.choices[0])) for c in chunks if c.choices) == 8
    options = {"include_usage": True, "continuous_usage_stats": True}  # vLLM's: the counts so far in every chunk
    counts = [c.usage.completion_tokens for c in create(client, max_tokens=4, stream=True, stream_options=options)]
    assert counts == sorted(counts) and counts[-1] == 4 and len(counts) == 5


# ------------------------------------------------------------------------------- stop, echo
def test_stop_strings_cut_the_text_as_openai_does(server, client, tokenizer):
    full = create(client, temperature=0, max_tokens=24).choices[0].text
    stop = full[7:11]  # crosses a token boundary somewhere in the middle
    cut = full[: full.find(stop)]
    before = metric(metrics(server), "vllm:request_success_total", finished_reason="stop")
    reply = create(client, temperature=0, max_tokens=24, stop=["never here", stop])
    assert reply.choices[0].text == cut and reply.choices[0].finish_reason == "stop"
    chunks = streamed(client, temperature=0, max_tokens=24, stop=stop)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == cut
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens < 24, "the request ended at the stop string, not at max_tokens"
    unmatched = create(client, temperature=0, max_tokens=24, stop=["never here"]).choices[0]
    assert unmatched.text == full and unmatched.finish_reason == "length"
    wait_until(lambda: all_blocks_free(server), "stopped requests give their blocks back")
    assert metric(metrics(server), "vllm:request_success_total", finished_reason="stop") == before + 2


def test_echo_returns_the_prompt_first(client):
    reply = create(client, temperature=0, echo=True, max_tokens=4)
    alone = create(client, temperature=0, max_tokens=4)
    assert reply.choices[0].text == PROMPT + alone.choices[0].text
    chunks = streamed(client, temperature=0, echo=True, max_tokens=4)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reply.choices[0].text


# ------------------------------------------------------------------------------- logprobs
def test_logprobs_are_consistent_and_sum_to_the_sequences_logprob(client, model, tokenizer):
    reply = create(client, temperature=0, logprobs=3, max_tokens=10)
    choice = reply.choices[0]
    lp = choice.logprobs
    tokens = ids_of(choice)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    assert lp.tokens == [decode(tokenizer, [t]) for t in tokens]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)]
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and chosen <= 0 and math.isclose(chosen, max(top.values()), abs_tol=1e-5)
        assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-5
    # the chosen tokens' logprobs sum to the sequence's log-likelihood under the model, computed by HF
    ids = torch.tensor([tokenizer.encode(PROMPT) + tokens])
    with torch.inference_mode():
        logits = model(ids).logits[0, -len(tokens) - 1 : -1]
    expected = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens)[:, None]).sum().item()
    assert math.isclose(sum(lp.token_logprobs), expected, abs_tol=1e-3)
    chunks = streamed(client, temperature=0, logprobs=3, max_tokens=10)
    assert [v for c in chunks if c.choices for v in c.choices[0].logprobs.token_logprobs] == pytest.approx(
        lp.token_logprobs
    )
    assert [o for c in chunks if c.choices for o in c.choices[0].logprobs.text_offset] == lp.text_offset


def test_sampled_logprobs_always_include_the_chosen_token(client):
    reply = create(client, logprobs=1, temperature=1.5, seed=11, max_tokens=12)
    lp = reply.choices[0].logprobs
    assert all(token in top and 1 <= len(top) <= 2 for token, top in zip(lp.tokens, lp.top_logprobs))
    assert len(create(client, logprobs=0, max_tokens=3, temperature=0).choices[0].logprobs.top_logprobs[0]) == 1


# ------------------------------------------------------------------------------- never frozen by input
# The hostile clients run in their own process, so that what is timed here is the server, not this
# process's own threads building and sending 55 MB.
SENDER = """
import json, sys, threading, httpx
url, paths, outcomes = sys.argv[1], sys.argv[2:], {}
def send(index, path):
    content = open(path, "rb").read()
    try:
        response = httpx.post(url, content=content, headers={"content-type": "application/json"}, timeout=20)
        outcomes[index] = [response.status_code, response.json()["error"]["code"], len(response.content)]
    except httpx.TransportError:  # the server may close the socket while a 50 MB body is still being sent
        outcomes[index] = [413, "closed", 0]
threads = [threading.Thread(target=send, args=item) for item in enumerate(paths)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join(30)
print(json.dumps(outcomes))
"""


def test_a_50_mb_body_and_huge_prompts_freeze_neither_health_nor_streams(server, slow_steps, tmp_path):
    url = server.url + "/v1/completions"
    gaps, health_waits = [], []
    stream_body = {"prompt": [7] * 8, "max_tokens": 120, "temperature": 0, "stream": True, "ignore_eos": True}

    def stream() -> None:
        last = time.monotonic()
        with httpx.stream("POST", url, json=stream_body, timeout=WAIT_S) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now

    bodies = [b'{"prompt": "' + b"x" * (50 << 20) + b'"}']
    bodies += [json.dumps({"prompt": [11] * 100_000}).encode()] * 5  # token ids: ~600 KB each, within the limit
    bodies += [json.dumps({"prompt": "word " * 100_000}).encode()] * 5  # 500,000 characters: never tokenized
    paths = []
    for index, content in enumerate(bodies):
        paths.append(tmp_path / f"body{index}.json")
        paths[-1].write_bytes(content)
    streamer = threading.Thread(target=stream)
    streamer.start()
    wait_until(lambda: len(gaps) >= 2, "the stream has started")
    senders = subprocess.Popen([sys.executable, "-c", SENDER, url, *map(str, paths)], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + WAIT_S
    try:
        while senders.poll() is None or len(health_waits) < 20:
            start = time.monotonic()
            assert httpx.get(server.url + "/health", timeout=WAIT_S).status_code == 200
            health_waits.append(time.monotonic() - start)
            time.sleep(0.05)
            assert start < deadline, f"the hostile clients did not finish within {WAIT_S} s"
        outcomes = {int(k): v for k, v in json.loads(senders.communicate(timeout=WAIT_S)[0]).items()}
    finally:
        senders.kill()
    streamer.join(WAIT_S)
    print(
        f"\n/health: {len(health_waits)} calls, longest {max(health_waits):.3f} s; stream: longest gap {max(gaps[1:]):.3f} s"
    )
    assert sorted(outcomes) == list(range(11)) and outcomes[0][0] == 413
    assert all(outcomes[i][0] == 400 and outcomes[i][2] < 1000 for i in range(1, 11)), outcomes
    assert health_waits and max(health_waits) < 1.0, f"/health waited {max(health_waits):.2f} s"
    assert len(gaps) > 100 and max(gaps[1:]) < 1.0, f"a stream stalled {max(gaps[1:]):.2f} s"


def test_a_chunked_body_over_the_limit_is_cut_off_with_a_413(server):
    def body() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(64):
            yield b"y" * 65536  # 4 MiB in all, with no Content-Length
        yield b'"}'

    try:
        response = httpx.post(
            server.url + "/v1/completions", content=body(), headers={"content-type": "application/json"}
        )
    except httpx.TransportError:
        return  # closed while we were still sending: the server stopped reading, which is the point
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


RAW_BAD = [
    (b'{"prompt": "a\\ud800b"}', "application/json", "lone surrogate"),
    (b'{"prompt": "hi", "stop": "\\udfff"}', "application/json", "lone surrogate"),
    (b"[" * 100_000 + b"]" * 100_000, "application/json", "too deeply"),
    (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "application/json", "too deeply"),
    (b'{"prompt": ' + b"[" * 900 + b"]" * 900 + b"}", "application/json", "prompt"),
    (b'{"prompt": "hi", "user": ' + b"[" * 900 + b"]" * 900 + b"}", "application/json", "user"),
    (json.dumps({"prompt": ["a"] * 20, "n": 4}).encode(), "application/json", "at most 64"),
    (b'{"prompt": "hi"}', "text/plain", "Content-Type"),
    (b'{"prompt": "hi"}', "application/x-www-form-urlencoded", "Content-Type"),
    (b'{"prompt": "hi", "n": true}', "application/json", "integer"),
    (b'{"prompt": "hi", "temperature": NaN}', "application/json", "finite"),
    (b'{"prompt": "hi", "' + b"z" * 500_000 + b'": 1}', "application/json", "not a parameter"),
    (b'{"prompt": "hi", "model": "' + b"m" * 500_000 + b'"}', "application/json", "not served here"),
]


@pytest.mark.parametrize(("content", "media_type", "words"), RAW_BAD, ids=[w for _, _, w in RAW_BAD])
def test_malformed_input_is_a_short_400_in_openais_shape(server, content, media_type, words):
    response = httpx.post(
        server.url + "/v1/completions", content=content, headers={"content-type": media_type}, timeout=WAIT_S
    )
    assert response.status_code == 400 and len(response.content) < 1000, "the error quotes a short excerpt at most"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert words in error["message"]


def test_unknown_routes_and_methods_answer_in_openais_shape(server):
    for method, path, status in (("GET", "/v1/chat", 404), ("GET", "/v1/completions", 405), ("POST", "/health", 405)):
        response = httpx.request(method, server.url + path, timeout=WAIT_S)
        assert response.status_code == status
        assert response.json()["error"]["type"] == "invalid_request_error", response.text


def test_debug_blocks_can_be_turned_off_and_binding_beyond_loopback_warns(model):
    assert exposure_warning("127.0.0.1") is None and exposure_warning("localhost") is None
    assert "anyone who can reach" in exposure_warning("0.0.0.0")
    assert parse_args(["--host", "0.0.0.0"]).enable_debug_blocks is False
    with ServerThread(build_app(model, num_blocks=8, model_name="tiny", debug_endpoints=False)) as private:
        response = httpx.get(private.url + "/debug/blocks", timeout=WAIT_S)
        assert response.status_code == 403 and "--enable-debug-blocks" in response.json()["error"]["message"]
