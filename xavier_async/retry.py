"""Bounded retries with exponential backoff for mapping registration."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ._checks import check_int, check_number


@dataclass(frozen=True)
class RetryPolicy:
    """``attempts`` tries in total; sleeps ``base_delay * multiplier**i`` (capped) between them."""

    attempts: int = 3
    base_delay: float = 0.005
    multiplier: float = 2.0
    max_delay: float = 0.25

    def __post_init__(self) -> None:
        check_int("attempts", self.attempts, minimum=1)
        for name in ("base_delay", "multiplier", "max_delay"):
            check_number(name, getattr(self, name))

    def delays(self) -> Iterator[float]:
        """The sleeps between attempts (``attempts - 1`` of them)."""
        for i in range(self.attempts - 1):
            yield min(self.max_delay, self.base_delay * self.multiplier ** i)
