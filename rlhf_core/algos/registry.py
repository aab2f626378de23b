"""`Registry`: the name -> function table behind ADVANTAGE_ESTIMATORS, KL_ESTIMATORS,
POLICY_LOSSES and the policy algorithms, whose unknown-name error lists the valid names (verl's
`core_algos` registers its estimators the same way)."""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


class Registry(dict):
    """A name -> function table; looking up an unknown name raises KeyError listing valid ones."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def __missing__(self, name: str):
        raise KeyError(f"unknown {self.kind} {name!r}; valid names: {', '.join(sorted(self))}")

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator adding a function under `name`; registering a name twice is an error."""

        def add(fn: F) -> F:
            if name in self:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self[name] = fn
            return fn

        return add
