"""Prompt datasets: JSONL or Parquet files of rows (dicts) handed to `Environment.reset`.

A malformed row is a `DatasetError` naming the file, the row number (a JSONL file's line) and what is
wrong: checked when the file loads, before Ray or vLLM start.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


class DatasetError(ValueError):
    pass


def load_prompts(path: str | Path, required: tuple[str, ...] = (),
                 check: Callable[[dict], str | None] | None = None,
                 fields: dict[str, str] | None = None) -> list[dict]:
    """The rows of `path`; each must carry the `required` fields and pass `check` (None: fine, else what
    is wrong). `fields`: {field the environment reads: the file's name for it} (a dataset's `problem` read
    as `prompt`), renamed as each row loads."""
    fields = fields or {}
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset '{path}' does not exist")
    if path.suffix in (".jsonl", ".json"):
        rows = []
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DatasetError(f"{path}:{i}: not valid JSON ({err.msg})") from None
            rows.append((i, row))
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as err:
            raise DatasetError(f"{path}: not a readable Parquet file ({err})") from None
        rows = list(enumerate(table.to_pylist(), 1))
    else:
        raise DatasetError(f"{path}: unsupported dataset format '{path.suffix}' (use .jsonl or .parquet)")
    out = []
    for i, row in rows:
        if not isinstance(row, dict):
            raise DatasetError(f"{path}:{i}: a row must be an object, got {type(row).__name__}")
        theirs = [fields.get(k, k) for k in required]
        missing = [k for k in theirs if k not in row]
        if missing:
            named = "; environment.dataset_fields: " + ", ".join(f"{k} as {v}" for k, v in fields.items())
            raise DatasetError(f"{path}:{i}: missing field(s) {', '.join(missing)} (the environment reads "
                               f"{', '.join(required)}{named if fields else ''}; the row has "
                               f"{', '.join(map(str, row)) or 'none'})")
        row = {**{k: v for k, v in row.items() if k not in fields.values()},
               **{k: row[v] for k, v in fields.items() if v in row}}
        problem = check(row) if check is not None else None
        if problem:
            raise DatasetError(f"{path}:{i}: {problem}")
        out.append(row)
    if not out:
        raise DatasetError(f"{path}: no rows")
    return out
