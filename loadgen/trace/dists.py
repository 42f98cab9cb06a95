"""Token-length distributions written as short strings on the command line.

Syntax (integers are token counts; every draw is rounded to an integer and raised to
the distribution's floor, 1 for document and output lengths, 0 for suffix lengths):

  const:N               always N (a bare ``N`` means the same)
  uniform:LO:HI         integers LO..HI inclusive, equally likely
  normal:MEAN:STD       normal, rounded
  lognormal:MEAN:STD    log-normal with this mean and standard deviation of the lengths
                        themselves (not of their logarithm): a long right tail
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

LENGTH_SYNTAX = "const:N | uniform:LO:HI | normal:MEAN:STD | lognormal:MEAN:STD"
_ARITY = {"const": 1, "uniform": 2, "normal": 2, "lognormal": 2}


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A distribution of token lengths; ``params`` as in the module docstring."""

    kind: str
    params: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.kind not in _ARITY:
            raise ValueError(f"unknown length distribution {self.kind!r}; use {LENGTH_SYNTAX}")
        if len(self.params) != _ARITY[self.kind]:
            raise ValueError(f"{self.kind} takes {_ARITY[self.kind]} number(s): {LENGTH_SYNTAX}")
        if any(not math.isfinite(p) or p < 0 for p in self.params):
            raise ValueError(f"{self.spec()}: parameters must be finite and >= 0")
        if self.kind == "uniform" and self.params[0] > self.params[1]:
            raise ValueError(f"{self.spec()}: LO must be <= HI")
        if self.kind == "lognormal" and self.params[0] == 0:
            raise ValueError(f"{self.spec()}: MEAN must be > 0")

    @classmethod
    def parse(cls, text: str) -> "LengthDist":
        parts = text.strip().split(":")
        if len(parts) == 1:
            parts = ["const", parts[0]]
        try:
            params = tuple(float(p) for p in parts[1:])
        except ValueError:
            raise ValueError(f"bad length distribution {text!r}; use {LENGTH_SYNTAX}") from None
        return cls(parts[0].lower(), params)

    def spec(self) -> str:
        return ":".join([self.kind, *(f"{p:g}" for p in self.params)])

    def mean(self) -> float:
        """Mean before rounding and flooring (exact for const and uniform)."""
        if self.kind == "const":
            return self.params[0]
        return (self.params[0] + self.params[1]) / 2 if self.kind == "uniform" else self.params[0]

    def sample(self, rng: np.random.Generator, size: int, floor: int = 1) -> np.ndarray:
        """``size`` lengths as int64, each >= ``floor``."""
        p = self.params
        if self.kind == "const":
            x = np.full(size, p[0])
        elif self.kind == "uniform":
            x = rng.integers(int(round(p[0])), int(round(p[1])) + 1, size=size)
        elif self.kind == "normal":
            x = rng.normal(p[0], p[1], size=size)
        else:
            # Moments of the lengths -> parameters of their logarithm.
            sigma2 = math.log1p((p[1] / p[0]) ** 2)
            x = rng.lognormal(math.log(p[0]) - sigma2 / 2, math.sqrt(sigma2), size=size)
        return np.maximum(np.rint(x).astype(np.int64), floor)
