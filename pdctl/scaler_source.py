"""The pdctl package as one reproducible .tar.gz, for the scaler on the router host.

One file, so the pd_scaler role copies it in one round trip (a directory copy costs a few round
trips per file: 15-25 s for pdctl's). Content-addressed and byte-for-byte reproducible (sorted,
no owners, zero mtimes), so an unchanged pdctl copies nothing on a redeploy. Standard library
only: a plain `ansible-playbook` run packs the checkout with `python3 -m pdctl.scaler_source
DIR` on the controller (roles/pd_scaler/tasks/install.yml), pdctl itself through `archive()`.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import sys
import tarfile
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def archive(folder: Path, package: Path = PACKAGE) -> Path:
    """The archive of ``package``'s Python files under ``folder``, built when missing."""
    files = sorted(
        f
        for f in package.rglob("*.py")
        if not {"_content", "__pycache__"} & set(f.relative_to(package).parts)
    )
    digest = hashlib.sha256()
    for file in files:
        digest.update(str(file.relative_to(package)).encode() + b"\0" + file.read_bytes())
    target = folder / f"pdctl-{digest.hexdigest()[:16]}.tar.gz"
    if not target.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        staging = target.with_name(target.name + ".tmp")
        with (
            staging.open("wb") as raw,
            gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as zipped,
            tarfile.open(fileobj=zipped, mode="w", format=tarfile.PAX_FORMAT) as tar,
        ):
            for file in files:
                info = tarfile.TarInfo(f"pdctl/{file.relative_to(package)}")
                data = file.read_bytes()
                info.size, info.mode, info.mtime = len(data), 0o644, 0
                tar.addfile(info, io.BytesIO(data))
        staging.rename(target)
    return target


if __name__ == "__main__":
    print(archive(Path(sys.argv[1])))
