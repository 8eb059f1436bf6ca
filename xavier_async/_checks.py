"""The checks every public entry point runs on caller input (pure; one place for each rule).

Integers are real integers, never ``bool``; numpy and torch integer scalars are accepted
and converted (``operator.index``). Failures raise :class:`InvalidRequestError` naming the
argument.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import SupportsIndex, cast

from .errors import InvalidRequestError


def check_int(name: str, value: object, *, minimum: int | None = None,
              maximum: int | None = None) -> int:
    """An integer (not a bool) in ``[minimum, maximum]``; returns it as a plain ``int``."""
    if type(value) is not int:
        if isinstance(value, bool):
            raise InvalidRequestError(f"{name} must be an integer, got {value!r}")
        try:
            value = operator.index(cast(SupportsIndex, value))  # numpy / torch ints
        except TypeError:
            raise InvalidRequestError(f"{name} must be an integer, got {value!r}") from None
    assert isinstance(value, int)
    if minimum is not None and value < minimum:
        raise InvalidRequestError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise InvalidRequestError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_size(name: str, value: object, *, minimum: int = 1) -> int:
    """A byte count or budget: an integer >= ``minimum`` (1 by default)."""
    return check_int(name, value, minimum=minimum)


def check_number(name: str, value: object, *, minimum: float = 0.0,
                 strictly_positive: bool = False) -> float:
    """A real number (int or float, not bool) >= ``minimum`` (> 0 if ``strictly_positive``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}")
    if strictly_positive and value <= 0:
        raise InvalidRequestError(f"{name} must be > 0, got {value!r}")
    if value < minimum:
        raise InvalidRequestError(f"{name} must be a number >= {minimum:g}, got {value!r}")
    return value


def check_bool(name: str, value: object) -> bool:
    """Exactly ``True`` or ``False`` (a truthy string such as ``"no"`` is an error)."""
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be a bool, got {value!r}")
    return value


def cli_int(minimum: int) -> Callable[[str], int]:
    """An ``argparse`` type: an integer >= ``minimum``, with a clear message otherwise."""
    import argparse

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}: {text!r}")
        return value

    return parse
