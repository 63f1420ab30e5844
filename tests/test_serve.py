"""The server (kvcourse.serve) with real clients: openai for completions, httpx for disconnects and bad bodies.

Every server here listens on a free 127.0.0.1 port, is started by the test and stopped after it; every
wait is bounded in time. The engine is the tiny GPT-2; each greedy completion (temperature 0, sent
explicitly: an omitted temperature means 1, as in OpenAI's API) must equal Hugging Face's greedy output for
that prompt alone, whatever else runs at the same time. Sampling, n, stop, logprobs and hostile input:
tests/test_serve_clients.py.
"""

from __future__ import annotations

import json
import random
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
from kvcourse.serve.__main__ import main as serve_main
from kvcourse.serve.blocks import snapshot_from_json, snapshot_to_json
from kvcourse.serve.detokenize import decode
from kvcourse.serve.loadgen import format_summary, request_times, run_load, summarize
from kvcourse.serve.metrics import metric, parse_metrics
from kvcourse.viz.widgets import render_html

torch.set_num_threads(1)  # tiny matrices: one thread is faster on a shared 2-core machine
NUM_BLOCKS, BLOCK_SIZE = 12, 16  # 192 token slots: 64 clients force queueing and preemption
WAIT_S = 20.0  # the longest any wait in this file may take


@pytest.fixture(scope="module")
def model():
    return load_gpt2("tiny", verbose=False)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def server(model, tokenizer) -> Iterator[ServerThread]:
    app = build_app(
        model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, token_budget=64, max_batch_size=8, model_name="tiny"
    )
    with ServerThread(app) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=WAIT_S)


