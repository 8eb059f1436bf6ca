"""The package is typed (py.typed): mypy must accept it, and the public entry points must
accept what users pass (e.g. ``dict[int, Tensor]`` caches)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

USER_CODE = '''
import torch
from xavier_async import (ALL_LAYERS, ChannelPolicy, Endpoint, EndpointConfig, LocalFabric,
                          NixlTransport, RetryPolicy, Transport)
from xavier_async.testing import FaultPlan, FaultyTransport

async def main() -> None:
    caches: dict[int, torch.Tensor] = {0: torch.zeros(4, 8)}
    named: dict[str, torch.Tensor] = {"k0": torch.zeros(4, 8)}
    cfg = EndpointConfig(full_bytes=1 << 20, small_bytes=1 << 16, retry=RetryPolicy(attempts=2))
    fabric = LocalFabric()
    async with Endpoint(0, caches, fabric.transport(), cfg) as a, Endpoint(1, named, fabric.transport()) as b:
        await a.connect(b.address)
        b.publish("key", 1)
        result = await a.load({1: {0: {"key": 2}}})
        n: int = result.wire_bytes + ChannelPolicy(16, 4).select(3)
        await a.load({1: {ALL_LAYERS: {"key": 3}}})
        await a.disconnect(1)
        assert await a.connect(b.address, timeout=5.0) == 1
    faulty: Transport = FaultyTransport(fabric.transport(), FaultPlan(seed=1))
    nixl: Transport = NixlTransport(host="127.0.0.1", port=0)  # the top-level, lazy import
'''


def test_mypy_accepts_the_package_and_typical_user_code(tmp_path):
    pytest.importorskip("mypy")
    user = tmp_path / "user_code.py"
    user.write_text(USER_CODE)
    # pyproject.toml's [tool.mypy] makes this strict, for the package and the user code
    assert "strict = true" in (ROOT / "pyproject.toml").read_text().split("[tool.mypy]")[1]
    proc = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"),
                           "xavier_async", str(user)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_nixl_transport_is_importable_from_the_package_and_imported_lazily():
    """`from xavier_async import NixlTransport` is the class in xavier_async.transports.nixl,
    and a plain `import xavier_async` loads neither that module nor nixl."""
    code = (
        "import sys, xavier_async\n"
        "loaded = sorted(m for m in sys.modules if m == 'nixl' or m.startswith(('nixl.', 'xavier_async.transports.nixl')))\n"
        "assert not loaded, loaded\n"
        "from xavier_async import NixlTransport\n"
        "from xavier_async.transports.nixl import NixlTransport as direct\n"
        "assert NixlTransport is direct and 'NixlTransport' in xavier_async.__all__\n"
        "try:\n"
        "    xavier_async.NoSuchThing\n"
        "except AttributeError as exc:\n"
        "    assert 'NoSuchThing' in str(exc)\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
