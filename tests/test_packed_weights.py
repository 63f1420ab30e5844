"""The engine's oneDNN-packed linear layers (kvcourse/backends/packed.py): same products, model untouched."""

from __future__ import annotations

import pytest
import torch
from transformers.pytorch_utils import Conv1D

from kvcourse.course.solutions_switch import solutions_enabled

if not solutions_enabled():
    pytest.skip(
        "the maintainers' tests run against the reference: set KVCOURSE_SOLUTIONS=1 (./course test does)",
        allow_module_level=True,
    )
if not torch.backends.mkldnn.is_available():
    pytest.skip(
        "this PyTorch was built without oneDNN: the engine runs the model's own layers", allow_module_level=True
    )

from transformers import GPT2Config

from kvcourse.backends.packed import MIN_PACKED_WIDTH, PackedLinear, PackedWeights, can_pack, packed_weights
from kvcourse.engine.llm_engine import LLMEngine, hf_greedy
from kvcourse.models.gpt2 import load_gpt2, random_gpt2

torch.set_num_threads(1)
PROMPTS = [[5, 6, 7, 8, 9], [1000, 2000], list(range(30, 61))]


@pytest.fixture
def model():
    return load_gpt2("tiny", verbose=False)


@pytest.fixture(scope="module")
def wide_model():
    """One GPT-2 layer as wide as packing needs (GPT-2 small is 768), with a small vocabulary to stay fast."""
    config = GPT2Config(n_layer=1, n_embd=MIN_PACKED_WIDTH, n_head=8, n_positions=64, vocab_size=500)
    return random_gpt2(config, seed=3)


@pytest.mark.parametrize("shape", [(3, 64), (1, 7, 64), (2, 1, 5, 64)])
def test_packed_linear_computes_the_same_product_as_conv1d_and_linear(shape):
    torch.manual_seed(0)
    conv = Conv1D(48, 64)
    torch.nn.init.normal_(conv.bias)
    linear = torch.nn.Linear(64, 48, bias=False)
    x = torch.randn(shape)
    with torch.no_grad():
        for layer in (conv, linear):
            got = PackedLinear(layer)(x)
            assert got.shape == (*shape[:-1], 48)
            torch.testing.assert_close(got, layer(x), rtol=1e-5, atol=1e-5)


def test_active_routes_through_packed_layers_and_restores_the_model(model):
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        before = model(ids).logits
        packed = PackedWeights(model)
        layers = list(packed.packed)
        assert sum(isinstance(layer, Conv1D) for layer in layers) == 4 * model.config.n_layer
        assert model.lm_head in layers, "the LM head is the largest matrix: it must be packed too"
        with packed.active():
            assert all(layer.forward == packed.packed[layer].forward for layer in layers)
            during = model(ids).logits
        after = model(ids).logits
    assert all("forward" not in vars(layer) for layer in layers), "outside active() the model is as loaded"
    torch.testing.assert_close(during, before, rtol=1e-4, atol=1e-4)
    assert torch.equal(after, before)
    assert torch.equal(during.argmax(-1), before.argmax(-1))


def test_active_restores_the_model_when_the_forward_fails(model):
    packed = PackedWeights(model)
    with pytest.raises(RuntimeError, match="boom"), packed.active():
        raise RuntimeError("boom")
    assert all("forward" not in vars(layer) for layer in packed.packed)


def test_packing_is_reused_per_model_and_redone_when_a_weight_changes(model):
    first = packed_weights(model)
    assert packed_weights(model) is first, "a second engine on the same model reuses the packed copy"
    assert packed_weights(load_gpt2("tiny", verbose=False)) is not first
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight.mul_(3.0)  # in place, as load_state_dict does
    assert first.stale()
    second = packed_weights(model)
    assert second is not first and not second.stale()
    engine = LLMEngine(model, num_blocks=32, block_size=4, pack_weights=True)
    assert engine.runner.packed_weights is second
    assert engine.generate(PROMPTS, 5) == [hf_greedy(model, p, 5) for p in PROMPTS], "stale weights were used"


@pytest.mark.parametrize("attention", ["fast", "reference"])
def test_packed_and_unpacked_engines_agree_with_hugging_face(model, attention):
    expected = [hf_greedy(model, p, 6) for p in PROMPTS]
    packed = LLMEngine(model, num_blocks=32, block_size=4, attention=attention, pack_weights=True)
    plain = LLMEngine(model, num_blocks=32, block_size=4, attention=attention, pack_weights=False)
    assert packed.runner.packed_weights is not None and plain.runner.packed_weights is None
    assert packed.generate(PROMPTS, 6) == expected
    assert plain.generate(PROMPTS, 6) == expected


def test_the_engine_packs_by_default_where_it_pays_and_still_equals_hugging_face(wide_model):
    assert can_pack(wide_model)
    engine = LLMEngine(wide_model, num_blocks=32, block_size=4)
    assert engine.runner.packed_weights is not None
    prompts = [[p % 500 for p in prompt] for prompt in PROMPTS]
    assert engine.generate(prompts, 6) == [hf_greedy(wide_model, p, 6) for p in prompts]


def test_packing_is_off_where_it_does_not_pay(model, wide_model):
    assert not can_pack(model), "the tiny model is too narrow: oneDNN's conversions cost more than they save"
    assert LLMEngine(model, num_blocks=8, block_size=4).runner.packed_weights is None
    half = random_gpt2(wide_model.config, seed=3).to(torch.bfloat16)
    assert not can_pack(half)
    assert LLMEngine(half, num_blocks=8, block_size=4).runner.packed_weights is None
    with pytest.raises(ValueError, match=r"pack_weights=True, but the model is in torch.bfloat16"):
        LLMEngine(half, num_blocks=8, block_size=4, pack_weights=True)


def test_other_families_are_declined_in_words():
    """Packing covers GPT-2's Conv1D layers only: a Llama model runs its own layers, and asking to pack says why not."""
    from kvcourse.backends.packed import why_not_packable
    from kvcourse.models.llama import random_llama, tiny_llama_config

    llama = random_llama(tiny_llama_config(hidden_size=MIN_PACKED_WIDTH, num_attention_heads=8, num_key_value_heads=2))
    assert not can_pack(llama)
    assert "GPT-2 only" in why_not_packable(llama)
    assert LLMEngine(llama, num_blocks=4, block_size=4).runner.packed_weights is None
    with pytest.raises(ValueError, match="GPT-2 only"):
        LLMEngine(llama, num_blocks=4, block_size=4, pack_weights=True)
