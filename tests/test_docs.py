"""The documentation: the README stays the front door, the docs site builds with no broken link, the
algorithms page lists every registered method, and every measured figure has the command that prints it.

The figure convention (docs/development.md): in docs/results.md every figure block, a `###` section, has
a `Measured:` line (date, commit, machine), a `Command:` line and a `Status:` line (`current`, `not re-run
since <commit>` or `stale: measured on <commit>, before <what changed>`). On every other page (and the
README) a section that gives a date has a `Command:` line. A command's files (tools/..., configs/...,
examples/..., launch/...), `make` targets and `moe-rl` subcommands (`moe-rl bench NAME`: tools/bench/NAME.py)
must exist."""

import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from conftest import ROOT

DOCS = ROOT / "docs"
README = ROOT / "README.md"
# generated from the config's docstrings and the metric glossary (tests/test_config_docs.py and
# tests/test_glossary.py keep them current)
GENERATED = {"config.md", "metrics.md"}
# the records of what has run on a GPU and of the GPU stack's installation, kept with the GPU work (their
# figures are repeated in results.md, each with its command)
OWN_RECORDS = {"gpu.md", "install.md"}
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
REPO_PREFIXES = ("tools/", "configs/", "examples/", "launch/", "tests/", "docs/", ".ci/", "moe_rl/",
                 "docker/", "requirements/")
TOPS = "|".join(re.escape(p.rstrip("/")) for p in REPO_PREFIXES)
REPO_PATH = re.compile(rf"(?<![\w./-])((?:{TOPS})/[\w./-]*)")  # a path of the repository in any text
STATUS = re.compile(r"^Status: (current|not re-run since \S+|stale: measured on .+, before .+)", re.S)


def pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) of each section of a markdown text, split at headings outside fenced code (a `#`
    comment inside a code block is no heading); the text before the first heading has heading ''."""
    out, heading, body, fenced = [], "", [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if not fenced and re.match(r"#{1,6} ", line):
            out.append((heading, "\n".join(body)))
            heading, body = line, []
        else:
            body.append(line)
    out.append((heading, "\n".join(body)))
    return out


def paragraph_after(body: str, label: str) -> list[str]:
    """Each paragraph's text from `label` (e.g. 'Command:') at the start of a line to the paragraph's end."""
    return [m.group(0) for m in re.finditer(rf"^{re.escape(label)}.*?(?=\n\s*\n|\Z)", body, re.S | re.M)]


def without_fences(text: str) -> str:
    return re.sub(r"^\s*```.*?^\s*```[^\n]*$", "", text, flags=re.S | re.M)


def code_spans(text: str) -> list[str]:
    """The inline code spans of a markdown text (fenced blocks left out), whitespace collapsed."""
    return [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", without_fences(text))]


def slug(heading: str) -> str:
    """A heading's anchor, as MkDocs (Python-Markdown's toc) and GitHub make it for plain ASCII headings."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))


def cli_subcommands() -> set[str]:
    import argparse

    from moe_rl.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return set(sub.choices)


def references(command: str) -> tuple[list[str], list[str]]:
    """(what the command names that exists, what it names that does not): make targets, moe-rl
    subcommands (a benchmark's file for `moe-rl bench NAME`) and files or directories of the repository."""
    found, missing = [], []
    words = command.split()
    for i, word in enumerate(words):
        nxt = words[i + 1] if i + 1 < len(words) else ""
        if word == "make" and nxt and not nxt.startswith("-"):
            (found if nxt in make_targets() else missing).append(f"make {nxt}")
        elif word.endswith("moe-rl") and nxt and not nxt.startswith("-"):
            (found if nxt in cli_subcommands() else missing).append(f"moe-rl {nxt}")
            if nxt == "bench" and i + 2 < len(words):
                bench = f"tools/bench/{words[i + 2]}.py"
                (found if (ROOT / bench).is_file() else missing).append(bench)
        path = re.split(r":+", word.strip("(),;:'\""))[0]
        if path.startswith(REPO_PREFIXES):
            (found if (ROOT / path).exists() else missing).append(path)
    return found, missing


def test_references_of_a_command():
    assert references(".venv/bin/moe-rl bench gae") == (["moe-rl bench", "tools/bench/gae.py"], [])
    assert references("make quickstart") == (["make quickstart"], [])
    sweep = ".venv/bin/python tools/quickstart_sweep.py --seeds 1"
    assert references(sweep) == (["tools/quickstart_sweep.py"], [])
    assert references("moe-rl bench nothing")[1] == ["tools/bench/nothing.py"]
    assert references("make nothing")[1] == ["make nothing"]
    assert references("moe-rl nothing configs/none.yaml")[1] == ["moe-rl nothing", "configs/none.yaml"]
    assert references("--list") == ([], [])


def test_slug():
    assert slug(" Three seeds of `make quickstart`") == "three-seeds-of-make-quickstart"
    assert slug("`weight_sync`") == "weight_sync" and slug("LoRA RL on the quickstart's task") == \
        "lora-rl-on-the-quickstarts-task"


def test_sections_ignore_comments_in_code():
    text = "intro\n# One\na\n```\n# not a heading\n```\n## Two\nb"
    assert [h for h, _ in sections(text)] == ["", "# One", "## Two"]


