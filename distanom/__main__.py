"""`python -m distanom` is the `distanom` command (see `distanom.cli`)."""

from __future__ import annotations

import sys

from distanom.cli import main

sys.exit(main())
