"""Per-token output of `replayllm replay`: JSONL or parquet, written shard by shard as shards complete in order."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from .columns import TokenColumns

FORMATS = ("jsonl", "parquet")
# One row per replayed token; JSONL and parquet carry the same columns (top_* only when top-k was asked).
COLUMNS = ("request_id", "position", "token_id", "logprob", "rank", "top_token_ids", "top_logprobs")


def output_format(path: str, fmt: str | None) -> str:
    """The format named, else the one the file's extension says (.jsonl, .parquet)."""
    if fmt is None:
        ext = os.path.splitext(path)[1].lower().lstrip(".")
        fmt = {"jsonl": "jsonl", "parquet": "parquet", "pq": "parquet"}.get(ext)
        if fmt is None:
            raise ValueError(f"cannot tell the output format from {path!r}: use a .jsonl or .parquet file name "
                             "or --format")
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt == "parquet":
        _pyarrow()
    return fmt


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as e:
        raise ValueError("parquet output needs pyarrow: pip install 'replayllm[ray]' (or pip install pyarrow)") from e
    return pyarrow


class TokenWriter:
    """`write(request_ids, columns)` appends one shard's rows; `close()` finishes the file."""

    def __init__(self, path: str | os.PathLike, fmt: str, top_k: int):
        self.path, self.fmt, self.top_k = os.fspath(path), fmt, top_k
        self.num_requests = self.num_tokens = 0
        self._file: Any = None
        if fmt == "jsonl":
            self._file = open(self.path, "w", encoding="utf-8")
        else:
            pa = _pyarrow()
            fields = [("request_id", pa.string()), ("position", pa.int32()), ("token_id", pa.int64()),
                      ("logprob", pa.float32()), ("rank", pa.int64())]
            if top_k:
                fields += [("top_token_ids", pa.list_(pa.int64(), top_k)), ("top_logprobs", pa.list_(pa.float32(),
                                                                                                       top_k))]
            self._schema = pa.schema(fields)
            self._file = _pyarrow().parquet.ParquetWriter(self.path, self._schema)
            # A throw-away one-token table: pyarrow imports modules on first use (pyarrow.compute for the
            # request_id cast, numpy.ma: ~0.3 s on a busy CPU). Paid here, before the run is timed, not on the
            # first shard: a Ray driver has no engine that imported them before (issue 18's dp=1 overhead).
            self._table(["warm-up"], TokenColumns(*_one_token(top_k)))

    def write(self, request_ids: list[str], cols: TokenColumns) -> None:
        if len(request_ids) != cols.num_requests:
            raise ValueError(f"{len(request_ids)} request ids for {cols.num_requests} requests")
        if self.fmt == "jsonl":
            self._write_jsonl(request_ids, cols)
        else:
            self._write_parquet(request_ids, cols)
        self.num_requests += cols.num_requests
        self.num_tokens += cols.num_tokens

    def _write_jsonl(self, request_ids: list[str], cols: TokenColumns) -> None:
        # .tolist() turns float32 into the Python float of the same value: the text round-trips to it exactly.
        tokens, lps, ranks = cols.token_ids.tolist(), cols.logprobs.tolist(), cols.ranks.tolist()
        top_ids, top_lps = cols.top_ids.tolist(), cols.top_logprobs.tolist()
        row = 0
        lines = []
        for rid, n in zip(request_ids, cols.lengths.tolist()):
            for pos in range(n):
                obj = {"request_id": rid, "position": pos, "token_id": tokens[row], "logprob": lps[row],
                       "rank": ranks[row]}
                if self.top_k:
                    obj["top_token_ids"], obj["top_logprobs"] = top_ids[row], top_lps[row]
                lines.append(json.dumps(obj, allow_nan=False))
                row += 1
        if lines:
            self._file.write("\n".join(lines) + "\n")

    def _write_parquet(self, request_ids: list[str], cols: TokenColumns) -> None:
        self._file.write_table(self._table(request_ids, cols))

    def _table(self, request_ids: list[str], cols: TokenColumns):
        pa = _pyarrow()
        lengths = cols.lengths
        positions = (np.arange(cols.num_tokens) - np.repeat(np.cumsum(lengths) - lengths, lengths)).astype(np.int32)
        arrays = [pa.DictionaryArray.from_arrays(pa.array(np.repeat(np.arange(len(request_ids)), lengths)),
                                                 pa.array(request_ids, pa.string())).cast(pa.string()),
                  pa.array(positions), pa.array(cols.token_ids), pa.array(cols.logprobs), pa.array(cols.ranks)]
        if self.top_k:
            arrays += [pa.FixedSizeListArray.from_arrays(pa.array(cols.top_ids.reshape(-1)), self.top_k),
                       pa.FixedSizeListArray.from_arrays(pa.array(cols.top_logprobs.reshape(-1)), self.top_k)]
        return pa.Table.from_arrays(arrays, schema=self._schema)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _one_token(k: int) -> tuple[np.ndarray, ...]:
    """TokenColumns fields of one request of one token (k alternatives)."""
    return (np.ones(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.float32), np.ones(1, np.int64),
            np.zeros((1, k), np.int64), np.zeros((1, k), np.float32))
