"""The README and docs/*.md run: every code block, as docs/internals.md describes.

- ``python`` blocks run in order in one fresh process a page (the README's after a ``gk.patch``,
  so that the public names are checked after the model code was imported); a block whose first
  line is a comment naming a file (``# mymodel.py: ...``) is also written to that file in every
  page's scratch folder.
- ``console`` blocks run in order in one scratch folder a page: each ``$ `` line is a command
  that must exit 0, or the status its ``# exit N`` comment gives; each line shown under it must
  appear in its output (``...`` matches anything, a figure with a decimal point any such figure).
- ``bash`` blocks (a GPU, the network, several processes) and ``text`` synopses are checked: the
  files, extras and ``graphkern`` options they name exist.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None  # type: ignore[assignment]

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", flags=re.S | re.M)
FILE_HEADER = re.compile(r"#\s*([\w./-]+\.py)\b")


def blocks(page: Path, lang: str | None = None) -> list[tuple[str, str]]:
    found = [(m.group(1), m.group(2)) for m in FENCE.finditer(page.read_text())]
    return [b for b in found if lang is None or b[0] == lang]


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def files_shown() -> dict[str, str]:
    """The files the pages show in full: python blocks whose first line names them."""
    files = {}
    for page in PAGES:
        for _, code in blocks(page, "python"):
            match = FILE_HEADER.match(code.splitlines()[0]) if code.strip() else None
            if match:
                files[match.group(1)] = code
    return files


def scratch(tmp_path: Path) -> dict[str, str]:
    """``tmp_path`` with the pages' files and ``python``/``graphkern`` on PATH; the environment."""
    for name, code in files_shown().items():
        (tmp_path / name).write_text(code)
    bin_dir = tmp_path / ".bin"
    bin_dir.mkdir()
    for name, run in (("python", ""), ("graphkern", " -m graphkern")):  # this environment's
        launcher = bin_dir / name
        launcher.write_text(f'#!/bin/sh\nexec "{sys.executable}"{run} "$@"\n')
        launcher.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            "HF_HUB_OFFLINE": "1", "COLUMNS": "200",
            "GRAPHKERN_BACKEND": "reference"}  # the pages show the kernels' references at work


def test_every_page_has_only_known_kinds_of_block() -> None:
    kinds = {(page_id(page), lang) for page in PAGES for lang, _ in blocks(page)}
    assert {lang for _, lang in kinds} <= {"python", "console", "bash", "text"}, sorted(kinds)
    assert len(PAGES) >= 10


# ----------------------------------------------------------------------------- python


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p, "python")], ids=page_id)
def test_python_blocks_run_in_order_in_one_fresh_process(page: Path, tmp_path: Path) -> None:
    code = [c for _, c in blocks(page, "python")]
    prelude = "import mlx.nn as nn, graphkern as gk\ngk.patch(nn.Sequential(nn.RMSNorm(8)))\n" \
        if page.name == "README.md" else ""
    script = prelude + "".join(f"print('--- block {i}', flush=True)\n{block}\n"
                               for i, block in enumerate(code))
    (tmp_path / "page.py").write_text(script)
    env = scratch(tmp_path)
    done = subprocess.run([sys.executable, "page.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=880, env=env)
    last = ([line for line in done.stdout.splitlines() if line.startswith("--- block")] or ["none"])[-1]
    assert done.returncode == 0, f"{page_id(page)} stopped in {last}:\n{done.stderr[-3000:]}"
    assert f"--- block {len(code) - 1}" in done.stdout


# ----------------------------------------------------------------------------- console


def commands(block: str) -> list[tuple[str, int, list[str]]]:
    """``(command, exit status, lines shown)`` of a console block."""
    found: list[tuple[str, int, list[str]]] = []
    for line in block.splitlines():
        if line.startswith("$ "):
            status = re.search(r"#\s*exit (\d+)\s*$", line)
            found.append((line[2:], int(status.group(1)) if status else 0, []))
        elif line.strip():
            assert found, f"output before any command: {line!r}"
            found[-1][2].append(line)
    return found


def shown_matches(shown: str, printed: list[str]) -> bool:
    """Whether a line the page shows is one of the lines printed: ``...`` matches anything, a
    figure with a decimal point any such figure, trailing spaces do not count."""
    parts = [re.escape(p) for p in shown.rstrip().split("...")]
    pattern = ".*".join(re.sub(r"\d+\\\.\d+", r"[0-9]+\\.[0-9]+", p) for p in parts)
    rule = re.compile(pattern + r"\s*$")
    return any(rule.match(line.rstrip()) for line in printed)


def test_shown_lines_match_as_the_pages_mean() -> None:
    assert shown_matches("took 1.5 s", ["took 0.3 s"]) and not shown_matches("took 1.5 s", ["took 3 s"])
    assert shown_matches("prompt ...x, peak", ["prompt 1.07x, peak"])
    assert shown_matches("wrote g.json", ["wrote g.json  "])
    assert not shown_matches("wrote g", ["wrote g.json"])
    assert commands("$ a  # exit 2\nerror: x\n$ b\n") == [("a  # exit 2", 2, ["error: x"]), ("b", 0, [])]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p, "console")], ids=page_id)
