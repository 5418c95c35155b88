"""The README's examples work as written: its Python runs, its commands exist.

Every ```python block runs in a fresh folder (HOME there too); every ```bash
block parses; every ``opcache <command>`` the README mentions answers
``--help``, and every flag it shows for one is among that command's flags.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
from helpers_cache import TESTS_DIR, run_python

from opcache.cli import main

README = (TESTS_DIR.parent / "README.md").read_text(encoding="utf-8")
BLOCKS = re.findall(r"^```(\w*)\n(.*?)^```$", README, re.S | re.M)
PYTHON = [body for lang, body in BLOCKS if lang == "python"]
BASH = [body for lang, body in BLOCKS if lang == "bash"]
# `opcache <command> [flags...]` in code spans and in the bash blocks' lines.
MENTIONS = re.findall(r"`(opcache [^`]+)`", README) + [
    part.strip()
    for body in BASH
    for line in body.replace("\\\n", " ").splitlines()
    for part in re.split(r"&&|;|\|\|", line)
    if part.strip().startswith("opcache ")
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


def test_the_readme_has_examples_to_check():
    assert PYTHON and BASH
    assert {"wrap", "compile", "stats", "age", "verify", "clear", "demo"} <= set(COMMANDS)


@pytest.mark.skipif(shutil.which("cc") is None, reason="the example compiles with cc")
@pytest.mark.parametrize("index", range(len(PYTHON)))
def test_each_python_block_runs_as_written(tmp_path, index):
    env = {"HOME": str(tmp_path), "PATH": os.environ.get("PATH", os.defpath)}
    done = run_python(["-c", PYTHON[index]], cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    if "cache.compile(" in PYTHON[index]:
        statuses = [line.split()[0] for line in done.stdout.splitlines()]
        assert statuses == ["miss", "hit"], done.stdout


@pytest.mark.parametrize("index", range(len(BASH)))
def test_each_bash_block_parses(index):
    done = subprocess.run(
        ["bash", "-n"], input=BASH[index], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_command_the_readme_mentions_exists_with_its_flags(name, capsys):
    try:
        status = main([name, "--help"])
    except SystemExit as e:  # argparse's --help
        status = e.code
    out, err = capsys.readouterr()
    assert (status, err) == (0, ""), err
    for flag in COMMANDS[name]:
        assert re.search(rf"(^|\s){re.escape(flag)}\b", out), f"opcache {name} has no {flag}"
