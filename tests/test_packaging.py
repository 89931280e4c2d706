"""The trainer installs beside other libraries: version ranges tested at both ends, no pipeline package imported
by `import rloo`, and no top-level `flows`, `tasks` or `infra` in the wheel."""

import os
import subprocess
import sys
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PIPELINE = ("prefect", "mlflow", "submitit", "pydantic", "matplotlib", "flows", "tasks", "infra")


def test_import_rloo_pulls_in_no_pipeline_package():
    code = (
        "import sys, rloo; rloo.RLOOTrainer, rloo.RLOOConfig; "
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({PIPELINE!r})))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_wheel_carries_the_trainer_only():
    from setuptools import find_packages

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as handle:
        project = tomllib.load(handle)
    packages = find_packages(
        ROOT, include=project["tool"]["setuptools"]["packages"]["find"]["include"]
    )
    assert {name.split(".")[0] for name in packages} == {"rloo", "rloo_vllm"}
    assert "rloo.engine" in packages
    scripts = project["project"]["scripts"]
    assert all(not target.startswith(("flows", "tasks", "infra")) for target in scripts.values())
    dependencies = " ".join(project["project"]["dependencies"])
    assert not any(name in dependencies for name in PIPELINE)
    assert "==" not in dependencies  # ranges, not pins


def _pins(name: str) -> dict[str, str]:
    with open(os.path.join(ROOT, name)) as handle:
        pins = [line.split("==") for line in handle if "==" in line and not line.startswith("#")]
    return {package.strip(): version.strip() for package, version in pins}


def test_the_lowest_pins_are_the_lower_ends_of_the_ranges():
    from packaging.requirements import Requirement

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as handle:
        ranges = [Requirement(line) for line in tomllib.load(handle)["project"]["dependencies"]]
    floors = {
        requirement.name: next(
            spec.version for spec in requirement.specifier if spec.operator == ">="
        )
        for requirement in ranges
    }
    from packaging.version import Version

    assert {
        name: Version(version) for name, version in _pins("constraints-lowest.txt").items()
    } == {name: Version(version) for name, version in floors.items()}


@pytest.mark.parametrize("end", ["lowest", "newest"])
def test_the_trainers_tests_pass_at_both_ends_of_its_ranges(end):
    """.venv-lowest holds constraints-lowest.txt's versions, .venv-newest the newest releases (scripts/setup.sh
    --with-version-ends); the exactness, engine and version tests run there as here."""
    python = os.path.join(ROOT, f".venv-{end}", "bin", "python")
    if not os.path.exists(python):
        pytest.fail(f".venv-{end} is missing: run `bash scripts/setup.sh --with-version-ends`")
    import json

    code = "import importlib.metadata as m, json, sys; print(json.dumps({n: m.version(n) for n in sys.argv[1:]}))"
    names = list(_pins("constraints-lowest.txt"))
    found = subprocess.run([python, "-c", code, *names], capture_output=True, text=True, check=True)
    installed = {name: version.split("+")[0] for name, version in json.loads(found.stdout).items()}
    if end == "lowest":
        assert installed == _pins("constraints-lowest.txt")
    else:  # at least the suite's own pinned set, torch the newest this machine's pip takes
        from packaging.version import Version

        pinned = _pins("constraints.txt")
        assert installed["torch"] == "2.14.1"
        assert all(
            Version(installed[name]) >= Version(pinned[name]) for name in names if name in pinned
        )
    result = subprocess.run(
        [
            python,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/test_algorithm.py",
            "tests/test_versions.py",
            "tests/test_engine.py",
            "tests/test_trainer.py",
            "-k",
            "not learns_to_emit",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout.splitlines()[-1]
