"""A tiny pure-Python wheel made on the spot, so tests can `pip install` without a network."""

from __future__ import annotations

import base64
import hashlib
import os
import zipfile

PACKAGE = "rpvenvprobe"
"""The wheel's one module; it only holds VALUE = 42."""


def make_wheel(folder: str) -> str:
    """A tiny pure-Python wheel, so `pip install` works offline."""
    files = {
        f"{PACKAGE}/__init__.py": b"VALUE = 42\n",
        f"{PACKAGE}-1.0.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: 1.0\n".encode(),
        f"{PACKAGE}-1.0.dist-info/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = [
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}"
        for path, data in files.items()
    ]
    record.append(f"{PACKAGE}-1.0.dist-info/RECORD,,")
    files[f"{PACKAGE}-1.0.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    path = os.path.join(folder, f"{PACKAGE}-1.0-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
    return path
