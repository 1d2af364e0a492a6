"""Devices: ``cpu`` (NumPy) and ``cuda`` / ``cuda:N`` (CuPy, loaded on first use), and any
other device type registered with ``forge_ml.backends.register``.

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
    """A device: ``type`` is a registered backend name ("cpu", "cuda", ...), ``index`` the
    ordinal of a device of that type (0 for cpu).

    >>> Device.parse("cpu"), Device.parse("cpu") == Device("cpu", 0)
    (Device('cpu'), True)
    """

    type: str
    index: int = 0

    @staticmethod
    def parse(d) -> "Device":
        """Accept a Device, or "TYPE" / "TYPE:N" for a registered TYPE ("cpu", "cuda:1").

        >>> Device.parse("cpu").type
        'cpu'
        """
        if isinstance(d, Device):
            return d
        if not isinstance(d, str):
            raise DeviceError(f"device must be a string like 'cpu' or 'cuda:0', got {d!r}")
        from .backends import names
        s = d.strip().lower()
        kind, _, idx = s.partition(":")
        if kind in names():
            if not idx:
                return Device(kind, 0)
            if idx.isdigit():
                return Device(kind, int(idx))
        known = ", ".join(f"'{n}'" for n in names())
        raise DeviceError(f"unknown device {d!r}; expected one of {known}, optionally with an "
                          "index (e.g. 'cuda:1')")

    def __str__(self) -> str:
        return "cpu" if self.type == "cpu" else f"{self.type}:{self.index}"

    def __repr__(self) -> str:
        return f"Device('{self}')"


CPU = Device("cpu", 0)
