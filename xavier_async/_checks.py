"""The checks every public entry point runs on caller input (pure; one place for each rule).

Integers are real integers, never ``bool``; numpy and torch integer scalars are accepted
and converted (``operator.index``). Numbers are never NaN, and finite unless a setting
says infinity means something. Environment flags are parsed strictly
(:func:`env_flag`). Failures raise :class:`InvalidRequestError` naming the argument.
"""

from __future__ import annotations

import math
import operator
import os
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
        except Exception:  # not an integer (a user type's __index__ may raise anything)
            raise InvalidRequestError(f"{name} must be an integer, got {value!r}") from None
        if type(value) is not int:  # an int subclass from __index__: a plain int from here on
            value = int(value)
    if minimum is not None and value < minimum:
        raise InvalidRequestError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise InvalidRequestError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_size(name: str, value: object, *, minimum: int = 1) -> int:
    """A byte count or budget: an integer >= ``minimum`` (1 by default)."""
    return check_int(name, value, minimum=minimum)


def check_number(name: str, value: object, *, minimum: float = 0.0,
                 strictly_positive: bool = False, maximum: float | None = None,
                 allow_inf: bool = False) -> float:
    """A real number (int or float, not bool) >= ``minimum`` (> 0 if ``strictly_positive``)
    and <= ``maximum``; returns it as a ``float``.

    NaN is always refused (every comparison with it is false, so a NaN timeout or delay
    silently disables the check it feeds); infinities are refused unless ``allow_inf``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond the float range
        raise InvalidRequestError(f"{name} must be a finite number, got an integer too "
                                  "large for a float") from None
    if math.isnan(number):
        raise InvalidRequestError(f"{name} must be a number, got NaN")
    if math.isinf(number) and not allow_inf:
        raise InvalidRequestError(f"{name} must be a finite number, got {number!r}")
    if strictly_positive and number <= 0:
        raise InvalidRequestError(f"{name} must be > 0, got {value!r}")
    if number < minimum:
        raise InvalidRequestError(f"{name} must be a number >= {minimum:g}, got {value!r}")
    if maximum is not None and number > maximum:
        raise InvalidRequestError(f"{name} must be a number <= {maximum:g}, got {value!r}")
    return number


def check_bool(name: str, value: object) -> bool:
    """Exactly ``True`` or ``False`` (a truthy string such as ``"no"`` is an error)."""
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be a bool, got {value!r}")
    return value


#: the spellings :func:`env_flag` accepts (compared case-insensitively, spaces stripped)
FLAG_TRUE = ("1", "true", "yes", "on")
FLAG_FALSE = ("0", "false", "no", "off", "")


def env_flag(name: str, default: bool = False) -> bool:
    """The boolean environment variable ``name`` (``default`` when it is not set).

    Accepted, in any case: ``1``/``true``/``yes``/``on`` and ``0``/``false``/``no``/``off``
    or empty. Anything else is an error naming the variable, its value and the accepted
    spellings (a typo such as ``ture`` must not silently pick a side)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    word = raw.strip().lower()
    if word in FLAG_TRUE:
        return True
    if word in FLAG_FALSE:
        return False
    raise InvalidRequestError(
        f"environment variable {name}={raw!r} is not a boolean: use one of "
        f"{'/'.join(FLAG_TRUE)} to turn it on, or {'/'.join(FLAG_FALSE[:-1])} or empty to turn "
        "it off (any case)")


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
