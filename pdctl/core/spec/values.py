"""The values a service file spells its own way: durations (``30s``, ``10m``), memory (``80GB``),
ranges (``1..4``, ``8..``), GPUs (dstack's ``H100:80GB:2``, ``MI300X:4``, vendors, counts), the
resources they make up; the names, images and ports that become paths and unit words; and
SpecError, which names the file, the line and the field.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    model_validator,
)

from pdctl.core import validate
from pdctl.core.errors import InputError
from pdctl.core.fleet_model import GpuVendor

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")

_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(MB|GB|TB)?\s*$", re.I)


class SpecError(InputError):
    """A pd.yml problem: file, line, field, what is wrong."""

    def __init__(
        self, path: Path, line: int | None, field: str | None, problem: str, hint: str | None = None
    ) -> None:
        where = f"{path}:{line}" if line else str(path)
        subject = f" {field}:" if field else ""
        super().__init__(
            f"{where}:{subject} {problem}", hint=hint, file=str(path), line=line, field=field
        )


def to_seconds(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError("a duration: a number of seconds or e.g. 30s, 5m, 1h")
    if isinstance(value, int | float):
        return float(value)
    match = _DURATION.match(str(value))
    if not match:
        raise ValueError(f"{value!r} is not a duration (use e.g. 30s, 5m, 1h)")
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    return float(match[1]) * units[match[2] or "s"]


def _delay(value: float) -> float:
    return validate.seconds(value, zero_ok=True)


# A time span: positive and finite (a delay may be 0).
Duration = Annotated[float, BeforeValidator(to_seconds), AfterValidator(validate.seconds)]

Delay = Annotated[float, BeforeValidator(to_seconds), AfterValidator(_delay)]

Port = Annotated[int, AfterValidator(validate.port)]

HostPath = Annotated[str, AfterValidator(validate.host_path)]

Image = Annotated[str, AfterValidator(validate.image)]

ImageId = Annotated[str, AfterValidator(validate.image_id)]

IMAGE_ID_HELP = (
    "The worker image's ID (sha256:...), as the operator knows it: the image every host must "
    "run under that name, checked before a host takes it from another."
)

Name = Annotated[str, AfterValidator(validate.service_name)]


def _gib(value: Any) -> float:
    match = _MEMORY.match(str(value))
    if not match:
        raise ValueError(f"{value!r} is not a size (use e.g. 512GB)")
    return float(match[1]) * {"MB": 1 / 1024, "GB": 1, "TB": 1024}[(match[2] or "GB").upper()]


class Range(BaseModel):
    """``N``, ``N..``, ``..M`` or ``N..M`` (dstack's range syntax)."""

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)
    min: float | None = Field(None, ge=0)
    max: float | None = Field(None, ge=0)

    @classmethod
    def parse(cls, value: Any, unit: Any = float) -> Range:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return cls(min=float(value), max=float(value))
        text = str(value).strip()
        low, sep, high = text.partition("..")
        if not sep:
            number = unit(text)
            return cls(min=number, max=number)
        return cls(min=unit(low) if low.strip() else None, max=unit(high) if high.strip() else None)

    def contains(self, value: float) -> bool:
        return (self.min is None or value >= self.min) and (self.max is None or value <= self.max)

    def describe(self) -> str:
        low = "" if self.min is None else f"{self.min:g}"
        high = "" if self.max is None else f"{self.max:g}"
        return low if self.min == self.max else f"{low}..{high}"


def _cpu_range(value: Any) -> Range:
    return Range.parse(value, float)


def _mem_range(value: Any) -> Range:
    return Range.parse(value, _gib)


# dstack's vendor tokens (gpuhunt's AcceleratorVendor and its aliases); pdctl places on two.
_VENDORS: dict[str, GpuVendor | None] = {
    "amd": "amd",
    "nvidia": "nvidia",
    "google": None,
    "tpu": None,
    "intel": None,
    "tenstorrent": None,
    "tt": None,
}

