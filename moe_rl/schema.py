"""Typed configs from plain YAML data: frozen dataclass trees built with every key and type checked,
and errors that name the field path (`ConfigError`, one line). The schema itself is the moe_rl.config
package: RunConfig and its sections (config/run.py, config/learning.py).

    cfg = build(RunConfig, read_yaml(path), "", removed={})   # unknown keys: did-you-mean
    check_tree(cfg)                                           # every section's check()

YAML itself is read strictly: a key repeated within one mapping is refused (plain YAML silently keeps
the last).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")



class ConfigError(ValueError):
    """A configuration the user must fix. `str(err)` is one actionable line."""

    def __init__(self, path: str, message: str):
        self.path = path
        super().__init__(f"{path}: {message}" if path else message)



class ConfigWarning(UserWarning):
    """A setting accepted, but without effect for a reason the user may not have meant (one line; the CLI
    prints it as `moe-rl: warning: ...`)."""


def positive(path: str, value: int) -> None:
    if value <= 0:
        raise ConfigError(path, f"{value} must be a positive integer")


def in_range(path, value, lo, hi, lo_open=False, hi_open=False) -> None:
    ok = (lo is None or (value > lo if lo_open else value >= lo)) and (
        hi is None or (value < hi if hi_open else value <= hi))
    if not ok:
        lo_s = "-inf" if lo is None else str(lo)
        hi_s = "inf" if hi is None else str(hi)
        interval = (f"{'(' if lo_open or lo is None else '['}{lo_s}, "
                    f"{hi_s}{')' if hi_open or hi is None else ']'}")
        raise ConfigError(path, f"{value} is outside the allowed range {interval}")



def did_you_mean(word: str, options) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""



def build(cls, data: Any, path: str, removed: dict[str, str]):
    """Build dataclass `cls` from plain YAML data, checking keys and types; no defaults are guessed."""
    if not isinstance(data, dict):
        raise ConfigError(path or "<root>",
                          f"expected a mapping of {cls.__name__} fields, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        sub = f"{path}.{key}" if path else str(key)
        if key not in fields:
            hint = f" ({removed[sub]})" if sub in removed else did_you_mean(str(key), fields)
            raise ConfigError(sub, f"unknown key{hint}; allowed: "
                                   f"{', '.join(fields) or f'none ({path} takes no keys)'}")
        kwargs[key] = coerce(hints[key], value, sub, removed)
    return cls(**kwargs)


def coerce(tp, value: Any, path: str, removed: dict[str, str] | None = None):
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return build(tp, value if value is not None else {}, path, removed or {})
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(arg, value, path, removed)
            except ConfigError as err:
                errors.append(err)
        raise errors[0] if len(errors) == 1 else ConfigError(path, f"{value!r} is not a {type_name(tp)}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(path, f"{value!r} is not allowed{did_you_mean(str(value), map(str, allowed))}; "
                                    f"choose one of {', '.join(map(str, allowed))}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping, got {value!r}")
        return dict(value)
    if tp is list or origin is list:
        if not isinstance(value, list):
            raise ConfigError(path, f"expected a list, got {value!r} ({type(value).__name__})")
        args = typing.get_args(tp)
        return [coerce(args[0], v, f"{path}[{i}]", removed) for i, v in enumerate(value)] if args \
            else list(value)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
            return float(value)  # YAML 1.1 reads "1e-3" (no dot) as a string
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(path, f"expected {type_name(tp)}, got {value!r} ({type(value).__name__})")


def type_name(tp) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else type_name(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def set_dotted(data: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for i, key in enumerate(keys[:-1]):
        nxt = node.setdefault(key, {})
        if not isinstance(nxt, dict):
            raise ConfigError(".".join(keys[: i + 1]), f"is a value, not a section; cannot set '{dotted}'")
        node = nxt
    node[keys[-1]] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    out = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError("", f"override '{item}' must look like section.key=value")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        out.append((key, value))
    return out


def check_tree(cfg) -> None:
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            check_tree(value)
    check = getattr(cfg, "check", None)
    if check is not None:
        check()




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


def read_yaml(path: str | Path) -> dict:
    """A YAML config file as plain data; a missing file, invalid YAML or a repeated key is a ConfigError."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError("", f"config file '{path}' is a directory; give a YAML file, e.g. "
                              "configs/quickstart.yaml")
    if not path.is_file():
        raise ConfigError("", f"config file '{path}' does not exist")
    try:
        data = load_unique_keys(path.read_text())
        if not data:  # nothing, or `{}`: every default, which is rarely what was meant
            raise ConfigError("", f"config file '{path}' is empty; to run with every default, say so with "
                              "one line such as `run: {}`")
        return data
    except DuplicateKey as dup:
        raise ConfigError(dup.path, f"appears twice in '{path}' (lines {dup.first} and {dup.second}); YAML "
                          "would keep only the last, silently: keep one") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError("", f"'{path}' is not valid YAML{where}: {getattr(err, 'problem', err)}") from None
