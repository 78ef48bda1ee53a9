"""The table :class:`LocalShardsWrapper`'s ``__torch_dispatch__`` looks ops up in.

Filled once, at import, by ``wrapper/ops.py``, ``wrapper/elementwise.py`` and ``wrapper/reductions.py``:

1. :func:`implements` registers a handler for named ops; registering an op twice is an error.
2. :func:`implements_family` registers a handler for every op a predicate accepts (every op tagged
   ``torch.Tag.pointwise``, every ``_foreach_*`` op, every op drawing random numbers): the families are
   tried in registration order the first time an op without a named handler is seen, and the answer is
   kept, so each op is resolved once.

An op with no handler raises ``NotImplementedError`` naming the op and its argument types. The wrapper
imports this module, and the handlers import the wrapper and this module: no import cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Handler = Callable[[Any, tuple, dict], Any]
Predicate = Callable[[Any], bool]
_OPS: dict[Any, Handler] = {}
_FAMILIES: list[tuple[str, Predicate, Handler]] = []
_RESOLVED: dict[Any, Handler | None] = {}


def implements(*ops: Any) -> Callable[[Handler], Handler]:
    """Register ``fn`` as the handler of ``ops``; refuses an op registered twice."""

    def register(fn: Handler) -> Handler:
        for op in ops:
            if op in _OPS:
                raise RuntimeError(f"{op} already has a LocalShardsWrapper handler ({_OPS[op].__name__})")
            _OPS[op] = fn
        _RESOLVED.clear()
        return fn

    return register


def implements_family(name: str, accepts: Predicate) -> Callable[[Handler], Handler]:
    """Register ``fn`` for every op ``accepts(op)`` is true of (and no named handler claims);
    refuses a family name registered twice."""

    def register(fn: Handler) -> Handler:
        if any(n == name for n, _, _ in _FAMILIES):
            raise RuntimeError(f"the op family {name!r} already has a LocalShardsWrapper handler")
        _FAMILIES.append((name, accepts, fn))
        _RESOLVED.clear()
        return fn

    return register


def handler_of(func: Any) -> Handler | None:
    """The handler ``func`` dispatches to (``None``: unsupported)."""
    try:
        return _RESOLVED[func]
    except KeyError:
        pass
    handler = _OPS.get(func)
    if handler is None:
        handler = next((fn for _, accepts, fn in _FAMILIES if accepts(func)), None)
    _RESOLVED[func] = handler
    return handler


def dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``func``'s handler (see the module docstring)."""
    handler = handler_of(func)
    if handler is None:
        kinds = [type(a).__name__ for a in args]
        raise NotImplementedError(
            f"LocalShardsWrapper does not support {func} (argument types {kinds}): it is neither one of the "
            f"ops handled by name ({len(_OPS)}) nor of the families {[n for n, _, _ in _FAMILIES]}"
        )
    return handler(func, args, kwargs)