# A GPU name as dstack spells it (H200, MI300X, A100, RTX4090, ...): it starts with a letter.
_GPU_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.+-]{0,63}\Z")

GPU_FORMS = "e.g. H200, H200:8, 8, nvidia:2, MI300X:4, H100:80GB:2, H100,H200:8, 80GB..:4"


def _gpu_vendor(token: str) -> GpuVendor | None:
    vendor = _VENDORS[token.lower()]
    if vendor is None:
        raise ValueError(f"GPU vendor {token!r}: pdctl places workers on amd or nvidia GPUs")
    return vendor


def _gpu_names(value: Any) -> tuple[str, ...]:
    names = value if isinstance(value, list | tuple) else str(value).split(",")
    found = []
    for name in names:
        text = str(name).strip()
        if not _GPU_NAME.match(text):
            raise ValueError(
                f"GPU name {text!r}: a letter, then letters, digits, '.', '_', '+' or '-' "
                "(dstack's spelling: H200, H100, A100, MI300X)"
            )
        found.append(text)
    if not found:
        raise ValueError("an empty list of GPU names")
    return tuple(found)


def _gpu_count(value: Any) -> int:
    """The GPUs one replica takes: a count, or the low end of a range (dstack picks the
    smallest offer that fits; a replica's launch command fixes its tensor parallelism)."""
    if isinstance(value, bool):
        raise ValueError("a GPU count: N or MIN..MAX")
    text = str(value).replace(" ", "")
    if not re.fullmatch(r"\d+|\d*\.\.\d*", text) or text == "..":
        raise ValueError(f"{value!r} is not a GPU count (use N or MIN..MAX, e.g. 8 or 1..8)")
    low, sep, high = text.partition("..")
    count = int(low) if low else 1
    if sep and high and int(high) < count:
        raise ValueError(f"GPU count {text}: MIN is above MAX")
    if not 1 <= count <= 64:
        raise ValueError(f"GPU count {text}: a replica takes 1..64 GPUs")
    return count


def _gpu_memory(value: Any) -> Range:
    text = str(value).replace(" ", "")
    if not re.fullmatch(r"[0-9.]*(MB|GB|TB)?(\.\.([0-9.]+(MB|GB|TB)?)?)?", text, re.I) or not text:
        raise ValueError(f"{value!r} is not a GPU memory size (use e.g. 80GB, 80GB.., 40GB..80GB)")
    try:
        memory = Range.parse(text, _gib)
    except ValueError:
        raise ValueError(f"{value!r} is not a GPU memory size (use e.g. 80GB, 80GB..)") from None
    if memory.min is None and memory.max is None:
        raise ValueError(f"{value!r}: an empty memory range")
    if memory.min is not None and memory.max is not None and memory.min > memory.max:
        raise ValueError(f"GPU memory {value}: MIN is above MAX")
    return memory


