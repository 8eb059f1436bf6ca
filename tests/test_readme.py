"""The README's example runs (and checks its bytes), and its commands match .ci/run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_readme_example_runs_and_checks_bytes():
    code = re.search(r"```python\n(.*?)```", README, re.S)
    assert code is not None
    assert "assert torch.equal" in code.group(1)
    exec(compile(code.group(1), "README.md", "exec"), {})


def test_readme_starts_with_the_two_commands_and_ci_runs_the_test_command():
    first_block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    assert "xavier-async bench" in first_block and "bash .ci/run" in first_block
    assert README.index("```bash") < README.index("```python")
    ci = (ROOT / ".ci" / "run").read_text()
    assert "torch==2.13.0" in ci and ci.index("torch==2.13.0") < ci.index("-e '.[test")
    test_command = re.search(r"then runs the test command: `([^`]+)`", README.replace("\n", " "))
    assert test_command is not None and test_command.group(1) in ci
