"""The layout kept: the formatter's layout and the lint, where mlflow may be imported, no test code
in the product, no import circle (at module level or through function-level imports)."""

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


def _project_imports() -> dict[str, set[str]]:
    """module -> the project's modules it imports, at module level or inside a function (a function
    level import hides a circle from Python's import order, not from a reader)."""
    import ast

    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges = {module: set() for module in modules}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package
                    for _ in range(node.level - 1):
                        parent = parent.rpartition(".")[0]
                    base = f"{parent}.{base}" if base else parent
                names = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                found = resolve(name)
                if found and found != module:
                    edges[module].add(found)
    return edges


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(module):
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in edges[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                groups.append(sorted(group))

    for module in edges:
        if module not in index:
            visit(module)
    return groups


def test_no_import_circle_in_the_project_even_through_function_level_imports():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    edges = _project_imports()
    assert "rloo.engine" in edges["rloo.trainer"]  # (the graph sees the project's imports)
    assert _circles(edges) == []


# The only modules whose functions import the project's own modules, and why (elsewhere they are
# imported at the top, where a reader sees them).
DEFERRED_IMPORTS = {
    "flows/cli.py": "each command imports what it runs: `rloo-pipeline --help` and a refused "
    "command line answer without loading torch, Prefect or MLflow",
    "rloo/generation/vllm_colocate.py": "rloo_vllm runs inside vLLM's engine and imports vLLM, an "
    "optional extra",
    "rloo/__init__.py": "RLOOConfig and RLOOTrainer load on first use, as in TRL's package: a "
    "process that needs one light module (a job's launcher) does not load torch and transformers",
    "infra/jobs.py": "each job's launcher process imports it to start torchrun; the watchdog's "
    "report names come with the trainer's imports, only where a stall is looked for",
}


def test_a_jobs_launcher_and_the_package_load_neither_torch_nor_transformers():
    """Every local job and every SLURM node task starts a launcher process that unpickles
    infra.launch's TrainJob: seconds of imports per job if it pulled the trainer in."""
    import subprocess
    import sys

    probe = (
        "import sys, rloo, infra.launch, infra.slurm; "
        "print(sorted({'torch', 'transformers', 'peft'} & set(sys.modules)))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert loaded.stdout.strip() == "[]"


def test_a_function_imports_the_projects_modules_only_where_a_reason_is_written():
    import ast

    deferring = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for inner in ast.walk(node):
                    if isinstance(inner, ast.Import):
                        names = [alias.name for alias in inner.names]
                    elif isinstance(inner, ast.ImportFrom):
                        names = [inner.module or ""] if not inner.level else [PACKAGES[0]]
                    else:
                        continue
                    if any(name.split(".")[0] in PACKAGES for name in names):
                        deferring.add(str(path.relative_to(ROOT)))
    assert deferring == set(DEFERRED_IMPORTS)


# What the speed layer may import from the rest of the project: leaves that import nothing of the
# project but each other.
ENGINE_LEAVES = {"rloo.primitives", "rloo.kv", "rloo.zero", "rloo.versions", "rloo.process"}


def test_the_engine_is_walled_both_ways():
    """rloo/engine/ imports only the leaves; everything else imports only its package face
    (rloo.engine), never a module inside it."""
    edges = _project_imports()

    def inside(module: str) -> bool:
        return module == "rloo.engine" or module.startswith("rloo.engine.")

    leaking = sorted(
        f"{module} -> {target}"
        for module, targets in edges.items()
        if inside(module)
        for target in targets
        if not inside(target) and target not in ENGINE_LEAVES
    )
    leaves = sorted(
        f"{leaf} -> {target}" for leaf in ENGINE_LEAVES for target in edges[leaf] - ENGINE_LEAVES
    )
    reaching = sorted(
        f"{module} -> {target}"
        for module, targets in edges.items()
        if not inside(module)
        for target in targets
        if target.startswith("rloo.engine.")
    )
    assert (leaking, leaves, reaching) == ([], [], [])
