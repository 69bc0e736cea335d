"""Tenant API keys: generate, hash (salted), verify (constant time).

Keys are random high-entropy tokens, so one round of salted SHA-256 is enough
(a slow KDF protects guessable passwords, not 256-bit random strings).
Stored form: ``sha256$<salt hex>$<digest hex>``.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

SCHEME = "sha256"
KEY_PREFIX = "xo-"


def generate_api_key() -> str:
    """A new random API key (~256 bits), e.g. ``xo-3q2...``."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_api_key(key: str) -> str:
    """The salted hash to store for `key`."""
    salt = secrets.token_bytes(16)
    return f"{SCHEME}${salt.hex()}${_digest(salt, key)}"


def verify_api_key(key: str, stored: str) -> bool:
    """True when `key` hashes to `stored`; compares in constant time."""
    try:
        scheme, salt_hex, digest = stored.split("$")
        salt = bytes.fromhex(salt_hex)
    except ValueError:
        return False
    if scheme != SCHEME:
        return False
    return hmac.compare_digest(_digest(salt, key), digest)


def _digest(salt: bytes, key: str) -> str:
    return hashlib.sha256(salt + key.encode("utf-8")).hexdigest()
