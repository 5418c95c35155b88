"""The suite passes wherever the checkout lives, also where other users cannot enter.

A new user cloning as root into their home (mode 0700) or a ``mktemp -d``
folder must get a green suite: the tests that drop to another user's uid run
their child from a copy of opcache and the helpers that every user can read.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from helpers_cache import TESTS_DIR, run_python
from helpers_faults import requires_root

import opcache


@requires_root
def test_a_child_of_another_user_runs_from_a_checkout_others_cannot_enter(
    tmp_path: Path,
) -> None:
    checkout = tmp_path / "private" / "checkout"
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(TESTS_DIR, checkout / "tests", ignore=ignore)
    shutil.copytree(Path(opcache.__file__).parent, checkout / "opcache", ignore=ignore)
    os.chmod(tmp_path / "private", 0o700)
    env = {**os.environ, "PYTHONPATH": str(checkout), "PYTHONDONTWRITEBYTECODE": "1"}
    test = "tests/test_security.py::test_two_members_of_the_group_share_one_cache"
    done = run_python(
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", test], cwd=checkout, env=env, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "1 passed" in done.stdout
