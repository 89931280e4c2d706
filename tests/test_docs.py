"""The README is a front page: its two commands are the ones CI runs, it stays small, and no page of the
documentation is a diary."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _readme_commands() -> list[str]:
    block = re.search(
        r"## The two commands\n\n```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S
    )
    assert block, "README.md has no '## The two commands' bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_the_readmes_test_command_is_what_ci_runs():
    commands = _readme_commands()
    assert len(commands) == 2
    ci = [
        line
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.startswith(("#", "set ", "cd "))
    ]
    assert ci == [commands[1]]


def test_the_main_job_command_runs_the_quick_start():
    main = _readme_commands()[0]
    assert main == "bash scripts/setup.sh && .venv/bin/rloo-pipeline run configs/quickstart.yaml"
    assert (ROOT / "configs" / "quickstart.yaml").is_file()


def test_the_readme_is_at_most_15_kb():
    assert (ROOT / "README.md").stat().st_size <= 15 * 1024


def test_no_page_is_a_diary():
    # The history is git log: pages describe the project as it is.
    diary = re.compile(r"\bsessions?\b|(?<![\w/])issue #?\d+|(?<![\w/])#\d+\b", re.I)
    hits = [
        f"{page.relative_to(ROOT)}:{number}: {line.strip()[:80]}"
        for page in DOCS
        for number, line in enumerate(page.read_text().splitlines(), 1)
        if diary.search(line)
    ]
    assert hits == []


def test_every_link_between_pages_resolves():
    broken = []
    for page in DOCS:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert broken == []


def test_every_repository_path_the_pages_name_exists():
    # a path under one of the repository's folders, or a source file named from inside a
    # package (`engine/lean.py`); a run's outputs (runs/, train/...) are not in the repository
    folders = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".venv")}
    packages = ["", "rloo/", "infra/", "flows/", "tasks/"]
    source = (".py", ".c", ".sh", ".yaml", ".toml")
    missing = []
    for page in DOCS:
        for path in re.findall(r"`((?:\.?[\w-]+/)+[\w.-]*)`", page.read_text()):
            if path.split("/")[0] in folders:
                found = (ROOT / path).exists()
            elif path.endswith(source):
                found = any((ROOT / f"{package}{path}").exists() for package in packages)
            else:
                continue
            if not found:
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert missing == []


def _column(text: str, heading: str, machine: str) -> dict[str, list[str]]:
    """The cells of `machine`'s column (split at " / ") by row, in the first table after
    `heading`."""
    table = text[text.index(heading) :].split("\n\n", 2)[1].splitlines()
    header = [cell.strip() for cell in table[0].split("|")]
    index = next(i for i, cell in enumerate(header) if cell.startswith(machine))
    return {
        cells[1].strip(): [part.strip() for part in cells[index].split("(")[0].split("/")]
        for cells in (row.split("|") for row in table[2:])
    }


def test_the_readmes_headline_figures_are_the_performance_pages():
    # one run, one source: the README quotes docs/performance.md's tables, it does not re-measure
    readme = (ROOT / "README.md").read_text()
    performance = (ROOT / "docs" / "performance.md").read_text()
    bold = re.findall(
        r"\*\*([^*]+)\*\*", readme[readme.index("## Headline numbers") :].split("\n\n", 2)[1]
    )
    steps = _column(performance, "Steps/s ratio", "EPYC-512")
    memory = _column(performance, "Peak RSS ratio", "EPYC-512")

    def ratio(cell: str) -> float:
        return float(cell.rstrip("x"))

    assert bold[0] == steps["full fine-tune, 32 tokens"][0]  # beta 0.05
    assert bold[1] == min((c for cells in steps.values() for c in cells), key=ratio)
    assert bold[2] == max((c for cells in memory.values() for c in cells), key=ratio)
    for figure in bold[3:]:
        assert all(part.strip() in performance for part in figure.split("/")), figure
