"""A Griffe extension for the documentation site (``mkdocs.yml``): the docstrings' reST markup as Markdown.

The package's docstrings are Google style with a little reST in them - cross-reference roles
(``:func:`full_tensor```, ``:class:`~.reader.ReadStats```), literal-block markers (``Example::``) and
escaped spaces (``LocalShardsWrapper``\\ s) - which mkdocstrings would show as written. Before a
docstring is parsed, a role becomes a code span of its target (the last name only for ``~``), ``::``
closing a line becomes ``:`` (so ``Example::`` opens an examples section) and an escaped space goes.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const|ref):`(~?)([^`<]*?)(?:\s*<([^>]+)>)?`")


def _role(m: re.Match[str]) -> str:
    target = (m[3] or m[2]).strip().lstrip(".")
    return f"`{target.rsplit('.', 1)[-1] if m[1] else target}`"


def markdown(text: str) -> str:
    """``text`` with the reST described above turned into Markdown."""
    text = _ROLE.sub(_role, text)
    text = re.sub(r"::$", ":", text, flags=re.M)
    return text.replace("\\ ", "")


class RstRoles(griffe.Extension):
    """Rewrites every docstring once the object tree is built (see the module docstring)."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
