"""The repository's commits, for the bench provenance tests: they stamp real commit ids into the results they
write (a result whose commit is not in the history is excluded from RESULTS.md), so they need a git checkout
with its history, as CI's clean clone is. Outside one they fail saying so instead of skipping (a skipped
test checks nothing)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def has_rev(rev: str) -> bool:
    """Whether `rev` names a commit of this checkout."""
    return _parse(rev) is not None


def rev(rev: str = "HEAD") -> str:
    """The full id of commit `rev`; fails the test when the checkout (or its history) lacks it."""
    out = _parse(rev)
    if out is None:
        pytest.fail(f"git rev-parse {rev} found no commit in {REPO}: the bench provenance tests need a git "
                    "checkout with its history (clone the repository, not a shallow clone or an archive)")
    return out


def _parse(rev: str) -> str | None:
    res = subprocess.run(["git", "rev-parse", "-q", "--verify", f"{rev}^{{commit}}"], cwd=REPO,
                         capture_output=True, text=True)
    return res.stdout.strip() if res.returncode == 0 else None
