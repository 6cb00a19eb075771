"""A bounded YAML reader for config files and `--set` values.

PyYAML's safe loader still expands aliases (a few hundred bytes can expand to gigabytes),
recurses once per nesting level (deep input ends in RecursionError), silently keeps the
last of two equal keys and hands integers of any length to int(). A config is a small
tree of scalars written by hand, so this loader refuses all of that: no aliases, at most
MAX_DEPTH levels, no duplicate keys, integers of at most MAX_INT_DIGITS digits. Every
refusal is a `YamlRefused` naming the line; `config.py` turns it into a ConfigError.
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_DEPTH = 32  # the config is two levels deep; lists of rank ranges add one or two
MAX_INT_DIGITS = 32


class YamlRefused(ValueError):
    """The text is not YAML a config may hold; the message names the problem and line."""


def _line(node_or_event: Any) -> str:
    mark = getattr(node_or_event, "start_mark", None)
    return f" at line {mark.line + 1}" if mark is not None else ""


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader without aliases, with a depth cap, duplicate-key and long-integer refusal."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def _here(self) -> str:
        return _line(self.peek_event())  # type: ignore[no-untyped-call]

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            raise YamlRefused(f"aliases (*name) are not allowed{self._here()}")
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise YamlRefused(f"nested deeper than {MAX_DEPTH} levels{self._here()}")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:
                raise YamlRefused(f"a key that is not a plain value{_line(key_node)}") from None
            if duplicate:
                raise YamlRefused(f"duplicate key {key!r}{_line(key_node)}")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _bounded_int(loader: yaml.SafeLoader, node: Any) -> Any:
    text = str(node.value).replace("_", "")
    digits = sum(ch.isdigit() for ch in text)
    if digits > MAX_INT_DIGITS:
        raise YamlRefused(f"an integer of {digits} digits (at most {MAX_INT_DIGITS}){_line(node)}")
    return yaml.SafeLoader.construct_yaml_int(loader, node)


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _bounded_int)


def load(text: str) -> Any:
    """The value of a YAML document, or YamlRefused; yaml.YAMLError for a syntax error."""
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    except RecursionError:
        raise YamlRefused(f"nested deeper than {MAX_DEPTH} levels") from None
    finally:
        loader.dispose()
