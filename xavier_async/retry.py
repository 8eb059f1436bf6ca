"""Bounded retries with exponential backoff for mapping registration."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from .errors import InvalidRequestError


@dataclass(frozen=True)
class RetryPolicy:
    """``attempts`` tries in total; sleeps ``base_delay * multiplier**i`` (capped) between them."""

    attempts: int = 3
    base_delay: float = 0.005
    multiplier: float = 2.0
    max_delay: float = 0.25

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise InvalidRequestError(f"attempts must be an integer >= 1, got {self.attempts!r}")
        for name in ("base_delay", "multiplier", "max_delay"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise InvalidRequestError(f"{name} must be a number >= 0, got {value!r}")

    def delays(self) -> Iterator[float]:
        """The sleeps between attempts (``attempts - 1`` of them)."""
        for i in range(self.attempts - 1):
            yield min(self.max_delay, self.base_delay * self.multiplier ** i)
