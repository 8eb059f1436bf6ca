"""NIXL's own logs in a user's program (issue 22, item 7c): an endpoint pair over real
NIXL prints no NIXL INFO line by default, on stdout (where NIXL's own handler prints) or
stderr; the application's logging config, or ``NIXL_LOG_LEVEL``, shows them.

Each case runs a fresh Python process, since NIXL configures its logger once per process
when its package is imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nixl")

ROOT = Path(__file__).resolve().parent.parent

#: a user's program: (optionally) its logging config, then two endpoints over NIXL that
#: connect and load one block
PROGRAM = """
import logging, sys
if sys.argv[1] == "logging":
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
import anyio, torch
from xavier_async import Endpoint, EndpointConfig, NixlTransport

async def main():
    cfg = EndpointConfig(full_bytes=1 << 16, small_bytes=1 << 12)
    async with Endpoint(0, {0: torch.zeros(8, 256)}, NixlTransport(), cfg) as a, \\
            Endpoint(1, {0: torch.ones(8, 256)}, NixlTransport(), cfg) as b:
        await a.connect(b.address)
        b.publish("k", 1)
        await a.load({1: {0: {"k": 2}}})
        assert bool((a.caches[0][2] == 1).all())
    print("loaded")

anyio.run(main)
"""

#: what NIXL's Python package logs at INFO when an agent starts
AGENT_STARTED = "Initialized NIXL agent"


def _run(mode: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k not in ("NIXL_LOG_LEVEL", "UCX_LOG_LEVEL")}
    environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), environ.get("PYTHONPATH", "")])
    environ.update(env)
    proc = subprocess.run([sys.executable, "-c", PROGRAM, mode], cwd=ROOT, env=environ,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "loaded" in proc.stdout, proc.stdout + proc.stderr
    return proc


def test_an_endpoint_pair_prints_no_nixl_info_line_by_default():
    proc = _run("plain")
    for stream, text in (("stdout", proc.stdout), ("stderr", proc.stderr)):
        assert "NIXL INFO" not in text and AGENT_STARTED not in text, f"{stream}:\n{text}"
    assert proc.stdout.strip() == "loaded" and proc.stderr.strip() == "", proc.stdout + proc.stderr


def test_the_applications_logging_config_shows_nixls_info_lines():
    """NIXL's records reach the application's handlers (here basicConfig's, on stderr)."""
    proc = _run("logging")
    agents = [line for line in proc.stderr.splitlines()
              if line.startswith("nixl.") and AGENT_STARTED in line]
    assert len(agents) == 2, proc.stderr          # one per endpoint, formatted by the app
    assert "NIXL INFO" not in proc.stdout, proc.stdout  # and not by NIXL's own handler


def test_nixl_log_level_in_the_environment_keeps_nixls_own_logging():
    proc = _run("plain", NIXL_LOG_LEVEL="INFO")
    agents = [line for line in proc.stdout.splitlines()
              if "NIXL INFO" in line and AGENT_STARTED in line]
    assert len(agents) == 2, proc.stdout
