"""distanom's version: a leaf every module may import (run.json records it)."""

__version__ = "0.1.0"
