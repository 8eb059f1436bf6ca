"""A griffe extension for the API pages: render the library's reST-flavoured docstrings
as Markdown without touching the source.

- ``:class:`Name``` (and ``:func:``, ``:meth:``, ``:mod:``, ``:attr:``, ``:exc:``) become
  code spans that link to the object when it is documented (optional autorefs: no
  warning, just no link, when it is not);
- ``>>>`` doctest paragraphs become ``pycon`` code blocks;
- a paragraph ending in ``::`` ends in ``:`` (its indented block is already Markdown code);
- a method without a docstring that overrides a documented one (a transport implementing
  :class:`Transport`) shows the base class's docstring.

Configured in mkdocs.yml under the mkdocstrings python handler's ``extensions``.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(class|func|meth|mod|attr|exc|data|obj):`~?([^`<>]+?)`")


def _link(obj: griffe.Object, target: str) -> str:
    text = target.rsplit(".", 1)[-1] if "." in target else target
    shown = f"<code>{text}</code>"
    path = target
    try:
        path = obj.resolve(target.split(".", 1)[0])
        if "." in target:
            path = path + "." + target.split(".", 1)[1]
    except Exception:  # not in scope: try as given (may be fully qualified)
        pass
    return f'<autoref identifier="{path}" optional>{shown}</autoref>'


def _doctest_blocks(text: str) -> str:
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    in_fence = False
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        if not in_fence and line.lstrip().startswith(">>>") and not line.startswith("    "):
            indent = line[: len(line) - len(line.lstrip())]
            block = []
            while i < len(lines) and lines[i].strip():
                block.append(lines[i])
                i += 1
            out.append(f"{indent}```pycon")
            out.extend(block)
            out.append(f"{indent}```")
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


def _convert(obj: griffe.Object, text: str) -> str:
    text = _doctest_blocks(text)
    text = _ROLE.sub(lambda m: _link(obj, m.group(2)), text)
    return re.sub(r"(\S)::\n", r"\1:\n", text)


def _classes(obj: griffe.Object) -> Any:
    for member in obj.members.values():
        if member.is_alias:
            continue
        if member.is_class:
            yield member
        if member.is_module or member.is_class:
            yield from _classes(member)


class RstToMarkdown(griffe.Extension):
    """Rewrite docstrings in place as they are loaded."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:  # noqa: D102
        if obj.docstring is not None:
            obj.docstring.value = _convert(obj, obj.docstring.value)

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:  # noqa: D102
        for cls in _classes(pkg):
            try:
                mro = cls.mro()
            except Exception:  # a base outside the loaded packages
                continue
            for name, member in cls.members.items():
                if member.is_alias or not member.is_function or member.docstring is not None:
                    continue
                for base in mro:
                    inherited = base.members.get(name)
                    if inherited is not None and not inherited.is_alias and inherited.docstring:
                        member.docstring = griffe.Docstring(
                            inherited.docstring.value, parent=member)
                        break
