"""The module map's import rules: the analysis side never needs torch.distributed or the
agent, so `distanom report` runs on a laptop without a GPU."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_report_side_imports_neither_the_agent_nor_torch() -> None:
    code = (
        "import sys\n"
        "import distanom.cli, distanom.analysis.report, distanom.analysis.html_report\n"
        "import distanom.analysis.crossrank, distanom.live, distanom.records\n"
        "import distanom.records.index, distanom.records.requests, distanom.records.run_info\n"
        "import distanom.records.status, distanom.records.steps\n"
        "agent_side = ('torch', 'distanom.agent', 'distanom.world', 'distanom.boundary',"
        " 'distanom.control_loop', 'distanom.health', 'distanom.duty_cycle',"
        " 'distanom.capture')\n"
        "bad = [m for m in sys.modules if m.startswith(agent_side)]\n"
        "print(','.join(bad))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == ""


def test_only_world_imports_torch_distributed() -> None:
    offenders = []
    for path in (REPO / "distanom").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n.startswith("torch.distributed") for n in names):
                offenders.append(str(path.relative_to(REPO)))
    assert sorted(set(offenders)) == ["distanom/world.py"]