def wait_until(condition: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    """Poll `condition` until it holds; fail saying `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting until {what}")
        time.sleep(0.02)


def health(server: ServerThread) -> dict:
    return httpx.get(server.url + "/health", timeout=WAIT_S).json()


def all_blocks_free(server: ServerThread) -> bool:
    state = health(server)
    return state["num_free_blocks"] == state["num_blocks"] and state["num_running"] == state["num_waiting"] == 0


def metrics(server: ServerThread) -> dict[str, float]:
    return parse_metrics(httpx.get(server.url + "/metrics", timeout=WAIT_S).text)


@pytest.fixture
def slow_steps(server) -> Iterator[None]:
    """Each engine step takes 20 ms longer, so a 100-token request is surely mid-stream when we act."""
    engine = server.engine_loop.engine
    step = engine.step

    def slow_step(*args, **kwargs):
        time.sleep(0.02)
        return step(*args, **kwargs)

    engine.step = slow_step
    yield
    del engine.step  # back to the class's method


# ------------------------------------------------------------------------------- the happy path
def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    state = health(server)
    assert state["status"] == "ok" and state["num_blocks"] == NUM_BLOCKS and state["block_size"] == BLOCK_SIZE


def test_completion_equals_hf_greedy(client, model, tokenizer):
    prompt = "The capital of France is"
    reply = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choice = reply.choices[0]
    expected = hf_greedy(model, tokenizer.encode(prompt), 12)
    assert choice.model_extra["token_ids"] == expected
    assert choice.text == decode(tokenizer, expected)
    assert choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 12 and reply.usage.prompt_tokens == len(tokenizer.encode(prompt))


def test_streaming_sends_tokens_as_they_come_then_usage(client, model, tokenizer):
    prompt = [464, 3139, 286, 4881, 318]  # token ids are a prompt too
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
    )
    expected = hf_greedy(model, prompt, 10)
    token_chunks = [c for c in chunks if c.choices]
    assert len(token_chunks) >= 2, "tokens must stream as they are sampled, not all at the end"
    assert [t for c in token_chunks for t in c.choices[0].model_extra["token_ids"]] == expected
    assert "".join(c.choices[0].text for c in token_chunks) == decode(tokenizer, expected)
    assert [c.choices[0].finish_reason for c in token_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in token_chunks[:-1])
    assert chunks[-1].usage.completion_tokens == 10


def test_raw_stream_is_sse_ending_with_done(server):
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=WAIT_S) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "text_completion"


@pytest.mark.slow  # 64 streaming clients through one server: `./course test -m slow` (CI runs it)
def test_64_concurrent_streaming_clients_all_complete_exactly_and_leak_nothing(server, model, tokenizer):
    rng = random.Random(16)
    prompts = [[rng.randrange(50257) for _ in range(rng.randint(1, 40))] for _ in range(64)]
    lengths = [rng.randint(1, 24) for _ in prompts]
    finished_before = metric(metrics(server), "vllm:request_success_total", finished_reason="length")

    results, seconds = run_load(server.url + "/v1", prompts, lengths, "tiny", timeout=120)

    summary = summarize(results, seconds)
    print("\nload test:", format_summary(summary), f"(cache {NUM_BLOCKS} blocks, batch 8)")
    assert len(results) == 64
    for r in results:
        expected = hf_greedy(model, prompts[r.index], lengths[r.index])
        assert r.token_ids == expected, f"request {r.index}: differs from HF greedy for its prompt alone"
        assert r.text == decode(tokenizer, expected) and r.finish_reason == "length"
    wait_until(lambda: all_blocks_free(server), "every block is free after the load test")
    after = metrics(server)
    assert metric(after, "vllm:request_success_total", finished_reason="length") - finished_before == 64
    assert metric(after, "kvcourse:num_free_blocks") == NUM_BLOCKS and metric(after, "vllm:kv_cache_usage_perc") == 0
    assert metric(after, "vllm:time_to_first_token_seconds_count") >= 64
    assert metric(after, "vllm:prefix_cache_queries_total") >= sum(map(len, prompts))
    state = health(server)
    print("free blocks after:", state["num_free_blocks"], "of", NUM_BLOCKS, "| preemptions:", state["num_preemptions"])


@pytest.mark.usefixtures("slow_steps")
def test_debug_blocks_shows_a_running_request_in_the_widget_snapshot(server):
    body = {"model": "tiny", "prompt": [7] * 20, "max_tokens": 60, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=WAIT_S) as response:
        lines = response.iter_lines()
        request_id = int(json.loads(next(lines)[6:])["id"].removeprefix("cmpl-"))
        data = httpx.get(server.url + "/debug/blocks", timeout=WAIT_S).json()
    snap = snapshot_from_json(data)
    assert snap.num_blocks == NUM_BLOCKS and snap.block_size == BLOCK_SIZE
    assert len(snap.tables[request_id]) >= 2, "20 prompt tokens and more span at least two blocks of 16"
    assert all(snap.blocks[b].state == "used" for b in snap.tables[request_id])
    assert snapshot_from_json(snapshot_to_json(snap)) == snap
    assert f'data-request-id="{request_id}"' in render_html(snap)
    wait_until(lambda: all_blocks_free(server), "the request, abandoned, gives its blocks back")


def test_load_generator_sends_at_arrival_times_and_feeds_the_serving_study(server):
    from kvcourse.bench import serving

    prompts, lengths, arrivals = [[5, 6, 7], [8, 9], [10]], [3, 4, 1], [0.0, 0.15, 0.3]
    results, _ = run_load(server.url + "/v1", prompts, lengths, "tiny", arrivals=arrivals)
    assert [len(r.token_times) for r in results] == lengths == [r.completion_tokens for r in results]
    assert all(r.sent_at >= a - 0.01 for r, a in zip(results, arrivals)), "no client may start before its arrival"
    times = request_times(results, [len(p) for p in prompts])
    summary = serving.summarize(times, slo_ttft_s=60, slo_tpot_s=60)
    assert summary["requests"] == 3 and summary["goodput"] > 0
    with pytest.raises(ValueError, match="one of each per prompt"):
        run_load(server.url + "/v1", prompts, lengths, "tiny", arrivals=[0.0])


# ------------------------------------------------------------------------------- never leaks
@pytest.mark.usefixtures("slow_steps")
def test_client_that_disconnects_mid_stream_gives_its_blocks_back(server):
    before = metric(metrics(server), "vllm:request_success_total", finished_reason="abort")
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 100, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=WAIT_S) as response:
        lines = response.iter_lines()
        received = [line for line in (next(lines) for _ in range(6)) if line.startswith("data: ")]
        assert received, "the stream should have started"
        assert health(server)["num_free_blocks"] < NUM_BLOCKS, "the request should hold blocks mid-stream"
    # leaving the block closed the connection after about 3 of 100 tokens
    wait_until(lambda: all_blocks_free(server), "the aborted request's blocks are free")
    assert metric(metrics(server), "vllm:request_success_total", finished_reason="abort") == before + 1


@pytest.mark.usefixtures("slow_steps")
def test_non_streaming_client_that_gives_up_is_aborted_too(server):
    before = metric(metrics(server), "vllm:request_success_total", finished_reason="abort")
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 100, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.3)
    wait_until(
        lambda: metric(metrics(server), "vllm:request_success_total", finished_reason="abort") == before + 1,
        "the server notices the client left",
    )
    wait_until(lambda: all_blocks_free(server), "its blocks are free")


# ------------------------------------------------------------------------------- bad input: 400, words, still serving
LONG = [11] * 250  # fits no context of 256 with 16 more tokens
BIG = [11] * 200  # fits the context, but 13 blocks of 16 > the 12 in the cache
BAD_BODIES = [
    ({"prompt": "", "max_tokens": 4}, "prompt", "empty"),
    ({"prompt": [], "max_tokens": 4}, "prompt", "empty"),
    ({"prompt": "Hi", "max_tokens": 0}, "max_tokens", "1 token or more"),
    ({"prompt": LONG, "max_tokens": 16}, "max_tokens", "context holds 256"),
    ({"prompt": BIG, "max_tokens": 8}, "max_tokens", "--num-blocks 13"),
    ({"prompt": "Hi", "model": "gpt-4"}, "model", "serves 'tiny'"),
    ({"prompt": "Hi", "temperature": -0.5}, "temperature", "0 (greedy) or more"),
    ({"prompt": "Hi", "top_p": 0}, "top_p", "(0, 1]"),
    ({"prompt": "Hi", "top_k": -3}, "top_k", "0 or -1"),
    ({"prompt": "Hi", "presence_penalty": 2.5}, "presence_penalty", "between -2 and 2"),
    ({"prompt": "Hi", "n": 0}, "n", "1 to 16"),
    ({"prompt": "Hi", "n": 2, "best_of": 3}, "best_of", "best_of equal to n"),
    ({"prompt": "Hi", "logprobs": 6}, "logprobs", "0 to 5"),
    ({"prompt": "Hi", "echo": True, "logprobs": 1}, "echo", "prompt's logprobs"),
    ({"prompt": "Hi", "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"prompt": "Hi", "stop": [""]}, "stop", "1 to 256 characters"),
    ({"prompt": "Hi", "min_p": 0.1}, "min_p", "not a parameter"),
    ({"prompt": "Hi", "logit_bias": {"50": 5}}, "logit_bias", "not supported"),
    ({"prompt": [50257]}, "prompt", "outside the vocabulary"),
    ({"prompt": [1, True]}, "prompt", "whole numbers"),
    ({"prompt": "Hi", "max_tokens": True}, "max_tokens", "integer"),
    ({"prompt": "Hi", "stream": "yes"}, "stream", "boolean"),
    ({"prompt": "Hi", "seed": 1.5}, "seed", "integer"),
    ({"max_tokens": 4}, "prompt", "required"),
    ({"prompt": "Hi", "max_tokens": "many"}, "max_tokens", "integer"),
]


@pytest.mark.parametrize(("body", "param", "words"), BAD_BODIES, ids=[f"{b[1]}-{b[2][:12]}" for b in BAD_BODIES])
def test_bad_request_gets_400_openai_error_saying_what_to_fix(server, body, param, words):
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=WAIT_S)
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and words in error["message"]


def test_max_tokens_null_means_the_openai_default_of_16(server):
    body = {"prompt": "Hi", "max_tokens": None, "ignore_eos": True}
    reply = httpx.post(server.url + "/v1/completions", json=body, timeout=WAIT_S).json()
    assert reply["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b""], ids=["malformed", "array", "empty"])
def test_malformed_body_gets_400(server, content):
    response = httpx.post(
        server.url + "/v1/completions", content=content, headers={"content-type": "application/json"}, timeout=WAIT_S
    )
    assert response.status_code == 400
    assert "JSON" in response.json()["error"]["message"]


def test_openai_client_sees_bad_request_and_server_keeps_serving(client, server):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="Hi", max_tokens=4, temperature=-1.0)
    assert client.completions.create(model="tiny", prompt="Hi", max_tokens=4).choices[0].finish_reason
    wait_until(lambda: all_blocks_free(server), "nothing is held after the bad requests")


# ------------------------------------------------------------------------------- end of text, faults, prefix hits
class EosAt:
    """The GPT-2 tokenizer with another token playing end-of-text (random weights never sample 50256)."""

    def __init__(self, tokenizer, eos_token_id: int) -> None:
        self._tokenizer, self.eos_token_id = tokenizer, eos_token_id

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


@pytest.fixture(scope="module")
def eos_case(model, tokenizer):
    """A server whose end-of-text is the 4th token greedy decoding samples for PROMPT."""
    prompt = [464, 3290, 318]
    greedy = hf_greedy(model, prompt, 10)
    eos = greedy[3]
    app = build_app(
        model, num_blocks=32, tokenizer=EosAt(tokenizer, eos), enable_prefix_caching=True, model_name="tiny"
    )
    with ServerThread(app) as running:
        yield running, prompt, greedy, greedy.index(eos)


def test_generation_stops_at_end_of_text_unless_ignore_eos(eos_case):
    server, prompt, greedy, cut = eos_case
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=WAIT_S)
    ids = {"return_token_ids": True, "temperature": 0}
    stopped = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, extra_body=ids).choices[0]
    assert stopped.finish_reason == "stop" and stopped.model_extra["token_ids"] == greedy[: cut + 1]
    streamed = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=10, stream=True, extra_body=ids))
    assert [t for c in streamed for t in c.choices[0].model_extra["token_ids"]] == greedy[: cut + 1]
    assert streamed[-1].choices[0].finish_reason == "stop"
    full = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, extra_body={**ids, "ignore_eos": True})
    assert full.choices[0].finish_reason == "length" and full.choices[0].model_extra["token_ids"] == greedy
    wait_until(lambda: all_blocks_free(server), "every block is free")


def test_prefix_hits_show_in_metrics(eos_case):
    server = eos_case[0]
    prompt = list(range(100, 140))  # 40 tokens: two full blocks of 16 to share
    for _ in range(2):
        body = {"prompt": prompt, "max_tokens": 2, "ignore_eos": True}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=WAIT_S).status_code == 200
    values = metrics(server)
    assert metric(values, "vllm:prefix_cache_hits_total") >= 32
    assert metric(values, "vllm:prefix_cache_queries_total") >= 80


def test_a_failing_step_fails_its_requests_and_the_server_keeps_serving(eos_case):
    server, prompt, greedy, _ = eos_case
    runner = server.engine_loop.engine.runner

    def broken_execute(*args, **kwargs):
        del runner.execute  # fail once, then the real model again
        raise RuntimeError("simulated device fault")

    runner.execute = broken_execute
    body = {"prompt": prompt, "max_tokens": 5, "ignore_eos": True, "temperature": 0}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=WAIT_S)
    assert response.status_code == 500 and "simulated device fault" in response.json()["error"]["message"]
    wait_until(lambda: all_blocks_free(server), "the failed request's blocks are free")
    body["return_token_ids"] = True
    again = httpx.post(server.url + "/v1/completions", json=body, timeout=WAIT_S).json()
    assert again["choices"][0]["token_ids"] == greedy[:5]
    assert health(server)["status"] == "ok"


def test_a_fault_mid_stream_reaches_the_openai_client_as_an_error(eos_case):
    server, prompt, _, _ = eos_case
    runner = server.engine_loop.engine.runner
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=WAIT_S)

    def broken_execute(*args, **kwargs):
        del runner.execute
        raise RuntimeError("simulated device fault")

    runner.execute = broken_execute
    with pytest.raises(openai.APIError, match="simulated device fault"):
        list(client.completions.create(model="tiny", prompt=prompt, max_tokens=5, stream=True))
    wait_until(lambda: all_blocks_free(server), "the failed request's blocks are free")


def test_a_crashed_engine_loop_answers_503_instead_of_hanging(model):
    with ServerThread(build_app(model, num_blocks=16, model_name="tiny")) as server:
        engine_loop = server.engine_loop

        def crash() -> None:
            raise RuntimeError("a bug in the loop itself")

        engine_loop._deliver = crash  # the next cycle dies
        body = {"prompt": "Hi", "max_tokens": 2}
        first = httpx.post(server.url + "/v1/completions", json=body, timeout=WAIT_S)
        assert first.status_code in (500, 503)
        wait_until(lambda: not engine_loop.alive, "the loop thread has ended")
        assert httpx.get(server.url + "/health", timeout=WAIT_S).status_code == 503
        again = httpx.post(server.url + "/v1/completions", json=body, timeout=WAIT_S)
        assert again.status_code == 503 and "restart the server" in again.json()["error"]["message"]


# ------------------------------------------------------------------------------- the command line
def test_command_line_refuses_a_bad_cache_in_words(capsys):
    assert serve_main(["--model", "tiny", "--num-blocks", "0"]) == 2
    assert "num_blocks" in capsys.readouterr().err
