"""The tables a dataset path names, read the same way whatever their format.

A :class:`Table` has a row count, its column names, rows from any index to the end (streamed), the rows
at given indices, and one column streamed (to collect the data sources at start). Formats:

- ``.parquet``: pyarrow, **streamed** — only the footer is read at open, rows come in batches of
  ``BATCH_ROWS`` through a buffered reader, so memory does not grow with the file (measured in
  ``bench/dataset_stream.py``); a resume starts at the row group holding the position;
- a ``datasets`` folder (``save_to_disk``) or a folder of data files ``load_dataset`` reads, and
  ``.json``/``.csv`` files: a ``datasets.Dataset``, memory-mapped Arrow, so also never loaded whole;
- ``.jsonl``: read into memory with line-numbered errors (small files; convert large ones to parquet).

Nothing here knows what a prompt is (:mod:`learner.rows` does); rows are plain ``dict``s.
"""

from __future__ import annotations

import bisect
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

BATCH_ROWS = 1024
READ_BUFFER_BYTES = 1 << 20
TAKE_GAP_ROWS = 8 * BATCH_ROWS  # indices closer than this are read in one scan


class DataError(ValueError):
    """A dataset that cannot be used as configured; the message names the key, the file and the row."""


class Table(Protocol):
    num_rows: int
    columns: list[str]

    def rows(self, start: int = 0) -> Iterator[dict[str, Any]]: ...

    def take(self, indices: list[int]) -> list[dict[str, Any]]: ...

    def column(self, name: str) -> Iterator[Any]: ...


class ParquetTable:
    def __init__(self, path: Path) -> None:
        import pyarrow.parquet as pq

        # Read pages as they are decoded, not a row group's column chunks at once: a file written as one
        # row group (datasets' to_parquet, pandas) then streams too.
        self.file = pq.ParquetFile(path, buffer_size=READ_BUFFER_BYTES, pre_buffer=False)
        meta = self.file.metadata
        sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        self._starts = list(itertools.accumulate(sizes, initial=0))  # first row of each group, then the end
        self.num_rows = meta.num_rows
        self.columns = list(self.file.schema_arrow.names)

    def _batches(self, start: int, columns: list[str] | None = None) -> Iterator[Any]:
        group = bisect.bisect_right(self._starts, start) - 1
        skip = start - self._starts[group]
        groups = range(group, len(self._starts) - 1)
        for batch in self.file.iter_batches(batch_size=BATCH_ROWS, row_groups=groups, columns=columns,
                                            use_threads=False):  # fmt: skip
            if skip >= batch.num_rows:
                skip -= batch.num_rows
                continue
            yield batch.slice(skip) if skip else batch
            skip = 0

    def rows(self, start: int = 0) -> Iterator[dict[str, Any]]:
        for batch in self._batches(start):
            yield from batch.to_pylist()

    def take(self, indices: list[int]) -> list[dict[str, Any]]:
        """Rows at sorted ``indices``: one streamed scan per cluster of nearby indices (a restart reissues a
        window of prompts near the position), so memory stays bounded as in :meth:`rows`."""
        found: dict[int, dict[str, Any]] = {}
        todo = sorted(set(indices))
        while todo:
            first, scan = todo[0], [todo[0]]
            while len(scan) < len(todo) and todo[len(scan)] - scan[-1] <= TAKE_GAP_ROWS:
                scan.append(todo[len(scan)])
            wanted = set(scan)
            for i, row in enumerate(self.rows(first), first):
                if i in wanted:
                    found[i] = row
                if i == scan[-1]:
                    break
            todo = todo[len(scan) :]
        return [found[i] for i in indices]

    def column(self, name: str) -> Iterator[Any]:
        for batch in self._batches(0, [name]):
            yield from batch.column(0).to_pylist()


