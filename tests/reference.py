"""Load a reference module from solutions/ directly, whatever KVCOURSE_SOLUTIONS says (maintainers' tests)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SOLUTIONS = Path(__file__).resolve().parent.parent / "solutions"


def load_reference(name: str) -> ModuleType:
    """solutions/<name>.py as module `_reference_<name>`, loaded once per process."""
    module_name = f"_reference_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, SOLUTIONS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses look their module up while the class is built
        spec.loader.exec_module(module)
    return sys.modules[module_name]
