"""The config's description, read from the one place it is written: each section's class docstring and
each field's docstring (the string under the field in config/run.py and config/learning.py), with the field's
type and default.

    explain("rollout.temperature")  # `moe-rl config explain rollout.temperature`
    markdown()                      # docs/config.md (moe-rl config docs; a test keeps it current)
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from dataclasses import dataclass

from moe_rl.config import RunConfig
from moe_rl.schema import ConfigError, did_you_mean


@dataclass(frozen=True)
class FieldDoc:
    path: str  # section.field, e.g. rollout.temperature; model.tiny.top_k
    type: str
    default: str  # as YAML writes it
    doc: str


def field_docstrings(cls: type) -> dict[str, str]:
    """The docstrings of a dataclass's fields, by name: the string statement right under each field."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return {a.target.id: inspect.cleandoc(b.value.value) for a, b in zip(body, body[1:], strict=False)
            if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr)
            and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)}


def type_name(tp) -> str:
    """A field's type as a user writes its value: int, float | null, one of 'a', 'b', ..."""
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join("null" if a is type(None) else type_name(a) for a in typing.get_args(tp))
    if origin is dict:
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _default(f: dataclasses.Field) -> str:
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else \
        f'"{value}"' if isinstance(value, str) else str(value)


def sections(cls: type = RunConfig, prefix: str = "") -> dict[str, type]:
    """Every section of the config by path (model, model.tiny, ...), in the config's order."""
    out = {}
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            out[prefix + f.name] = tp
            out |= sections(tp, f"{prefix}{f.name}.")
    return out


def fields() -> list[FieldDoc]:
    """Every setting (a leaf of the config), section by section, in the order the classes declare them."""
    out = []
    for path, cls in sections().items():
        hints, docs = typing.get_type_hints(cls), field_docstrings(cls)
        out += [FieldDoc(f"{path}.{f.name}", type_name(hints[f.name]), _default(f), docs.get(f.name, ""))
                for f in dataclasses.fields(cls) if not dataclasses.is_dataclass(hints[f.name])]
    return out


def _section_doc(cls: type) -> str:
    return inspect.cleandoc(cls.__doc__ or "")


def explain(path: str) -> str:
    """What a setting is (its type, default and description) or, for a section, its description and
    settings; ConfigError naming the closest paths for one that does not exist."""
    secs, leaves = sections(), {f.path: f for f in fields()}
    if path in leaves:
        f = leaves[path]
        return f"{f.path}: {f.type} (default {f.default})\n\n{textwrap.fill(f.doc, 100)}\n"
    if path in secs:
        rows = [f"  {f.path.removeprefix(path + '.')}: {f.type} (default {f.default})"
                for f in leaves.values() if f.path.rpartition(".")[0] == path]
        subs = [f"  {s.removeprefix(path + '.')}: a section (moe-rl config explain {s})" for s in secs
                if s.rpartition(".")[0] == path]
        return f"{path}: {textwrap.fill(_section_doc(secs[path]), 100)}\n\n" + "\n".join(rows + subs) + "\n"
    close = did_you_mean(path, [*secs, *leaves])
    raise ConfigError(path, f"no such setting{close}; `moe-rl config docs` lists them all")


def markdown() -> str:
    """docs/config.md: every section and setting with its type, default and description."""
    lines = ["# Configuration", "",
             "Every setting of a run, section by section: its type, its default and what it does.",
             "Generated from the docstrings in `moe_rl/config/run.py` and `moe_rl/config/learning.py` by",
             "`moe-rl config docs` (a test fails when this file is stale); `moe-rl config explain PATH`",
             "prints one setting or section.", ""]
    leaves = fields()
    for path, cls in sections().items():
        lines += [f"## `{path}`", "", _section_doc(cls), "", "| setting | type | default | description |",
                  "| --- | --- | --- | --- |"]
        for f in leaves:
            if f.path.rpartition(".")[0] == path:
                doc = f.doc.replace("\n", " ").replace("|", "&#124;")
                lines.append(f"| `{f.path}` | {f.type} | `{f.default}` | {doc} |")
        lines.append("")
    return "\n".join(lines)


def registered() -> str:
    """`check-config --list`: the registered advantage estimators, policy losses, corrections, aggregation
    modes and environments, a line each."""
    from moe_rl.algos import registry
    from moe_rl.config import AlgorithmSection
    from moe_rl.rollout.envs import env_names

    lines = [f"{kind}: {', '.join(registry.names(kind))}" for kind in registry.KINDS]
    aggregation = typing.get_args(typing.get_type_hints(AlgorithmSection)["aggregation"])
    lines += [f"aggregation: {', '.join(aggregation)}", f"environment: {', '.join(env_names())}"]
    return "\n".join(lines)