def check_commands(where: str, body: str) -> list[str]:
    """Problems with the `Command:` paragraphs of one section."""
    problems = []
    for para in paragraph_after(body, "Command:"):
        spans = code_spans(para)
        if not spans:
            problems.append(f"{where}: a Command: without a `command`")
            continue
        found, _ = references(spans[0])
        if not found:
            problems.append(f"{where}: `{spans[0]}` names no file, make target or moe-rl subcommand")
        for span in spans:
            problems += [f"{where}: `{span}` names {m}, which does not exist" for m in references(span)[1]]
    return problems


def test_every_figure_in_results_has_its_date_commit_machine_command_and_status():
    text = (DOCS / "results.md").read_text()
    blocks = [(h, b) for h, b in sections(text) if h.startswith("### ")]
    assert len(blocks) >= 20
    problems = []
    for heading, body in blocks:
        lines = [line.strip() for line in body.splitlines()]
        for label in ("Measured:", "Command:", "Status:"):
            if sum(line.startswith(label) for line in lines) != 1:
                problems.append(f"results.md {heading}: needs exactly one line starting {label!r}")
        for para in paragraph_after(body, "Status:"):
            if not STATUS.match(para):
                problems.append(f"results.md {heading}: {para[:60]!r}: Status is 'current', 'not re-run "
                                "since <commit>' or 'stale: measured on <commit>, before <what changed>'")
        problems += check_commands(f"results.md {heading}", body)
    assert not problems, "\n".join(problems)


def test_every_dated_figure_elsewhere_has_a_command_beside_it():
    problems = []
    for page in [README, *pages()]:
        if page.name in GENERATED | OWN_RECORDS and page.parent == DOCS:
            continue
        for heading, body in sections(page.read_text()):
            where = f"{page.relative_to(ROOT)} {heading or '(top)'}"
            if DATE.search(heading + body) and not paragraph_after(body, "Command:"):
                problems.append(f"{where}: gives a date ({DATE.search(heading + body).group(0)}) but no "
                                "Command: line")
            problems += check_commands(where, body)
    assert not problems, "\n".join(problems)


def test_the_repository_paths_the_docs_name_exist():
    """A path of the repository that a page names (tools/..., configs/..., tests/..., in prose, code or a
    link) exists; a test named as path::test, or a function as file.py:name, counts by its file."""
    problems = []
    for page in [README, *pages()]:
        for path in REPO_PATH.findall(page.read_text()):
            path = path.rstrip(".")
            if not re.search(r"/[A-Z_]+(\.|/|$)", path) and not (ROOT / path).exists():  # NAME: a placeholder
                problems.append(f"{page.relative_to(ROOT)} names {path}, which does not exist")
    assert not problems, "\n".join(problems)


def test_the_readme_is_the_front_door():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: the details belong in docs/"
    assert "\n```\nmake quickstart\n```\n" in text and "\n```\nmake test\n```\n" in text
    assert "**Where the GPU path stands**" in "\n".join(lines[:20]), "the GPU status: on the first screen"
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert any(link.startswith("docs/") for link in links)
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        target = (ROOT / link.split("#")[0]).resolve()
        assert target.is_relative_to(ROOT), f"README.md links outside the repository: {link}"
        assert not link.startswith(("../", "/")) and "shared/" not in link, link
        assert target.exists(), f"README.md links to {link}, which does not exist"
        if "#" in link and target.suffix == ".md":
            anchors = {slug(h.lstrip("#")) for h, _ in sections(target.read_text()) if h}
            assert link.split("#")[1] in anchors, f"README.md links to {link}: no such heading there"
    # every page of the site is reachable from the README (index.md is the site's own home page)
    for page in pages():
        if page.name == "index.md":
            continue
        assert f"docs/{page.name}" in text, f"README.md does not link docs/{page.name}"


def test_method_names_are_the_registry_s():
    """No page (nor the README) spells a method otherwise than the registry (e.g. dr_grpo for drgrpo)."""
    for page in [README, *pages()]:
        assert "dr_grpo" not in page.read_text(), f"{page.relative_to(ROOT)}: the registered name is drgrpo"


def test_the_algorithms_page_lists_every_registered_method():
    from moe_rl.algos import registry
    from moe_rl.config import AlgorithmSection

    text = (DOCS / "algorithms.md").read_text()
    rows = re.findall(r"^\| (\w+) \| `(\w+)` \|", text, re.M)
    listed = {(kind, name) for kind, name in rows if kind in registry.KINDS}
    registered = {(kind, name) for kind in registry.KINDS for name in registry.names(kind)}
    assert listed == registered, (f"missing from docs/algorithms.md: {sorted(registered - listed)}; "
                                  f"listed but not registered: {sorted(listed - registered)}")
    for name in typing.get_args(typing.get_type_hints(AlgorithmSection)["aggregation"]):
        assert re.search(rf"^\| `{name}`", text, re.M), f"aggregation {name} missing from docs/algorithms.md"


def test_the_docs_site_builds_strict(tmp_path):
    """mkdocs build --strict over docs/ (mkdocs.yml): a broken link, a missing anchor or a page left out of
    the navigation fails. Skipped where MkDocs is not installed (the dev extra installs it)."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d",
           str(tmp_path / "site")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "results" / "index.html").is_file()
    assert (tmp_path / "site" / "config" / "index.html").is_file()
