"""YAML that refuses a key repeated within one mapping (plain YAML silently keeps the last).

    data = load_unique_keys(text)   # raises DuplicateKey(path, first_line, second_line)
"""

from __future__ import annotations

import yaml


class DuplicateKey(ValueError):
    """`path` (dotted, e.g. run.steps) appears at `first` and again at `second` (1-based lines)."""

    def __init__(self, path: str, first: int, second: int):
        super().__init__(f"{path}: lines {first} and {second}")
        self.path, self.first, self.second = path, first, second


class _UniqueKeyLoader(yaml.SafeLoader):
    def get_single_data(self):
        node = self.get_single_node()
        if node is None:
            return None
        _check_unique_keys(node, "", set())
        return self.construct_document(node)


def load_unique_keys(text: str):
    """yaml.safe_load, except that a repeated mapping key raises DuplicateKey."""
    return yaml.load(text, Loader=_UniqueKeyLoader)


def _check_unique_keys(node, path: str, seen: set[int]) -> None:
    if id(node) in seen:  # an alias of a node already walked
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        lines: dict[tuple[str, str], int] = {}
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                sub = f"{path}.{key_node.value}" if path else str(key_node.value)
                line = key_node.start_mark.line + 1
                key = (key_node.tag, key_node.value)
                if key in lines:
                    raise DuplicateKey(sub, lines[key], line)
                lines[key] = line
                _check_unique_keys(value_node, sub, seen)
            else:
                _check_unique_keys(value_node, path, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_unique_keys(item, f"{path}[{i}]", seen)
