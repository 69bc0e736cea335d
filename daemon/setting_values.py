"""Setting values written as text: sizes ("2GiB"), lists of integers ("2,4,8"), loopback hosts."""

from __future__ import annotations

import ipaddress
import re

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from "4096", "512MiB", "2GiB", "1.5GB"; ValueError otherwise.

    >>> parse_size("2gib"), parse_size("1.5gb")
    (2147483648, 1500000000)
    """
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)\s*([a-z]*)", text.replace("_", ""))
    if m is None or m.group(2) not in _UNITS:
        raise ValueError(f"not a size: {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def int_tuple(parts: list[str]) -> tuple[int, ...]:
    """Integers from "2,4,8" split (or a TOML array's items), each a whole number; ValueError
    otherwise."""
    return tuple(int(p.strip()) for p in parts if p.strip())


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def as_text(value: object) -> str:
    """A setting's value as --help shows it.

    >>> as_text(True), as_text((2, 4)), as_text(None), as_text(0.5)
    ('on', '2,4', 'none', '0.5')
    """
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return "none" if value is None else str(value)
