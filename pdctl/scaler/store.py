"""Where a scaler keeps its state and reads `pdctl scale`'s pins: files in a directory on the
router host, or the same files over SSH from the control node (pdctl/scaler/setup.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pdctl.core import layout


class Store:
    """Where the scaler keeps its state and reads pins: local files, or files over SSH."""

    def __init__(
        self, read: Callable[[str], str | None], write: Callable[[str, str], None]
    ) -> None:
        self.read, self.write = read, write

    @classmethod
    def directory(cls, path: Path) -> Store:
        def read(name: str) -> str | None:
            file = path / name
            return file.read_text() if file.is_file() else None

        def write(name: str, text: str) -> None:
            path.mkdir(parents=True, exist_ok=True)
            tmp = path / f".{name}.tmp"
            tmp.write_text(text)
            tmp.replace(path / name)

        return cls(read, write)

    def state(self) -> str | None:
        """What the scaler last recorded (under its older name, by an older pdctl's scaler)."""
        text = self.read(layout.SCALER_STATE)
        return text if text is not None else self.read(layout.SCALER_STATE_LEGACY)

    def pins(self) -> str | None:
        """`pdctl scale`'s pins, as the operator last wrote them."""
        return self.read(layout.SCALER_PINS)
