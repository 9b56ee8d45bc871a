"""Name -> function registries, so configs can pick algorithms by string."""

from __future__ import annotations

from typing import Callable


class Registry:
    """Maps names (and aliases) to functions of one kind, e.g. "policy loss"."""

    def __init__(self, kind: str):
        self.kind = kind
        self._fns: dict[str, Callable] = {}

    def register(self, name: str, *aliases: str) -> Callable[[Callable], Callable]:
        """Decorator registering ``fn`` under ``name`` and each alias; returns ``fn`` unchanged."""

        def decorator(fn: Callable) -> Callable:
            for key in (name, *aliases):
                # Re-registering the same function is harmless (module reloads); a different one is a clash.
                if self._fns.get(key, fn) is not fn:
                    raise ValueError(f"{self.kind} {key!r} is already registered to {self._fns[key].__qualname__}")
            for key in (name, *aliases):
                self._fns[key] = fn
            return fn

        return decorator

    def get(self, name: str) -> Callable:
        try:
            return self._fns[name]
        except (KeyError, TypeError):
            raise ValueError(f"Unknown {self.kind} {name!r}. Valid: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        return sorted(self._fns)

    def __contains__(self, name: object) -> bool:
        return name in self._fns

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self.names())})"
