"""What the NIXL transport relies on in NIXL's own behaviour, checked against real NIXL
(two agents in this process, DRAM, UCX), so that a NIXL release that changes it fails
here rather than as wrong notifications in a serving run."""

from __future__ import annotations

import time

import numpy as np
import pytest

nixl_api = pytest.importorskip("nixl._api", reason="NIXL is not installed")


def _drain(agent, until: float) -> list[bytes]:
    """The notifications that arrive until ``until`` (one poll at least)."""
    got: list[bytes] = []
    while True:
        for msgs in agent.get_new_notifs().values():
            got += msgs
        if time.monotonic() >= until:
            return got


def test_an_empty_notification_re_sends_the_handle_s_last_one():
    """``transfer(h, b"")`` on a handle that carried a notification sends that
    notification again (NIXL 1.5.1). So the transport never posts a notifying handle
    without one (transports/nixl_copies.py, "Notifications"; the fake agent of
    tests/fake_nixl.py does the same)."""
    cfg = nixl_api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    a, b = nixl_api.nixl_agent("sem-A", cfg), nixl_api.nixl_agent("sem-B", cfg)
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    a.register_memory(a.get_reg_descs([(src.ctypes.data, src.nbytes, 0, "")], "DRAM"))
    b.register_memory(b.get_reg_descs([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM"))
    a.add_remote_agent(b.get_agent_metadata())
    h = a.initialize_xfer("WRITE", a.get_xfer_descs([(src.ctypes.data, 4096, 0)], "DRAM"),
                          a.get_xfer_descs([(dst.ctypes.data, 4096, 0)], "DRAM"), "sem-B")
    silent = a.initialize_xfer("WRITE", a.get_xfer_descs([(src.ctypes.data, 4096, 0)], "DRAM"),
                               a.get_xfer_descs([(dst.ctypes.data, 4096, 0)], "DRAM"), "sem-B")
    got = []
    for handle, msg in ((h, b"first"), (h, b""), (silent, b"")):
        state = a.transfer(handle, msg)
        deadline = time.monotonic() + 5
        while state == "PROC" and time.monotonic() < deadline:  # both agents progress
            got += _drain(b, 0)
            state = a.check_xfer_state(handle)
        assert state == "DONE"
        got += _drain(b, time.monotonic() + 0.2)
    assert np.array_equal(dst, src)
    # the second post of h had no message and sent "first" again; the fresh handle none
    assert got == [b"first", b"first"]
    for handle in (h, silent):
        a.release_xfer_handle(handle)