class Gpu(BaseModel):
    """A replica's GPUs in dstack's grammar: ``H200``, ``H200:8``, ``8``, ``nvidia``,
    ``MI300X:192GB:4``, ``H100,H200:8``, ``80GB..:2``, or the mapping form
    ``{vendor, name: [H100, H200], count, memory, total_memory}``. Tokens of the text form are
    told apart as dstack does: a vendor, a name (starts with a letter; ``,`` separates
    alternatives), a memory (has a unit), a count (the rest)."""

    model_config = ConfigDict(frozen=True)
    vendor: GpuVendor | None = None
    names: tuple[str, ...] = ()
    count: int = Field(1, ge=1, le=64, description="GPUs per replica, on one host.")
    memory: Range | None = Field(None, description="Per GPU, in GB (GiB, as dstack counts).")
    total_memory: Range | None = Field(None, description="Of the replica's GPUs together, in GB.")

    @model_validator(mode="before")
    @classmethod
    def _model_alias(cls, data: Any) -> Any:
        # Gpu(model="MI300X") reads as one name: the form pdctl's own code and tests use.
        if isinstance(data, dict) and "model" in data:
            data = dict(data)
            model = data.pop("model")
            if model is not None:
                data["names"] = (model,)
        return data

    @property
    def model(self) -> str | None:
        """The names as written (``H100,H200``), None when any model will do."""
        return ",".join(self.names) if self.names else None

    @classmethod
    def parse(cls, value: Any) -> Gpu:
        if isinstance(value, Gpu):
            return value
        if isinstance(value, dict):
            return cls._parse_mapping(value)
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ValueError(f"a GPU spec is text, a count or a mapping ({GPU_FORMS})")
        found: dict[str, Any] = {}
        text = str(value).replace(" ", "")
        for token in text.split(":"):
            if not token:
                raise ValueError(f"GPU spec {value!r} has an empty part ({GPU_FORMS})")
            parsed: Any
            if token.lower() in _VENDORS:
                kind, parsed = "vendor", _gpu_vendor(token)
            elif token[0].isalpha():
                kind, parsed = "names", _gpu_names(token)
            elif any(c.isalpha() for c in token):
                kind, parsed = "memory", _gpu_memory(token)
            else:
                kind, parsed = "count", _gpu_count(token)
            if kind in found:
                raise ValueError(f"GPU spec {value!r} gives the {kind} twice ({GPU_FORMS})")
            found[kind] = parsed
        return cls(**found)

    @classmethod
    def _parse_mapping(cls, value: dict[str, Any]) -> Gpu:
        allowed = {"vendor", "name", "count", "memory", "total_memory"}
        if "compute_capability" in value:
            raise ValueError(
                "compute_capability: pdctl cannot check it (the hosts' facts do not carry it); "
                "name the GPUs instead (name: [H100, H200])"
            )
        unknown = sorted(str(k) for k in value if k not in allowed)
        if unknown:
            raise ValueError(
                f"unknown GPU field(s) {', '.join(unknown)} (allowed: {sorted(allowed)})"
            )
        found: dict[str, Any] = {}
        if value.get("vendor") is not None:
            if str(value["vendor"]).lower() not in _VENDORS:
                raise ValueError(f"GPU vendor {value['vendor']!r}: use amd or nvidia")
            found["vendor"] = _gpu_vendor(str(value["vendor"]))
        if value.get("name") is not None:
            found["names"] = _gpu_names(value["name"])
        if value.get("count") is not None:
            found["count"] = _gpu_count(value["count"])
        for key in ("memory", "total_memory"):
            if value.get(key) is not None:
                found[key] = _gpu_memory(value[key])
        return cls(**found)

    def describe(self) -> str:
        """As the spec would write it: ``H200:1``, ``nvidia:80GB..:2``, ``MI300X:192GB:4``."""
        parts: list[str] = [self.vendor] if self.vendor else []
        if self.names:
            parts.append(",".join(self.names))
        if self.memory:
            parts.append(describe_gb(self.memory))
        parts.append(str(self.count))
        text = ":".join(parts)
        if self.total_memory:
            text += f" (total {describe_gb(self.total_memory)})"
        return text


def describe_gb(memory: Range) -> str:
    low = "" if memory.min is None else f"{memory.min:g}GB"
    high = "" if memory.max is None else f"{memory.max:g}GB"
    return low if memory.min == memory.max else f"{low}..{high}"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)


class Resources(Strict):
    gpu: Annotated[Gpu | None, BeforeValidator(lambda v: None if v is None else Gpu.parse(v))] = (
        None
    )
    cpu: Annotated[
        Range | None, BeforeValidator(lambda v: None if v is None else _cpu_range(v))
    ] = None
    memory: Annotated[
        Range | None, BeforeValidator(lambda v: None if v is None else _mem_range(v))
    ] = None
    disk: Annotated[
        Range | None, BeforeValidator(lambda v: None if v is None else _mem_range(v))
    ] = None
    shm_size: Annotated[float | None, BeforeValidator(lambda v: None if v is None else _gib(v))] = (
        None
    )


def field_name(loc: tuple[str | int, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out
