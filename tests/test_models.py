"""GPT-2 and its tokenizer offline: real tokenizer, seeded random weights, no network."""

import socket

import pytest
import torch

from kvcourse.models.gpt2 import LESSON_PROMPTS, load_gpt2, load_tokenizer, tiny_gpt2_config


def test_tokenizer_is_real_gpt2():
    ids = load_tokenizer().encode(LESSON_PROMPTS[0])
    assert len(ids) == 15 and ids[:4] == [464, 3139, 286, 4881]
    assert load_tokenizer().decode(ids) == LESSON_PROMPTS[0]
    assert len(load_tokenizer()) == 50_257


def test_offline_gives_seeded_random_weights_and_says_so(monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def no_network(*args, **kwargs):
        raise AssertionError("load_gpt2 touched the network while HF_HUB_OFFLINE=1")

    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr("kvcourse.models.gpt2._pretrained", lambda name: None)  # ignore any local HF cache
    first = load_gpt2("gpt2")
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "random weights" in out[0]
    assert first.config.n_layer == 12 and first.config.n_embd == 768 and first.is_pretrained is False
    second = load_gpt2("gpt2", verbose=False)
    assert torch.equal(first.transformer.wte.weight, second.transformer.wte.weight)


def test_tiny_model_runs():
    model = load_gpt2("tiny", verbose=False)
    assert model.config.n_layer == tiny_gpt2_config().n_layer == 2
    logits = model(torch.tensor([[464, 3139, 286]])).logits
    assert logits.shape == (1, 3, 50_257)


def test_unknown_size_is_a_clear_error():
    with pytest.raises(ValueError, match="Unknown GPT-2 size"):
        load_gpt2("gpt3")
