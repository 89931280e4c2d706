"""The trainer installs beside other libraries: version ranges tested at their lower ends, no pipeline package
imported by `import rloo`, and no top-level `flows`, `tasks` or `infra` in the wheel."""

import os
import subprocess
import sys
import tomllib

import pytest

from services import VLLM_PYTHON

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PIPELINE = ("prefect", "mlflow", "submitit", "pydantic", "matplotlib", "flows", "tasks", "infra")


def test_import_rloo_pulls_in_no_pipeline_package():
    code = ("import sys, rloo; rloo.RLOOTrainer, rloo.RLOOConfig; "
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({PIPELINE!r})))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_wheel_carries_the_trainer_only():
    from setuptools import find_packages
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as handle:
        project = tomllib.load(handle)
    packages = find_packages(ROOT, include=project["tool"]["setuptools"]["packages"]["find"]["include"])
    assert {name.split(".")[0] for name in packages} == {"rloo", "rloo_vllm"}
    assert "rloo.engine" in packages
    scripts = project["project"]["scripts"]
    assert all(not target.startswith(("flows", "tasks", "infra")) for target in scripts.values())
    dependencies = " ".join(project["project"]["dependencies"])
    assert not any(name in dependencies for name in PIPELINE)
    assert "==" not in dependencies  # ranges, not pins


def _lowest() -> dict[str, str]:
    with open(os.path.join(ROOT, "constraints-lowest.txt")) as handle:
        pins = [line.split("==") for line in handle if "==" in line and not line.startswith("#")]
    return {name.strip(): version.strip() for name, version in pins}


def test_the_trainers_fast_tests_pass_on_the_lowest_versions_of_its_ranges():
    """.venv-vllm holds constraints-lowest.txt's versions (scripts/setup.sh --with-vllm); the exactness and engine
    tests run there as here."""
    if not os.path.exists(VLLM_PYTHON):
        pytest.fail(".venv-vllm is missing: run `bash scripts/setup.sh --with-vllm`")
    lowest = _lowest()
    code = "import importlib.metadata as m, json, sys; print(json.dumps({n: m.version(n) for n in sys.argv[1:]}))"
    found = subprocess.run([VLLM_PYTHON, "-c", code, *lowest], capture_output=True, text=True, check=True)
    import json
    installed = {name: version.split("+")[0] for name, version in json.loads(found.stdout).items()}
    assert installed == lowest
    result = subprocess.run([VLLM_PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_algorithm.py",
                             "tests/test_engine.py", "tests/test_trainer.py", "-k", "not learns_to_emit"],
                            capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout.splitlines()[-1]
