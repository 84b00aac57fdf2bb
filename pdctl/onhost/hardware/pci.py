"""PCI addresses as nvidia-smi, amd-smi and sysfs spell them, and a device's chain of them."""

from __future__ import annotations

import re

_BDF = re.compile(r"^([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")


def normalize_bdf(text: str) -> str | None:
    """'00000000:1B:00.0' (nvidia-smi) or '0000:1b:00.0' (sysfs) -> '0000:1b:00.0'."""
    match = _BDF.match(text.strip())
    if not match:
        return None
    domain, bus, device, function = match.groups()
    return f"{int(domain, 16):04x}:{bus.lower()}:{device.lower()}.{function}"


def pci_chain(realpath: str | None) -> list[str]:
    """The PCI addresses from the root port down to the device in a sysfs realpath.

    /sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:1b:00.0 -> [0000:15:01.0,
    0000:16:00.0, 0000:1b:00.0]; a trailing non-PCI part (an auxiliary device) is dropped.
    """
    if not realpath:
        return []
    chain = [normalize_bdf(part) for part in realpath.split("/")]
    return [bdf for bdf in chain if bdf]
