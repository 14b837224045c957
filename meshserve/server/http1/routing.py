"""Path templates compiled once, matched per request: the dispatch of an HTTP route table.

A template is segments separated by "/": a literal, a ``{name}`` placeholder (one non-empty
segment) or an optional group ``[/...]`` (no nesting), e.g. ``/v2/models/{m}[/versions/{v}]/ready``.
Each template is expanded into its variants (with and without each group) at start; a path
(its query dropped, leading and trailing slashes stripped, each segment percent-decoded) is
matched against the variants of its segment count, the ones with more literal segments first
(``/v2/models/stats`` before ``/v2/models/{m}``), then in table order.

The rows are ``(method, template, op, handler)``: `Router` resolves each handler name on the
object that answers (``getattr(target, handler)``), so a route is one row plus its handler.
"""
from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import unquote

_GROUP = re.compile(r"\[([^\[\]]*)\]")


class Route:
    """One row of the table, its handler bound. ``checked``: whether the front end asks the
    core about the row's op before the handler runs (set by the front end; True by default)."""

    __slots__ = ("method", "template", "op", "handler", "checked")

    def __init__(self, method: str, template: str, op: Any, handler: Callable[..., Any]) -> None:
        self.method = method
        self.template = template
        self.op = op
        self.handler = handler
        self.checked = True


class Match:
    """A path's routes (by method) and the values of its template's placeholders; every
    placeholder of the template is a key ("" for one in an optional group the path left out)."""

    __slots__ = ("methods", "params", "template")

    def __init__(self, methods: dict[str, Route], params: dict[str, str], template: str) -> None:
        self.methods = methods
        self.params = params
        self.template = template

    def allowed(self) -> str:
        return " or ".join(self.methods)


def variants(template: str) -> list[list[str]]:
    """The template's segment lists, one per choice of its optional groups."""
    groups = _GROUP.findall(template)
    pieces = _GROUP.split(template)  # literal text and group bodies alternate
    out = []
    for keep in itertools.product((True, False), repeat=len(groups)):
        text = "".join(p if i % 2 == 0 else (p if keep[i // 2] else "") for i, p in enumerate(pieces))
        out.append(text.strip("/").split("/") if text.strip("/") else [])
    return out


def _names(template: str) -> list[str]:
    return re.findall(r"\{(\w+)\}", template)


class Router:
    """A route table compiled for matching (see the module docstring)."""

    def __init__(self, rows: Iterable[tuple[str, str, Any, str]], target: Any) -> None:
        self.routes: list[Route] = []
        by_template: dict[str, dict[str, Route]] = {}
        for method, template, op, handler in rows:
            route = Route(method, template, op, getattr(target, handler))
            self.routes.append(route)
            methods = by_template.setdefault(template, {})
            if method in methods:
                raise ValueError(f"route {method} {template} declared twice")
            methods[method] = route
        # segment count -> [(segments: a literal, or None for a placeholder), placeholder
        # positions and names, the template's methods, its placeholder names, the template)]
        self._by_length: dict[int, list[tuple[tuple[str | None, ...], tuple[tuple[int, str], ...],
                                            dict[str, Route], tuple[str, ...], str]]] = {}
        ranked = []
        for order, (template, methods) in enumerate(by_template.items()):
            names = tuple(_names(template))
            for segments in variants(template):
                pattern = tuple(None if s.startswith("{") else s for s in segments)
                holes = tuple((i, s[1:-1]) for i, s in enumerate(segments) if s.startswith("{"))
                literals = sum(s is not None for s in pattern)
                ranked.append((-literals, order, (pattern, holes, methods, names, template)))
        for _, _, entry in sorted(ranked, key=lambda r: r[:2]):
            self._by_length.setdefault(len(entry[0]), []).append(entry)

    def match(self, raw_path: str) -> Match | None:
        """The routes of the path of ``raw_path`` (a request target, query included), None
        when no template matches it."""
        path = raw_path.split("?", 1)[0].strip("/")
        parts = [unquote(p) for p in path.split("/")] if path else []
        for pattern, holes, methods, names, template in self._by_length.get(len(parts), ()):
            if all(lit is None or lit == part for lit, part in zip(pattern, parts, strict=True)) \
                    and all(parts[i] for i, _ in holes):
                params = dict.fromkeys(names, "")
                for i, name in holes:
                    params[name] = parts[i]
                return Match(methods, params, template)
        return None
