"""Random values from the sandbox's secure random source (``wasi:random``, through
``os.urandom``).

Generate secrets only when they are absent from what was observed, and read them back
from the observed object ever after: reconcile runs many times.
"""

import os
import secrets

ALPHANUMERIC = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"


def bytes_(n: int) -> bytes:
    """``n`` random bytes."""
    return os.urandom(n)


def alphanumeric(length: int) -> str:
    """A random string of ``length`` characters from ``[A-Za-z0-9]``, each equally likely
    (``secrets.choice`` draws without bias), for passwords."""
    return "".join(secrets.choice(ALPHANUMERIC) for _ in range(length))


def uuid_v4() -> str:
    """A random v4 UUID in its hyphenated lower-case form."""
    b = bytearray(os.urandom(16))
    b[6] = (b[6] & 0x0F) | 0x40  # version 4
    b[8] = (b[8] & 0x3F) | 0x80  # RFC 4122 variant
    h = b.hex()
    return f"{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
