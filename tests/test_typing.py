"""The package is typed (py.typed): mypy must accept it, and the public entry points must
accept what users pass (e.g. ``dict[int, Tensor]`` caches)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

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


# -- optional imports: a plain `pip install -e '.[test]'` lacks the extras ------------------
def _toml(path: Path) -> dict[str, Any]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    data: dict[str, Any] = tomllib.loads(path.read_text())
    return data


def _optional_imports() -> dict[str, list[str]]:
    """The package's imports of third-party modules that are not required dependencies
    (those of the extras, and what comes with them): top-level module -> the import
    statements, as written, that name it."""
    project = _toml(ROOT / "pyproject.toml")["project"]
    required = {re.match(r"[A-Za-z0-9_.\-]+", d).group().lower().replace("-", "_")  # type: ignore[union-attr]
                for d in project["dependencies"]}
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "xavier_async").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in required or top == "xavier_async":
                    continue
                found.setdefault(top, []).append(ast.unparse(node))
    return found


def test_every_optional_import_is_listed_for_mypy_as_maybe_missing():
    """Each optional import of the package matches a ``[[tool.mypy.overrides]]`` module
    pattern with ``ignore_missing_imports``, so the strict check does not depend on which
    extras are installed (``bench/_xoscar_peer.py`` imports ``uvloop``, which only the
    xoscar extra brings)."""
    overrides = _toml(ROOT / "pyproject.toml")["tool"]["mypy"]["overrides"]
    patterns = [m for o in overrides if o.get("ignore_missing_imports")
                for m in ([o["module"]] if isinstance(o["module"], str) else o["module"])]

    def covered(module: str) -> bool:
        return any(p == module or (p.endswith(".*") and (module == p[:-2] or module.startswith(p[:-1])))
                   for p in patterns)

    optional = _optional_imports()
    assert {"uvloop", "xoscar", "matplotlib", "rich"} <= optional.keys()  # the reader works
    assert not [m for m in optional if not covered(m)], patterns


def test_mypy_accepts_the_optional_imports_when_they_are_not_installed(tmp_path):
    """The same import statements, checked under the project's mypy config with no
    installed package visible (``--no-site-packages``: uvloop, xoscar and the rest are
    missing, as after ``pip install -e '.[test]'``)."""
    pytest.importorskip("mypy")
    probe = tmp_path / "optional_imports.py"
    lines = sorted({line for stmts in _optional_imports().values() for line in stmts})
    probe.write_text("\n".join(lines) + "\n")
    proc = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                           "--no-site-packages", "--cache-dir", str(tmp_path / "cache"), str(probe)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert "import uvloop" in lines
    assert proc.returncode == 0, probe.read_text() + proc.stdout + proc.stderr
