"""Loads a bench script (a file, not a module of a package) for the bench tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1]


def load_bench_script(name: str) -> ModuleType:
    """bench/<name>.py as a module (registered, so its dataclasses and pickling work)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
