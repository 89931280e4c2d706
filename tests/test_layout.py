"""The layout kept: the formatter's layout and the lint, where mlflow may be imported, no test code
in the product, no import cycle between the launchers."""

import os
import pathlib
import re
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("rloo", "rloo_vllm", "infra", "tasks", "flows")
PRODUCT = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")]


def test_the_formatter_owns_the_layout_and_the_lint_passes():
    """`ruff format --check` and `ruff check` over the whole tree, as pyproject's [tool.ruff] says."""
    ruff = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")
    assert ruff, "ruff is missing: pip install -e '.[test]'"
    for command in (["format", "--check"], ["check"]):
        result = subprocess.run([ruff, *command, "."], cwd=ROOT, capture_output=True, text=True)
        assert result.returncode == 0, (
            " ".join(command) + ":\n" + result.stdout[-3000:] + result.stderr[-2000:]
        )


def test_no_product_line_over_100_characters():
    sources = PRODUCT + [p for package in PACKAGES for p in (ROOT / package).rglob("*.c")]
    long = [
        f"{p.relative_to(ROOT)}:{number}"
        for p in sources
        for number, line in enumerate(p.read_text().splitlines(), 1)
        if len(line) > 100
    ]
    assert long == []


def test_mlflow_is_imported_in_rloo_only_lazily_inside_its_callback():
    hits = [
        (str(p.relative_to(ROOT)), line.strip())
        for p in (ROOT / "rloo").rglob("*.py")
        for line in p.read_text().splitlines()
        if re.match(r"\s*(import mlflow|from mlflow)", line)
    ]
    assert hits == [
        (
            "rloo/callbacks.py",
            "import mlflow  # lazily: rloo/ depends on mlflow only for users who ask for it",
        )
    ]


def test_product_code_does_not_import_test_helpers():
    test_import = re.compile(r"^\s*(from|import) (tiny_models|helpers)\b", re.M)
    offenders = [str(p.relative_to(ROOT)) for p in PRODUCT if test_import.search(p.read_text())]
    assert offenders == []
    assert not (ROOT / "rloo" / "testing.py").exists()  # test-only builders live in tests/


def test_slurm_launcher_does_not_import_the_local_one():
    assert "infra.launch" not in (ROOT / "infra" / "slurm.py").read_text()


def test_every_mlflow_call_of_the_pipeline_is_in_infra_tracking():
    hits = [
        str(p.relative_to(ROOT))
        for package in ("infra", "tasks", "flows")
        for p in (ROOT / package).rglob("*.py")
        if re.search(r"^\s*(import mlflow|from mlflow)", p.read_text(), re.M)
    ]
    assert hits == ["infra/tracking.py"]