def test_console_blocks_run_and_print_what_the_page_shows(page: Path, tmp_path: Path) -> None:
    env = scratch(tmp_path)
    for _, block in blocks(page, "console"):
        for command, status, shown in commands(block):
            done = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True,
                                  timeout=600, env=env)
            printed = (done.stdout + done.stderr).splitlines()
            where = f"{page_id(page)}: $ {command}"
            assert done.returncode == status, f"{where} exited {done.returncode}:\n{done.stderr[-3000:]}"
            missing = [line for line in shown if not shown_matches(line, printed)]
            assert not missing, f"{where} did not print {missing}; it printed:\n" + "\n".join(printed)


# ----------------------------------------------------------------------------- bash and text


def _graphkern_options() -> dict[str, set[str]]:
    from graphkern.cli import main

    found = {}
    for name, command in main.commands.items():
        options = {"-h", "--help"}
        for param in command.params:
            options.update(getattr(param, "opts", []))
            options.update(getattr(param, "secondary_opts", []))
        found[name] = options
    return found


def _problems(line: str, options: dict[str, set[str]], extras: set[str]) -> list[str]:
    """What is wrong with one command line of a bash or text block (a ``graphkern`` call, a
    script, a test file, an extra)."""
    line = line.split("#", 1)[0].strip()
    if not line:
        return []
    try:
        words = shlex.split(line)
    except ValueError:
        words = line.split()
    problems = []
    if words[0] == "graphkern" and len(words) > 1:
        command = words[1]
        if command not in options:
            return [f"no command graphkern {command}"]
        for word in words[2:]:
            flag = word.strip("[]|").split("=")[0]
            number = flag[1:].replace(",", "").isdigit()
            if flag.startswith("-") and flag not in options[command] and not number:
                problems.append(f"graphkern {command} has no option {flag}")
    for word in words:
        path = word.strip("[]'\"")
        if path.endswith((".py", ".sh")) and "/" in path and not (ROOT / path).exists():
            problems.append(f"no file {path}")
        for extra in re.findall(r"\.\[([\w,-]+)\]", word):
            problems += [f"no extra {e}" for e in extra.split(",") if e not in extras]
    return problems


def test_bash_blocks_and_synopses_name_what_exists() -> None:
    if tomllib is None:
        pytest.skip("tomllib is Python 3.11's")
    options = _graphkern_options()
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    problems = []
    checked = 0
    for page in PAGES:
        for lang, block in blocks(page):
            if lang not in ("bash", "text"):
                continue
            text = block.replace("\\\n", " ")
            lines = text.splitlines()
            # a synopsis continues on indented lines
            joined: list[str] = []
            for line in lines:
                if line.startswith(" ") and joined and joined[-1].startswith("graphkern ") and lang == "text":
                    joined[-1] += " " + line.strip()
                else:
                    joined.append(line)
            for line in joined:
                if lang == "text" and not line.startswith("graphkern "):
                    continue
                checked += 1
                problems += [f"{page_id(page)}: {p}" for p in _problems(line, options, extras)]
    assert checked > 20 and not problems, problems


def test_the_problems_found_are_real() -> None:
    options = _graphkern_options()
    assert _problems("graphkern trace --nope x", options, {"dev"}) == ["graphkern trace has no option --nope"]
    assert _problems("python benchmarks/nothing.py", options, set()) == ["no file benchmarks/nothing.py"]
    assert _problems("pip install -e '.[nothing]'", options, {"dev"}) == ["no extra nothing"]
    assert _problems("graphkern bench --model M --max-tokens 4  # why", options, set()) == []


# ----------------------------------------------------------------------------- the README and CI


def test_the_readme_starts_with_install_and_the_demo() -> None:
    lang, first = blocks(ROOT / "README.md")[0]
    assert lang == "bash"
    commands = [line.split("#")[0].strip() for line in first.strip().splitlines()]
    assert commands == ["pip install -e '.[models]' && graphkern demo",
                        "pip install -e '.[dev]' && python -m pytest -q"]
    text = (ROOT / "README.md").read_text()
    assert text.index("```bash") < text.index("\n## ")  # before any section


def test_the_readmes_test_commands_are_what_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Run the tests", 1)[1].split("\n## ", 1)[0]
    commands_shown = [line.split("#")[0].strip() for _, block in FENCE.findall(section)
                      for line in block.splitlines() if line.strip()]
    assert commands_shown == ["pip install -e '.[dev]'", "bash .ci/install-browsers.sh",
                              "python -m pytest -q"]
    for command in commands_shown:
        assert command.replace("pip install", "python -m pip install -q") in ci or command in ci, command


def test_docs_link_to_pages_and_sections_that_exist() -> None:
    """Every relative link of the README and docs points at a file that exists, and every
    ``#anchor`` at a heading of its page (GitHub's slugs)."""
    def slug(heading: str) -> str:
        return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")

    broken = []
    for page in PAGES:
        text = re.sub(FENCE, "", page.read_text())
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page_id(page)}: {target}")
                continue
            if anchor and file.suffix == ".md":
                headings = [slug(h) for h in re.findall(r"^#+ (.+)$", re.sub(FENCE, "", file.read_text()),
                                                        flags=re.M)]
                if anchor not in headings:
                    broken.append(f"{page_id(page)}: {target}")
    assert not broken, broken


def test_no_page_speaks_of_how_it_was_written() -> None:
    words = ("session", "ticket", "../" "shared", "design note", "has since changed", "untimed since",
             "earlier code", "was not re-timed", "device time")
    found = [f"{page_id(p)}: {w}" for p in [*PAGES, *sorted((ROOT / "benchmarks").glob("RESULTS*.md"))]
             for w in words if w in p.read_text().lower()]
    assert not found, found
