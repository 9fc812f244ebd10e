"""Which benchmark JSONs may be tabled in bench/RESULTS.md, and where each came from.

A result qualifies only when the code it measured is known: its recorded commit is a commit of this
repository (`git cat-file -e <commit>^{commit}`) and its tree was not dirty. Anything else is listed as
excluded with the reason, never tabled. Among qualifying results the newest per point wins. A serve
result of schema 2 or later (bench/serve.py) also records what the server said it ran (GET /version):
it qualifies only with the server's commit, dirty flag, topology and GPUs recorded, and the server's
commit known and clean by the same rule; older serve results (no schema) qualify by their own env as before.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvrelay.bench import common as C

_HEX = re.compile(r"^[0-9a-f]{7,40}$")
_STAMP = re.compile(r"(\d{8})(?:-(\d{6}))?")
# File-name prefixes of results written without a "kind" field (kernels.py, mixed.py, profile_decode.py...).
_PREFIX_KINDS = (("kernels-", "kernels"), ("mixed-", "mixed"), ("profile-decode-", "profile"),
                 ("profile-prefill-", "profile-prefill"),
                 ("runner-timing-", "runner-timing"), ("structured-", "structured"))


@dataclass(frozen=True)
class Result:
    """One JSON under the results folder, with its provenance resolved."""
    name: str            # file name (results are named by file name only: the report is path-independent)
    kind: str            # prefill / decode / kernels / serve / mixed / profile / status / ...
    data: Any
    commit: str | None   # as recorded
    date: str            # "YYYY-MM-DD HH:MM" (UTC), from env.timestamp, else the file name's stamp
    tree: str            # "clean", "not recorded" (a copied tree: KVRELAY_GIT_COMMIT) or "dirty"
    excluded: str | None = None  # why it may not be tabled; None when it qualifies

    @property
    def short(self) -> str:
        return (self.commit or "?")[:7]

    @property
    def env(self) -> dict:
        return self.data.get("env") or {} if isinstance(self.data, dict) else {}

    @property
    def source(self) -> str:
        """The cell that says where a figure came from: `abc1234` 2026-12-01 11:15."""
        return f"`{self.short}` {self.date}"


@dataclass
class Collection:
    results: list[Result] = field(default_factory=list)

    def qualifying(self, kind: str) -> list[Result]:
        return sorted((r for r in self.results if r.kind == kind and r.excluded is None),
                      key=lambda r: (r.date, r.name))

    @property
    def excluded(self) -> list[Result]:
        return [r for r in self.results if r.excluded is not None]


def _kind(name: str, data: Any) -> str:
    if isinstance(data, dict) and isinstance(data.get("kind"), str):
        return data["kind"]
    if isinstance(data, list):
        return "status"  # `kvrelay status --json` snapshots saved beside serve runs
    for prefix, kind in _PREFIX_KINDS:
        if name.startswith(prefix):
            return kind
    return "other"


def _date(name: str, env: dict) -> str:
    ts = env.get("timestamp")
    if ts:
        try:
            t = _dt.datetime.fromisoformat(ts).astimezone(_dt.timezone.utc)
            return t.strftime("%Y-%m-%d %H:%M")
        except ValueError:
            pass
    m = _STAMP.search(name)
    if not m:
        return "undated"
    day = f"{m[1][:4]}-{m[1][4:6]}-{m[1][6:]}"
    return f"{day} {m[2][:2]}:{m[2][2:4]}" if m[2] else day


def _recorded(data: Any) -> tuple[str | None, bool | None]:
    """(commit, dirty) as the JSON records them: env.git_commit / env.git_dirty, or kernels.py's `commit`."""
    if not isinstance(data, dict):
        return None, None
    env = data.get("env") or {}
    if "git_commit" in env:
        return env.get("git_commit"), env.get("git_dirty")
    return data.get("commit"), None


def known_commits(commits: set[str], repo: Path = C.REPO_ROOT) -> set[str]:
    """The subset of `commits` that name a commit object of the repository at `repo` (one git call)."""
    cands = sorted(c for c in commits if _HEX.match(c))
    if not cands:
        return set()
    try:
        out = subprocess.run(["git", "cat-file", "--batch-check"], cwd=repo, capture_output=True, text=True,
                             input="".join(f"{c}^{{commit}}\n" for c in cands), timeout=30)
    except (OSError, subprocess.SubprocessError):
        return set()
    if out.returncode != 0:
        return set()
    lines = out.stdout.splitlines()
    return {c for c, line in zip(cands, lines) if line.split()[1:2] == ["commit"]}


def _why_excluded(commit: Any, dirty: bool | None, ok: set[str]) -> str | None:
    if dirty is True:
        return "dirty tree (env.git_dirty is true)"
    if commit in (None, "", "unknown"):
        return f"commit {commit or 'not recorded'!s}"
    if not isinstance(commit, str) or not _HEX.match(commit):
        return f"commit field {str(commit)!r} is not a commit id"
    if commit not in ok:
        return f"commit {commit} is not a commit of this repository"
    return None


SERVER_KEYS = ("git_commit", "git_dirty", "topology", "gpus")  # what a schema-2 serve result records of the server


def _server(data: Any) -> dict | None:
    """A serve result's record of the server it measured (bench/serve.py `server`, from GET /version), or
    None where no such record is required: results before schema 2 qualify by their own env as before."""
    if isinstance(data, dict) and data.get("kind") == "serve" and (data.get("schema") or 1) >= 2:
        server = data.get("server")
        return server if isinstance(server, dict) else {}
    return None


def _why_server_excluded(server: dict, ok: set[str]) -> str | None:
    missing = [k for k in SERVER_KEYS if k not in server]
    if missing or not server.get("topology"):
        return f"the server's /version not recorded ({', '.join(missing) or 'topology'} missing)"
    why = _why_excluded(server.get("git_commit"), server.get("git_dirty"), ok)
    return f"server: {why}" if why else None


def collect(paths: list[Path], repo: Path = C.REPO_ROOT) -> Collection:
    """Every *.json in `paths` (folders or files), provenance checked against the repository at `repo`."""
    files: list[Path] = []
    for p in paths:
        files += sorted(p.glob("*.json")) if p.is_dir() else [p]
    raw = []
    for f in files:
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raw.append((f.name, None, f"unreadable: {type(e).__name__}"))
            continue
        raw.append((f.name, data, None))
    commits = {c for _, d, _ in raw for c in [_recorded(d)[0]] if isinstance(c, str)}
    commits |= {c for _, d, _ in raw for c in [(_server(d) or {}).get("git_commit")] if isinstance(c, str)}
    ok = known_commits(commits, repo)
    out = Collection()
    for name, data, err in raw:
        commit, dirty = _recorded(data)
        kind = _kind(name, data)
        env = data.get("env") or {} if isinstance(data, dict) else {}
        tree = "dirty" if dirty is True else "clean" if dirty is False else "not recorded"
        why = err or _why_excluded(commit, dirty, ok)
        server = _server(data)
        if why is None and server is not None:
            why = _why_server_excluded(server, ok)
        out.results.append(Result(name=name, kind=kind, data=data, commit=commit if isinstance(commit, str) else None,
                                  date=_date(name, env), tree=tree, excluded=why))
    return out


def newest_per_point(results: list[Result], points, key) -> dict:
    """{key(result, point): (result, point)} keeping the newest result for each key; `results` must be
    sorted oldest first (Collection.qualifying), `points(result)` lists a result's points."""
    chosen: dict = {}
    for r in results:
        for p in points(r):
            chosen[key(r, p)] = (r, p)
    return chosen
