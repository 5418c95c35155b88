"""The README's and docs/ pages' examples work as written; their links lead somewhere.

In README.md and every docs/*.md: every ```python block runs in a fresh
folder (HOME there too); every ```bash block parses; every ``opcache
<command>`` mentioned answers ``--help``, and every flag shown for one is among
that command's flags; every relative link names a file of the checkout, and
its ``#anchor`` a heading of that file.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers_cache import TESTS_DIR, run_python

from opcache.cli import main

ROOT = TESTS_DIR.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TEXTS = {page.relative_to(ROOT).as_posix(): page.read_text(encoding="utf-8") for page in PAGES}
BLOCKS = [
    (name, lang, body)
    for name, text in TEXTS.items()
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```$", text, re.S | re.M)
]
PYTHON = [(name, body) for name, lang, body in BLOCKS if lang == "python"]
BASH = [(name, body) for name, lang, body in BLOCKS if lang == "bash"]
# `opcache <command> [flags...]` in code spans and in the bash blocks' lines.
MENTIONS = [m for text in TEXTS.values() for m in re.findall(r"`(opcache [^`]+)`", text)] + [
    part.strip()
    for _, body in BASH
    for line in body.replace("\\\n", " ").splitlines()
    for part in re.split(r"&&|;|\|\|", line)
    if part.strip().startswith("opcache ")
]
# [text](target) and ![alt](target), outside code blocks and code spans.
LINKS = [
    (name, target)
    for name, text in TEXTS.items()
    for target in re.findall(
        r"\]\(([^)\s]+)\)",
        re.sub(r"`[^`\n]*`", "", re.sub(r"^```.*?^```$", "", text, flags=re.S | re.M)),
    )
    if not re.match(r"[a-z]+:", target)  # a web address: not checked here
]


def command_and_flags(mention: str) -> tuple[str, list[str]]:
    words = mention.split("#", 1)[0].split()
    own = words[: words.index("--")] if "--" in words else words  # wrap: the command follows
    flags = [w.strip("[]").split("=", 1)[0] for w in own[2:] if w.strip("[]").startswith("--")]
    return words[1], flags


COMMANDS: dict[str, set[str]] = {}
for _mention in MENTIONS:
    _name, _flags = command_and_flags(_mention)
    if re.fullmatch(r"[a-z]+", _name):  # not `opcache <command>`
        COMMANDS.setdefault(_name, set()).update(_flags)


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to -."""
    text = re.sub(r"^```.*?^```$", "", text, flags=re.S | re.M)
    return {
        re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        for heading in re.findall(r"^#+ (.*)$", text, re.M)
    }


def test_the_pages_have_examples_to_check():
    assert "docs/wrap.md" in TEXTS and "docs/library.md" in TEXTS
    assert PYTHON and BASH and LINKS
    assert any(name == "README.md" for name, _ in PYTHON)
    assert {"wrap", "compile", "stats", "age", "verify", "clear", "demo"} <= set(COMMANDS)


def test_anchors_are_githubs():
    assert anchors("# Why a miss: `opcache explain`\n## Checkouts: `OPCACHE_BASE_DIR`\n") == {
        "why-a-miss-opcache-explain",
        "checkouts-opcache_base_dir",
    }


@pytest.mark.skipif(shutil.which("cc") is None, reason="the example compiles with cc")
@pytest.mark.parametrize(
    "index", range(len(PYTHON)), ids=[f"{n}-{i}" for i, (n, _) in enumerate(PYTHON)]
)
def test_each_python_block_runs_as_written(tmp_path, index):
    code = PYTHON[index][1]
    env = {"HOME": str(tmp_path), "PATH": os.environ.get("PATH", os.defpath)}
    done = run_python(["-c", code], cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    if "cache.compile(" in code:
        statuses = [line.split()[0] for line in done.stdout.splitlines()]
        assert statuses == ["miss", "hit"], done.stdout


@pytest.mark.parametrize(
    "index", range(len(BASH)), ids=[f"{n}-{i}" for i, (n, _) in enumerate(BASH)]
)
def test_each_bash_block_parses(index):
    done = subprocess.run(
        ["bash", "-n"], input=BASH[index][1], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_command_the_pages_mention_exists_with_its_flags(name, capsys):
    try:
        status = main([name, "--help"])
    except SystemExit as e:  # argparse's --help
        status = e.code
    out, err = capsys.readouterr()
    assert (status, err) == (0, ""), err
    for flag in COMMANDS[name]:
        assert re.search(rf"(^|\s){re.escape(flag)}\b", out), f"opcache {name} has no {flag}"


@pytest.mark.parametrize(("page", "target"), LINKS)
def test_each_link_leads_to_a_file_and_heading(page, target):
    path, _, anchor = target.partition("#")
    file = (ROOT / page).parent / path if path else ROOT / page
    assert file.resolve().is_relative_to(ROOT) and file.exists(), f"{page}: no file {path}"
    if anchor:
        assert anchor in anchors(Path(file).read_text(encoding="utf-8")), f"{page}: no #{anchor}"
