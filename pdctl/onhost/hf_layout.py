"""The Hugging Face hub cache layout, and the rules for the names that become its paths. PURE.

No network: pdctl's plan checks a spec's model id and revision with these rules, and
model_fetch.py (which runs on the hosts) imports them, so that both read one copy.

The layout (docs/facts.md, "Hugging Face Hub API and cache"): ``<HF_HOME>/hub/models--ORG--NAME/``
holds ``blobs/<sha256 (LFS) or git blob oid>``, ``snapshots/<commit>/<path>`` (relative
symlinks to the blobs) and ``refs/<revision>`` (the commit). Beside ``hub``, pdctl's own
records: ``<HF_HOME>/pdctl/models--ORG--NAME/`` (each commit's file list, the blobs verified).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

REPO_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_REPO_ID = re.compile(rf"^(?:{REPO_PART}/)?{REPO_PART}\Z")
_REVISION = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,98}[A-Za-z0-9])?\Z")
COMMIT = re.compile(r"^[0-9a-f]{40}\Z")
_SHA256 = re.compile(r"^[0-9a-f]{64}\Z")
_PATH_PART = re.compile(r"^(?!\.\.?\Z)[A-Za-z0-9_.][A-Za-z0-9._+-]{0,199}\Z")
MAX_DEPTH = 8


# ---------------------------------------------------------------- names (hostile input)
def check_repo_id(repo: Any) -> str:
    """A hub model id (ORG/NAME or NAME): letters, digits, . _ -, no '--' or '..'."""
    if not isinstance(repo, str) or not _REPO_ID.match(repo) or "--" in repo or ".." in repo:
        raise ValueError(
            f"{repo!r} is not a hub model id (ORG/NAME: letters, digits, '.', '_', '-', "
            "at most 96 each, no '--' or '..')"
        )
    return repo


def check_revision(revision: Any) -> str:
    """A branch, a tag or a commit: letters, digits, . _ - (no '/', no '..')."""
    if not isinstance(revision, str) or not _REVISION.match(revision) or ".." in revision:
        raise ValueError(
            f"{revision!r} is not a revision (a branch, tag or commit: letters, digits, "
            "'.', '_', '-', at most 100, no '..')"
        )
    return revision


def check_path(path: Any) -> str:
    """A file of a model, relative: parts of letters, digits, . _ + - (no '.' or '..')."""
    if not isinstance(path, str):
        raise ValueError(f"{path!r} is not a model file path")
    parts = path.split("/")
    if len(parts) > MAX_DEPTH or not all(_PATH_PART.match(p) for p in parts):
        raise ValueError(f"{path!r} is not a model file path this cache accepts")
    return path


def check_commit(value: Any) -> str:
    if not isinstance(value, str) or not COMMIT.match(value):
        raise ValueError(f"{value!r} is not a commit id (40 hex digits)")
    return value


def check_blob_name(value: Any) -> str:
    if not isinstance(value, str) or not (COMMIT.match(value) or _SHA256.match(value)):
        raise ValueError(f"{value!r} is not a blob name (a sha256 or a git oid)")
    return value


def _size(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 50:
        raise ValueError(f"{value!r} is not a file size")
    return value


def check_manifest(doc: Any) -> dict[str, Any]:
    """A model's file list as pdctl passes it around: ``{"repo", "commit", "files": [{"path",
    "size", "blob", "lfs"}]}``, every field checked."""
    if not isinstance(doc, dict) or not isinstance(doc.get("files"), list):
        raise ValueError("a manifest is {repo, commit, files: [...]}")
    files = []
    seen = set()
    for entry in doc["files"]:
        if not isinstance(entry, dict):
            raise ValueError("a manifest entry is {path, size, blob, lfs}")
        path = check_path(entry.get("path"))
        if path in seen:
            raise ValueError(f"{path!r} is listed twice")
        seen.add(path)
        files.append(
            {
                "path": path,
                "size": _size(entry.get("size")),
                "blob": check_blob_name(entry.get("blob")),
                "lfs": bool(entry.get("lfs")),
            }
        )
    return {
        "repo": check_repo_id(doc.get("repo")),
        "commit": check_commit(doc.get("commit")),
        "files": files,
    }


# ---------------------------------------------------------------- the layout
def repo_dir_name(repo: str) -> str:
    return "models--" + check_repo_id(repo).replace("/", "--")


def repo_dir(cache: str, repo: str) -> Path:
    return Path(cache, "hub", repo_dir_name(repo))


def record_dir(cache: str, repo: str) -> Path:
    return Path(cache, "pdctl", repo_dir_name(repo))
