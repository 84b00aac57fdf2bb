"""Which file list of a model the fan-out trusts (pdctl/operations/prefetch.py): the hub's, as
pdctl asks it itself; without the hub (a mirror directory on the hosts, or a hub out of pdctl's
reach), the one every host that reports a list reports, else none.

A host's word on what its cache holds, or on what the mirror holds, is a claim: a compromised
host would name its own commit, files and checksums, and every other host would then take its
files as the model. So a claim only says which bytes a host may already have; the list every
host fetches and checks bytes against comes from here.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
from dataclasses import dataclass
from typing import Any

from pdctl.core import hub_errors
from pdctl.core.errors import HostError, InputError
from pdctl.onhost import hf_layout, model_fetch
from pdctl.onhost.secret_mask import Masker


@dataclass(frozen=True)
class Claim:
    """One list a host reported: its cache's (``where="its cache"``) or the mirror's."""

    host: str
    where: str
    manifest: dict[str, Any]


def _key(manifest: dict[str, Any]) -> tuple[Any, ...]:
    files = sorted((f["path"], f["size"], f["blob"], f["lfs"]) for f in manifest["files"])
    return manifest["repo"], manifest["commit"], tuple(files)


def same(one: dict[str, Any], other: dict[str, Any]) -> bool:
    """Whether two file lists name the same commit and the same files, byte for byte."""
    return _key(one) == _key(other)


def checked(doc: Any) -> dict[str, Any] | None:
    """A host's list as a manifest, or None when it is not one (a lie that cannot even parse)."""
    try:
        return hf_layout.check_manifest(doc) if doc is not None else None
    except ValueError:
        return None


def describe(manifest: dict[str, Any]) -> str:
    return f"commit {manifest['commit'][:12]}, {len(manifest['files'])} file(s)"


def from_hub(
    endpoint: str, repo: str, revision: str, token: str | None, masker: Masker
) -> dict[str, Any] | None:
    """The hub's list, asked by pdctl (None: the hub cannot be reached from here). A hub that
    answers with an error, or a list pdctl refuses (a hostile path), stops the prefetch."""
    what = f"model {repo}@{revision}"
    try:
        return model_fetch.hub_manifest(endpoint, repo, revision, token)
    except urllib.error.HTTPError as exc:
        refused = _refusal(exc, endpoint, repo, revision, token)
        if refused is not None:
            raise refused from None
        raise HostError(
            masker.text(f"{what}: the hub {endpoint}: {model_fetch._reason(exc)}"),
            hint="check the model id, its revision and HF_TOKEN (a gated or private model)",
        ) from None
    except ValueError as exc:  # a list pdctl refuses, or a request it could not make
        raise HostError(
            masker.text(f"{what}: the hub {endpoint}: {exc}"),
            hint="check the fleet's model_endpoint (pdctl fleet show): is it a Hugging Face hub?",
        ) from None
    except (OSError, http.client.HTTPException):
        return None


def _refusal(
    exc: urllib.error.HTTPError, endpoint: str, repo: str, revision: str, token: str | None
) -> InputError | None:
    """The hub's 401, 403 or 404 for the model as the one line the user acts on (its model
    id, its revision, HF_TOKEN): no host is to blame, and no disk (pdctl/core/hub_errors.py)."""
    code = exc.headers.get("X-Error-Code") if exc.headers else None
    try:
        body = json.loads(exc.read(4096) or b"{}")
    except (OSError, ValueError):
        body = {}
    error = body.get("error") if isinstance(body, dict) else None
    found = hub_errors.describe(exc.code, code, error if isinstance(error, str) else None)
    if found is None:
        return None
    return hub_errors.refusal(found, endpoint, repo, revision, bool(token))


def agreed(claims: list[Claim], what: str, why_none: str) -> dict[str, Any]:
    """The one list every claim names (HostError naming each host and what it said, when they
    differ, or when there is none)."""
    if not claims:
        raise HostError(
            f"{what}: no file list to trust: {why_none}",
            hint="make the hub reachable from this machine (pdctl asks it for the file list; "
            "HTTPS_PROXY is honoured), or mount the mirror (--model-endpoint DIR) on the hosts",
        )
    first = claims[0].manifest
    if all(same(first, claim.manifest) for claim in claims[1:]):
        return first
    said = "; ".join(f"{c.host} ({c.where}): {describe(c.manifest)}" for c in claims)
    raise HostError(
        f"{what}: the hosts do not agree on its files, so none is used: {said}",
        hint="a cache left from another commit (pin pdctl.model_revision to the commit you "
        "mean, or remove the stale cache on that host), or a host that lies (take it out of "
        "the fleet); then re-run",
    )
