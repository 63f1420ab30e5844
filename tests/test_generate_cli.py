"""`python -m kvcourse generate`: greedy through LLMEngine, token for token Hugging Face's own generate.

On the tiny random GPT-2 always (raw prompt and chat template, with and without an end-of-sequence
token); on the real SmolLM2-135M-Instruct where ./course setup converted it, else the test skips.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from kvcourse.course.solutions_switch import solutions_enabled

if not solutions_enabled():
    pytest.skip(
        "the maintainers' tests run against the reference: set KVCOURSE_SOLUTIONS=1 (./course test does)",
        allow_module_level=True,
    )

from kvcourse.__main__ import main as kvcourse_main
from kvcourse.core.contract import blocks_needed
from kvcourse.course import generate as cli
from kvcourse.models import registry, smollm2

torch.set_num_threads(1)
QUESTION = "What is the capital of France?"


def hf_generate(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generate with the model's own generation config (its end-of-sequence included)."""
    input_ids = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, max_new_tokens=max_new_tokens
        )
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def tiny():
    return registry.load_model("tiny")


def test_json_ids_are_hugging_faces_greedy_on_the_raw_prompt(tiny, capsys):
    model, tokenizer = tiny
    assert kvcourse_main(["generate", "--model", "tiny", "--json", "--max-new-tokens", "7", QUESTION]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["token_ids"] == hf_generate(model, tokenizer.encode(QUESTION), 7)
    assert printed["text"] == tokenizer.decode(printed["token_ids"])


def test_the_chat_template_path_and_the_blocks_it_reports(tiny):
    model, tokenizer = tiny
    ids = registry.chat_prompt(tokenizer, [{"role": "user", "content": QUESTION}])
    result = cli.generate(model, tokenizer, ids, 20, block_size=4)
    assert result.token_ids == hf_generate(model, ids, 20)
    cached = len(ids) + len(result.token_ids) - 1  # the last sampled token is never fed back
    assert len(result.block_ids) == blocks_needed(cached, 4) and len(set(result.block_ids)) == len(result.block_ids)
    assert f"KV blocks used: {len(result.block_ids)} of 4 tokens each" in cli.summary("tiny", result)


def test_generation_stops_at_the_models_end_of_sequence_as_generate_does(tiny):
    model, tokenizer = tiny
    ids = tokenizer.encode(QUESTION)
    free = hf_generate(model, ids, 12)
    stopping = copy.deepcopy(model)
    stopping.generation_config.eos_token_id = free[3]  # a token greedy decoding reaches early
    expected = hf_generate(stopping, ids, 12)
    assert len(expected) < 12, "Hugging Face stops at the end-of-sequence token"
    assert cli.generate(stopping, tokenizer, ids, 12).token_ids == expected


def test_bad_requests_are_one_sentence(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("KVCOURSE_MODELS", str(tmp_path))
    assert kvcourse_main(["generate", QUESTION]) == 1
    assert "run ./course setup" in capsys.readouterr().err
    assert kvcourse_main(["generate", "--model", "tiny", "--max-new-tokens", "0", QUESTION]) == 2
    assert kvcourse_main(["generate", "--model", "tiny", "--max-new-tokens", "300", QUESTION]) == 1
    assert "context holds 256 positions" in capsys.readouterr().err


def test_smollm2_names_paris_with_hugging_faces_tokens(capsys):
    if not smollm2.is_converted():
        pytest.skip(
            f"SmolLM2-135M-Instruct is not converted on this machine ({smollm2.smollm2_dir()}): run ./course setup"
        )
    assert kvcourse_main(["generate", "--json", "--max-new-tokens", "16", QUESTION]) == 0
    printed = json.loads(capsys.readouterr().out)
    model, tokenizer = smollm2.load_smollm2()
    ids = registry.chat_prompt(tokenizer, [{"role": "user", "content": QUESTION}])
    assert printed["token_ids"] == hf_generate(model, ids, 16)
    assert "Paris" in printed["text"]


def test_a_fresh_clone_answers_through_the_reference_and_says_so(tmp_path, monkeypatch, capsys):
    """The user's first minute: stubs in kvcourse/ mean the reference engine answers, with one line saying so."""
    from kvcourse.course import generate as command
    from kvcourse.course import solutions_switch

    (tmp_path / "kvcourse").mkdir()
    for name in command.ENGINE_MODULES:
        written = name != "scheduler"
        body = "x = 1\n" if written else f'raise NotImplementedError("Exercise 2.1: {command.STUB_MARK}{name}.py")\n'
        (tmp_path / "kvcourse" / f"{name}.py").write_text(body)
    monkeypatch.setattr(solutions_switch, "SOLUTIONS_DIR", tmp_path / "solutions")
    monkeypatch.delenv("KVCOURSE_SOLUTIONS", raising=False)
    assert command.unwritten_engine_exercises() == ["scheduler"]
    command.choose_engine(mine=True)
    assert "KVCOURSE_SOLUTIONS" not in os.environ, "--mine must run the learner's engine, stubs or not"
    command.choose_engine(mine=False)
    assert os.environ.get("KVCOURSE_SOLUTIONS") == "1", "with a stub left, the reference engine must answer"
    err = capsys.readouterr().err
    assert "stubs are left in kvcourse/scheduler.py:" in err and "reference engine" in err and "--mine" in err, err
