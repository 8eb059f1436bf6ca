"""Where the processes of a two-process run go (issue 22, item 7b): ``xavier-async bench
--device cuda`` on a machine with one GPU pinned its peer to ``cuda:1`` and crashed. One
helper, :func:`xavier_async.testing.devices.peer_device`, now decides for the bench, the
demo and the CUDA runs of the NIXL process tests; with one GPU both processes go on
``cuda:0`` and the reports say the GPU time-slices them. No GPU here: the number of GPUs
torch sees is set with ``monkeypatch``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from xavier_async.bench.cli import report_head
from xavier_async.bench.suite import BenchOptions
from xavier_async.testing.devices import SHARED_GPU_NOTE, Placement, gpu_facts, peer_device

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def gpus(monkeypatch):
    """``gpus(n)``: torch sees ``n`` GPUs from now on."""
    def set_count(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    return set_count


def test_two_gpus_one_process_each(gpus):
    for n in (2, 8):
        gpus(n)
        assert peer_device(0) == Placement("cuda:0", False)
        assert peer_device(1, "cuda") == Placement("cuda:1", False)
        assert gpu_facts("cuda") == {"gpu_shared": False}


def test_one_gpu_runs_both_processes_on_it_and_says_so(gpus):
    gpus(1)
    assert peer_device(0, "cuda") == Placement("cuda:0", True)
    device, shared = peer_device(1, "cuda")
    assert (device, shared) == ("cuda:0", True)
    assert gpu_facts("cuda") == {"gpu_shared": True, "note": SHARED_GPU_NOTE}
    assert "time-slices" in SHARED_GPU_NOTE and "not the two-GPU ones" in SHARED_GPU_NOTE


def test_no_gpu_is_a_clear_error_for_cuda_and_nothing_for_the_cpu(gpus):
    gpus(0)
    with pytest.raises(RuntimeError, match="needs a GPU"):
        peer_device(1, "cuda")
    assert peer_device(0, "cpu") == peer_device(1, "cpu") == Placement("cpu", False)
    assert gpu_facts("cpu") == {"gpu_shared": False}


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="processes 0 and 1"):
        peer_device(2, "cpu")
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        peer_device(0, "tpu")


def test_bench_auto_picks_cuda_only_on_a_gpu_pair_and_cuda_is_allowed_on_one(gpus):
    gpus(1)
    assert BenchOptions().resolved_device() == "cpu"            # auto: not on a shared GPU
    assert BenchOptions(device="cuda").resolved_device() == "cuda"  # asked for: shared, noted
    gpus(2)
    assert BenchOptions().resolved_device() == "cuda"


def test_the_bench_report_header_carries_the_note():
    env = {"xavier_async": "0", "transport": "nixl", "device": "cuda", "torch": "2", "nixl": "1",
           "cpus": 16}
    assert "\n" not in report_head(env)
    head = report_head({**env, "gpu_shared": True, "note": SHARED_GPU_NOTE})
    assert head.splitlines()[1] == f"note: {SHARED_GPU_NOTE}"


#: where processes of a run are placed: the harness and the CUDA-gated process tests
PLACING = [*(ROOT / "xavier_async" / "bench").glob("*.py"), *(ROOT / "xavier_async" / "demo").glob("*.py"),
           ROOT / "tests" / "test_nixl_process.py", ROOT / "tests" / "test_concurrency_nixl.py"]


@pytest.mark.parametrize("path", PLACING, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_other_place_pins_a_process_to_the_second_gpu_or_counts_gpus(path):
    """``"cuda:1"`` as a value, or a comparison of ``torch.cuda.device_count()`` with 2,
    is :func:`peer_device`'s decision alone (prose in docstrings may still name cuda:1)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and node.value == "cuda:1":
            found.append(f"{node.lineno}: 'cuda:1'")
        elif isinstance(node, ast.Compare) and "device_count" in ast.unparse(node) \
                and any(isinstance(c, ast.Constant) and c.value == 2 for c in ast.walk(node)):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    assert not found, found