class DatasetTable:
    """A ``datasets.Dataset`` (memory-mapped Arrow)."""

    def __init__(self, dataset: Any) -> None:
        self.ds = dataset
        self.num_rows = len(dataset)
        self.columns = list(dataset.column_names)

    def rows(self, start: int = 0) -> Iterator[dict[str, Any]]:
        for lo in range(start, self.num_rows, BATCH_ROWS):
            batch = self.ds[lo : lo + BATCH_ROWS]
            yield from (dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True))

    def take(self, indices: list[int]) -> list[dict[str, Any]]:
        return list(self.ds.select(indices)) if indices else []

    def column(self, name: str) -> Iterator[Any]:
        for lo in range(0, self.num_rows, BATCH_ROWS):
            yield from self.ds[lo : lo + BATCH_ROWS][name]


class ListTable:
    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self._rows = rows
        self.num_rows = len(rows)
        self.columns = sorted({k for r in rows for k in r})

    def rows(self, start: int = 0) -> Iterator[dict[str, Any]]:
        return iter(self._rows[start:])

    def take(self, indices: list[int]) -> list[dict[str, Any]]:
        return [self._rows[i] for i in indices]

    def column(self, name: str) -> Iterator[Any]:
        return (r.get(name) for r in self._rows)


def read_jsonl(path: Path, *, what: str) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{what}: {path}:{lineno} is not JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{what}: {path}:{lineno} is not a JSON object")
            rows.append(row)
    return rows


def _datasets(what: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError(f"{what}: reading a datasets folder or .json/.csv needs the datasets package — "
                         "pip install 'tether[data]', or convert the data to .parquet or .jsonl") from None  # fmt: skip
    return datasets


def _pick_split(dataset: Any, *, split: str, path: Path, what: str) -> Any:
    """A ``DatasetDict``'s split: the only one, else ``split`` (``train``, or ``test``/``validation``)."""
    if not isinstance(dataset, _datasets(what).DatasetDict):
        return dataset
    names = list(dataset.keys())
    wanted = [split] if split == "train" else ["validation", "test", "val"]
    if len(names) == 1:
        return dataset[names[0]]
    for name in wanted:
        if name in names:
            return dataset[name]
    raise DataError(f"{what}: {path} holds the splits {', '.join(names)} but none named {' or '.join(wanted)}; "
                     "save the split you mean on its own (dataset_dict[name].save_to_disk(folder))")  # fmt: skip


def open_table(spec: str, *, what: str, split: str = "train") -> Table:
    """The table at ``spec`` (a path); ``what`` names the config key in errors; ``split`` picks a split of
    a multi-split ``datasets`` folder (``train`` for training, ``test`` or ``validation`` for evaluation)."""
    path = Path(spec)
    if not path.exists():
        raise DataError(f"{what}: {spec} does not exist")
    suffix = path.suffix.lower()
    if path.is_dir():
        datasets = _datasets(what)
        saved = (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()
        try:
            ds = datasets.load_from_disk(str(path)) if saved else datasets.load_dataset(str(path))
        except Exception as e:  # the library's own error says what it could not read; keep it, name the key
            raise DataError(f"{what}: {spec} is not a datasets folder ({type(e).__name__}: {e})") from None
        table: Table = DatasetTable(_pick_split(ds, split=split, path=path, what=what))
    elif suffix == ".parquet":
        try:
            table = ParquetTable(path)
        except Exception as e:  # pyarrow's ArrowInvalid and friends
            raise DataError(f"{what}: {spec} is not a readable parquet file ({e})") from None
    elif suffix == ".jsonl":
        table = ListTable(read_jsonl(path, what=what))
    elif suffix in (".json", ".csv"):
        builder = suffix[1:]
        ds = _datasets(what).load_dataset(builder, data_files=str(path), split="train")
        table = DatasetTable(ds)
    else:
        raise DataError(f"{what}: {spec}: unknown format {suffix or '(no suffix)'} — give a .parquet, .jsonl, "
                         ".json or .csv file, a datasets folder, or demo:TASK")  # fmt: skip
    if not table.num_rows:
        raise DataError(f"{what}: {spec} has no rows")
    return table
