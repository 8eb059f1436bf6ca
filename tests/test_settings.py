"""Bad configuration is refused at construction, before anything starts (issue 21,
finding 4): every float setting refuses NaN and infinities, boolean environment flags are
parsed strictly, a bad host is a typed error, and a port in use is a :class:`ListenError`
that names the host and port with the operating system's error chained."""

from __future__ import annotations

import errno
import math
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
import torch

from xavier_async import (Endpoint, EndpointConfig, InvalidRequestError, ListenError, LocalTransport,
                          RetryPolicy, XavierError)
from xavier_async._checks import check_number, env_flag
from xavier_async.testing import FaultPlan, FaultyTransport

from .conftest import SMALL_CFG, zero_cache

nixl = pytest.importorskip("nixl")

from xavier_async.transports.nixl import INSECURE_ENV, NixlTransport  # noqa: E402

SECRET = "settings-test-secret-0123456789"


def _caches() -> dict[int, torch.Tensor]:
    return {0: zero_cache(8, (256,), torch.float32)}


async def _endpoint_connect(transport: Any, value: float) -> None:
    async with Endpoint(0, _caches(), transport, SMALL_CFG) as ep:
        await ep.connect("127.0.0.1:1" if isinstance(transport, NixlTransport) else "local://0",
                         timeout=value)


async def _transport_connect(transport: Any, value: float) -> None:
    async with Endpoint(0, _caches(), transport, SMALL_CFG):
        await transport.connect("127.0.0.1:1" if isinstance(transport, NixlTransport) else "local://0",
                                value)


#: (the setting's name as the error must say it, how to set it to a value). A call that
#: returns an awaitable is run in an event loop (the per-call connect timeouts).
FLOAT_SETTINGS: list[tuple[str, str, Callable[[float], object]]] = [
    ("EndpointConfig.request_timeout", "request_timeout", lambda v: EndpointConfig(request_timeout=v)),
    *[(f"RetryPolicy.{n}", n, lambda v, n=n: RetryPolicy(**{n: v}))
      for n in ("base_delay", "multiplier", "max_delay")],
    *[(f"NixlTransport.{n}", n, lambda v, n=n: NixlTransport(**{n: v}))
      for n in ("idle_poll", "hot_window", "write_timeout", "handshake_timeout", "spin",
                "first_frame_timeout", "rank_grace", "stall_check")],
    *[(f"FaultPlan.{n}", n, lambda v, n=n: FaultPlan(**{n: v}))
      for n in ("registration_failure_rate", "write_failure_rate", "write_stall_rate",
                "stall_seconds", "corruption_rate")],
    ("FaultyTransport.stall_next_writes", "seconds",
     lambda v: FaultyTransport(LocalTransport()).stall_next_writes(1, v)),
    ("Endpoint.connect(timeout=) local", "timeout", lambda v: _endpoint_connect(LocalTransport(), v)),
    ("Endpoint.connect(timeout=) nixl", "timeout", lambda v: _endpoint_connect(NixlTransport(), v)),
    ("LocalTransport.connect(timeout)", "timeout", lambda v: _transport_connect(LocalTransport(), v)),
    ("NixlTransport.connect(timeout)", "timeout", lambda v: _transport_connect(NixlTransport(), v)),
]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("where, name, set_to", FLOAT_SETTINGS, ids=[w for w, _, _ in FLOAT_SETTINGS])
def test_every_float_setting_refuses_nan_and_infinities(where, name, set_to, value):
    def attempt() -> None:
        out = set_to(value)
        if isinstance(out, Awaitable):
            async def run() -> None:
                await out
            anyio.run(run)

    with pytest.raises(InvalidRequestError, match=rf"\b{name}\b") as info:
        attempt()
    assert "finite" in str(info.value) or "NaN" in str(info.value), info.value


def test_check_number_refuses_nan_always_and_inf_unless_asked():
    with pytest.raises(InvalidRequestError, match="x must be a number, got NaN"):
        check_number("x", math.nan, allow_inf=True)
    assert check_number("x", math.inf, allow_inf=True) == math.inf
    with pytest.raises(InvalidRequestError, match="x must be a finite number"):
        check_number("x", 10 ** 400)                       # beyond the float range
    with pytest.raises(InvalidRequestError, match="<= 1"):
        check_number("x", 1.5, maximum=1.0)
    assert check_number("x", 3) == 3.0 and isinstance(check_number("x", 3), float)


@pytest.mark.parametrize("kwargs", [{"handshake_timeout": 0}, {"write_timeout": 0},
                                    {"first_frame_timeout": 0}, {"trim_handles": 0},
                                    {"trim_handles": 2.5}, {"backends": "UCX"}, {"backends": ()},
                                    {"insecure": "yes"}, {"max_unauthenticated": 0}])
def test_other_bad_transport_settings_are_refused(kwargs):
    with pytest.raises(InvalidRequestError, match=next(iter(kwargs))):
        NixlTransport(**kwargs)


