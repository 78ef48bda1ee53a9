"""The table :class:`LocalShardsWrapper`'s ``__torch_dispatch__`` looks ops up in.

Filled once, at import, by ``wrapper/ops.py`` through :func:`implements`; registering an op
twice is an error. An op with no handler raises ``NotImplementedError`` naming the op and its
argument types. The wrapper imports this module, and the handlers import the wrapper and this module:
no import cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Handler = Callable[[Any, tuple, dict], Any]
_OPS: dict[Any, Handler] = {}


def implements(*ops: Any) -> Callable[[Handler], Handler]:
    """Register ``fn`` as the handler of ``ops``; refuses an op registered twice."""

    def register(fn: Handler) -> Handler:
        for op in ops:
            if op in _OPS:
                raise RuntimeError(f"{op} already has a LocalShardsWrapper handler ({_OPS[op].__name__})")
            _OPS[op] = fn
        return fn

    return register


def dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``func``'s handler (see the module docstring)."""
    handler = _OPS.get(func)
    if handler is None:
        kinds = [type(a).__name__ for a in args]
        raise NotImplementedError(
            f"LocalShardsWrapper does not support {func} (argument types {kinds}); "
            f"supported: {sorted(str(op) for op in _OPS)}"
        )
    return handler(func, args, kwargs)
