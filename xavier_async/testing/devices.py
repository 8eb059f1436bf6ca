"""Which device each process of a two-process run uses: the bench, the demo, and the NIXL
process tests with ``XAVIER_TEST_DEVICE=cuda``.

Those runs are built for one process per GPU: process 0 (this one: the loader, the
sender, replica A) on GPU 0, process 1 (the peer: the source or sources, the receiver,
replica B) on GPU 1. A machine with one GPU runs both on GPU 0: NIXL copies between them
still (CUDA IPC within one device), but the GPU time-slices the two processes, so what
is measured there is not what the GPU pair does. :func:`peer_device` is the one place
that decides; whatever reports figures says so when ``shared`` is true
(:data:`SHARED_GPU_NOTE`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

#: what a report says when one GPU runs both processes
SHARED_GPU_NOTE = ("one GPU time-slices both processes (cuda:0): these figures are not the "
                   "two-GPU ones, which run one process per GPU")


class Placement(NamedTuple):
    """Where one process of a two-process run goes."""

    #: the torch device string: ``"cpu"``, ``"cuda:0"`` or ``"cuda:1"``
    device: str
    #: one GPU holds both processes (it time-slices them)
    shared: bool


def peer_device(index: int, device: str = "cuda") -> Placement:
    """The device of process ``index`` (0: this one, 1: its peer) of a run on ``device``
    (``"cpu"`` or ``"cuda"``): ``cuda:<index>`` when two GPUs are visible, ``cuda:0`` with
    ``shared=True`` when only one is; ``("cpu", False)`` on the CPU. A CUDA run with no
    GPU visible is a :class:`RuntimeError` that says so."""
    if index not in (0, 1):
        raise ValueError(f"a two-process run has processes 0 and 1, not {index!r}")
    if device == "cpu":
        return Placement("cpu", False)
    if device != "cuda":
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    gpus = torch.cuda.device_count()
    if gpus < 1:
        raise RuntimeError("a CUDA run needs a GPU, and none is visible to torch "
                           "(check CUDA_VISIBLE_DEVICES, or run on the CPU)")
    if gpus == 1:
        return Placement("cuda:0", True)
    return Placement(f"cuda:{index}", False)


def gpu_facts(device: str) -> dict[str, object]:
    """What a report of a two-process run on ``device`` says about its GPUs:
    ``{"gpu_shared": bool}``, plus ``"note"`` (:data:`SHARED_GPU_NOTE`) when one GPU holds
    both processes."""
    shared = peer_device(1, device).shared
    return {"gpu_shared": True, "note": SHARED_GPU_NOTE} if shared else {"gpu_shared": False}