def test_fault_plan_rates_are_probabilities():
    with pytest.raises(InvalidRequestError, match="write_failure_rate"):
        FaultPlan(write_failure_rate=1.5)
    with pytest.raises(InvalidRequestError, match="seed"):
        FaultPlan(seed="7")  # type: ignore[arg-type]


# -- environment flags ----------------------------------------------------------------

@pytest.mark.parametrize("raw", ["0", "false", "FALSE", "No", "off", "", "  no "])
def test_insecure_env_off_spellings_keep_the_secret_requirement(monkeypatch, raw):
    monkeypatch.delenv("XAVIER_ASYNC_SECRET", raising=False)
    monkeypatch.setenv(INSECURE_ENV, raw)
    with pytest.raises(InvalidRequestError, match="without a secret"):
        NixlTransport("0.0.0.0")


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", "Yes", "on"])
def test_insecure_env_on_spellings_allow_listening_without_a_secret(monkeypatch, raw):
    monkeypatch.delenv("XAVIER_ASYNC_SECRET", raising=False)
    monkeypatch.setenv(INSECURE_ENV, raw)
    assert NixlTransport("0.0.0.0").insecure is True


@pytest.mark.parametrize("raw", ["2", "ture", "nope", "y", "insecure", "0.0"])
def test_insecure_env_unknown_values_are_an_error_naming_the_accepted_ones(monkeypatch, raw):
    monkeypatch.setenv(INSECURE_ENV, raw)
    with pytest.raises(InvalidRequestError) as info:
        NixlTransport("127.0.0.1")
    text = str(info.value)
    assert INSECURE_ENV in text and repr(raw) in text
    for word in ("1", "true", "yes", "on", "0", "false", "no", "off", "empty"):
        assert word in text
    NixlTransport("127.0.0.1", insecure=False)            # an explicit argument wins


def test_env_flag(monkeypatch):
    monkeypatch.delenv("XA_TEST_FLAG", raising=False)
    assert env_flag("XA_TEST_FLAG") is False and env_flag("XA_TEST_FLAG", True) is True
    monkeypatch.setenv("XA_TEST_FLAG", "On")
    assert env_flag("XA_TEST_FLAG") is True
    monkeypatch.setenv("XA_TEST_FLAG", "")
    assert env_flag("XA_TEST_FLAG", True) is False
    monkeypatch.setenv("XA_TEST_FLAG", "maybe")
    with pytest.raises(InvalidRequestError, match="XA_TEST_FLAG='maybe'"):
        env_flag("XA_TEST_FLAG")


# -- hosts and ports ------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, name", [
    ({"host": None}, "host"), ({"host": ""}, "host"), ({"host": 127}, "host"),
    ({"host": b"127.0.0.1"}, "host"), ({"host": "[]"}, "host"), ({"host": "local host"}, "host"),
    ({"host": "127.0.0.1\x00"}, "host"),
    ({"advertise": ""}, "advertise"), ({"advertise": 5}, "advertise"),
    ({"advertise": "a\nb"}, "advertise"),
])
def test_a_bad_host_is_a_typed_error(kwargs, name):
    with pytest.raises(InvalidRequestError, match=f"^{name} must be"):
        NixlTransport(**kwargs)


@pytest.mark.asyncio  # real NIXL: asyncio (pytest-asyncio)
async def test_a_port_in_use_is_a_listen_error_naming_host_and_port():
    async with Endpoint(0, _caches(), NixlTransport(), SMALL_CFG) as a:
        port = int(a.address.rpartition(":")[2])
        t = NixlTransport(port=port)
        bad = Endpoint(1, _caches(), t, SMALL_CFG)
        with pytest.raises(ListenError) as info:
            async with bad:
                pytest.fail("a failed start must not run the body")
        err = info.value
        assert isinstance(err, XavierError) and isinstance(err, OSError)
        assert f"127.0.0.1:{port}" in str(err) and "in use" in str(err)
        assert isinstance(err.__cause__, OSError) and err.__cause__.errno == errno.EADDRINUSE
        assert err.errno == errno.EADDRINUSE
        assert t._reg == [] and t._peers == {} and bad.closed  # nothing stays registered
        # the endpoint that holds the port is unaffected, and a free port works
        async with Endpoint(1, _caches(), NixlTransport(), SMALL_CFG) as b:
            assert await b.connect(a.address) == 0


@pytest.mark.asyncio  # real NIXL: asyncio (pytest-asyncio)
async def test_a_host_that_is_not_ours_is_a_listen_error():
    t = NixlTransport(host="192.0.2.1", insecure=True)     # TEST-NET: not an address of ours
    with pytest.raises(ListenError, match=r"192\.0\.2\.1:0") as info:
        async with Endpoint(0, _caches(), t, SMALL_CFG):
            pass
    assert isinstance(info.value.__cause__, OSError)
    assert t._reg == []

