"""Devices: ``cpu`` (NumPy) and ``cuda`` / ``cuda:N`` (CuPy, loaded on first use).

>>> from forge_ml.device import Device
>>> Device.parse("cuda:1")
Device('cuda:1')
>>> Device.parse("cpu").type
'cpu'
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import DeviceError


@dataclass(frozen=True)
class Device:
    """A device: ``type`` is "cpu" or "cuda", ``index`` the GPU ordinal (0 for cpu)."""

    type: str
    index: int = 0

    @staticmethod
    def parse(d) -> "Device":
        """Accept a Device, "cpu", "cuda" or "cuda:N"."""
        if isinstance(d, Device):
            return d
        if not isinstance(d, str):
            raise DeviceError(f"device must be a string like 'cpu' or 'cuda:0', got {d!r}")
        s = d.strip().lower()
        if s == "cpu":
            return Device("cpu", 0)
        if s == "cuda":
            return Device("cuda", 0)
        if s.startswith("cuda:"):
            try:
                idx = int(s[5:])
            except ValueError:
                idx = -1
            if idx >= 0:
                return Device("cuda", idx)
        raise DeviceError(f"unknown device {d!r}; expected 'cpu', 'cuda' or 'cuda:N'")

    def __str__(self) -> str:
        return "cpu" if self.type == "cpu" else f"cuda:{self.index}"

    def __repr__(self) -> str:
        return f"Device('{self}')"


CPU = Device("cpu", 0)
