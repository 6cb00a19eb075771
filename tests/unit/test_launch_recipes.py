"""The recipes in launch/: every shell file parses (`bash -n`), every YAML file loads, each
starts the job under `distanom.launch` and says where its run directory is, and the
index (launch/README.md) names every recipe."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

LAUNCH = Path(__file__).resolve().parents[2] / "launch"
RECIPES = sorted(p for p in LAUNCH.rglob("*") if p.is_file() and p.name != "README.md")
SHELL = {".sh", ".sbatch"}


def test_the_recipes_are_there() -> None:
    names = {p.relative_to(LAUNCH).as_posix() for p in RECIPES}
    assert {
        "single_node.sh",
        "multi_node_torchrun.sh",
        "slurm.sbatch",
        "kubernetes/pytorchjob.yaml",
        "docker.sh",
    } <= names
    assert all(p.suffix in SHELL | {".yaml"} for p in RECIPES), names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.relative_to(LAUNCH).as_posix())
def test_a_recipe_parses_and_starts_distanom(recipe: Path) -> None:
    text = recipe.read_text()
    if recipe.suffix in SHELL:
        bash = shutil.which("bash")
        assert bash is not None
        done = subprocess.run([bash, "-n", str(recipe)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert text.startswith("#!")
    else:
        document = yaml.safe_load(text)
        assert document["kind"] == "PyTorchJob"
        specs = document["spec"]["pytorchReplicaSpecs"]
        for role in ("Master", "Worker"):
            (container,) = specs[role]["template"]["spec"]["containers"]
            assert container["name"] == "pytorch"
            assert "-m distanom.launch" in " ".join(container["args"])
    assert "-m distanom.launch" in text
    assert "--run-dir" in text and "un directory" in text  # says where the run lives
    if recipe.name != "single_node.sh":  # several nodes: shared folder or one copy each
        assert "distanom report node0/runs/<run-id> node1/runs/<run-id>" in text


def test_the_index_names_every_recipe() -> None:
    index = (LAUNCH / "README.md").read_text()
    for recipe in RECIPES:
        assert f"`{recipe.relative_to(LAUNCH).as_posix()}`" in index
