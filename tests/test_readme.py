"""The README's examples run (and check their bytes), and its commands match .ci/run."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


def test_readme_example_runs_and_checks_bytes():
    code = re.search(r"```python\n(.*?)```", README, re.S)
    assert code is not None
    assert "assert torch.equal" in code.group(1)
    exec(compile(code.group(1), "README.md", "exec"), {})


def test_readme_two_process_example_is_the_example_file_and_runs_over_nixl():
    """The README's second example is examples/two_processes.py verbatim, and it runs: two OS
    processes (spawn), the address passed over a pipe, a load over real NIXL, every layer's
    bytes compared (the script exits non-zero otherwise)."""
    example = ROOT / "examples" / "two_processes.py"
    assert len(PYTHON_BLOCKS) == 2, "the README has two Python examples, both run here"
    assert PYTHON_BLOCKS[1] == example.read_text(), "README differs from examples/two_processes.py"
    assert "assert torch.equal" in PYTHON_BLOCKS[1] and 'get_context("spawn")' in PYTHON_BLOCKS[1]
    if importlib.util.find_spec("nixl") is None:
        pytest.skip("nixl not installed")
    proc = subprocess.run([sys.executable, str(example)], cwd=ROOT, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "loaded 4 blocks from another process over NIXL (16384 B)" in proc.stdout


def test_readme_starts_with_the_two_commands_and_ci_runs_the_test_command():
    first_block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    assert "xavier-async bench" in first_block and "bash .ci/run" in first_block
    assert README.index("```bash") < README.index("```python")
    ci = (ROOT / ".ci" / "run").read_text()
    assert "torch==2.13.0" in ci and ci.index("torch==2.13.0") < ci.index("-e '.[test")
    test_command = re.search(r"then runs the test command: `([^`]+)`", README.replace("\n", " "))
    assert test_command is not None and test_command.group(1) in ci
