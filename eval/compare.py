"""Reports read back (report.json, outputs.jsonl) and set side by side: `dflashkit eval --compare`.

Design choices:
- `compare_reports` reads several report.json files and writes one side-by-side table (and a tau plot); a
  report.json that is not JSON, or lacks a field the table reads, is named with the field, in one line
  (`check_report`). `read_report` is also how `eval --server --engine-report` reads an engine report.
- outputs.jsonl (eval/report.py `output_record`: one line per prompt, its rounds, their tokens and the answer):
  `--compare` pairs the prompts of reports that have one (`paired_outputs`): how many answers are the same,
  where the others part, and τ of each report over the prompts whose answers are the same. With the same
  answers τ differs only by the drafter's proposals; where they part (another dtype, device or target build:
  greedy decoding picks the other of two near-tied tokens), the two runs draft different text and τ moves for
  that reason too.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflashkit.errors import UserError, shown
from dflashkit.files import atomic_write

from .report import HARNESS_WORDS, markdown_table, save_figure

OUTPUT_FIELDS = {"dataset": str, "id": str, "prompt_tokens": int, "rounds": int, "round_tokens": int, "tau": float,
                 "tokens": list}
# what --compare reads of a report.json: field (keys from the top) -> (JSON types allowed, the name of that kind)
COMPARED_FIELDS = {("args",): (dict, "an object"), ("block_size",): (int, "an integer"),
                   ("datasets",): (dict, "an object"), ("overall",): (dict, "an object"),
                   ("overall", "tau"): ((int, float), "a number")}


def _field_name(keys: tuple) -> str:
    """``overall.tau``; a dataset's name (a path may hold dots) in brackets: ``datasets["p.jsonl"].tau``."""
    name = keys[0]
    for key in keys[1:]:
        name += f".{key}" if key.isidentifier() and len(key) <= 80 else \
            f"[{json.dumps(key) if len(key) <= 80 else shown(key)}]"  # a 100 KB name is cut, not echoed
    return name


def _report_field_problem(report: dict, keys: tuple, kinds: tuple) -> str | None:
    value = report
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            return f"field {_field_name(keys)} is missing"
        value = value[key]
    allowed, kind = kinds
    if isinstance(value, bool) or not isinstance(value, allowed):
        return f"field {_field_name(keys)} is {json.dumps(value)[:40]}, expected {kind}"
    return None


def check_report(report, file: Path) -> dict:
    """The fields --compare reads, with their types; a one-line UserError naming the file and the field."""
    fix = "give a report directory written by `dflashkit eval --out DIR`, or run that eval again"
    if not isinstance(report, dict):
        raise UserError(f"{file}: holds a JSON {type(report).__name__}, not a report object; {fix}")
    fields = dict(COMPARED_FIELDS)
    if isinstance(report.get("datasets"), dict):
        for name, numbers in report["datasets"].items():
            fields[("datasets", name)] = (dict, "an object")
            if isinstance(numbers, dict) and "tau" in numbers:
                fields[("datasets", name, "tau")] = ((int, float), "a number")
    for keys, kinds in fields.items():
        problem = _report_field_problem(report, keys, kinds)
        if problem:
            raise UserError(f"{file}: {problem}; {fix}")
    return report


def read_report(path: str | Path) -> dict:
    path = Path(path)
    file = path / "report.json" if path.is_dir() else path
    if not file.is_file():
        raise UserError(f"{file}: no report.json here; give directories written by `dflashkit eval --out DIR`")
    try:
        report = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise UserError(f"{file}: not valid JSON (line {error.lineno}: {error.msg}); give a report directory written "
                        "by `dflashkit eval --out DIR`, or run that eval again") from None
    except UnicodeDecodeError:
        raise UserError(f"{file}: not UTF-8 text, so not a report.json of `dflashkit eval`; give a report "
                        "directory written by `dflashkit eval --out DIR`") from None
    return check_report(report, file)


def read_outputs(path: str | Path) -> dict[tuple[str, str], dict] | None:
    """A report directory's outputs.jsonl as {(dataset, id): record}; None when it has none (a vLLM report, or
    one written before the file existed). A line that is not such a record is named with its field."""
    path = Path(path)
    file = (path if path.is_dir() else path.parent) / "outputs.jsonl"
    if not file.is_file():
        return None
    fix = "it is written by `dflashkit eval`; run that eval again, or remove the file to compare without it"
    records = {}
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise UserError(f"{file}: line {number} is not JSON ({error.msg}); {fix}") from None
        for name, kind in OUTPUT_FIELDS.items():
            value = record.get(name) if isinstance(record, dict) else None
            if not isinstance(value, kind) and not (kind is float and isinstance(value, int)):
                raise UserError(f"{file}: line {number}: field {name} is missing or not {kind.__name__}; {fix}")
        records[pair_key(record)] = record
    return records


def pair_key(record: dict) -> tuple[str, str]:
    """What pairs two reports' prompts: the dataset's file name (a report of another machine names the same
    file under another folder; builtin:NAME as it is) and the prompt's id."""
    dataset = record["dataset"]
    return (dataset if dataset.startswith("builtin:") else Path(dataset).name, record["id"])


def _first_difference(a: list, b: list) -> int | None:
    """The first token index where two answers differ (the shorter one's length when one is the other's start);
    None for the same answer."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def paired_outputs(first: dict, other: dict) -> dict:
    """Two reports' outputs on the prompts both ran (module notes): the prompts, the same answers, the median
    token where the others part, and τ of each over all shared prompts and over those with the same answer."""
    shared = [key for key in first if key in other]
    parts = {key: _first_difference(first[key]["tokens"], other[key]["tokens"]) for key in shared}
    same = [key for key in shared if parts[key] is None]
    parted = sorted(i for i in parts.values() if i is not None)

    def tau(records: dict, keys: list) -> float | None:
        rounds = sum(records[k]["rounds"] for k in keys)
        return sum(records[k]["round_tokens"] for k in keys) / rounds if rounds else None

    return {"prompts": len(shared), "same_answers": len(same),
            "median_first_difference": parted[len(parted) // 2] if parted else None,
            "tau_first": tau(first, shared), "tau_other": tau(other, shared),
            "tau_first_same_answers": tau(first, same), "tau_other_same_answers": tau(other, same)}


def compare_reports(paths: list[str], out_dir: str | Path | None = None) -> str:
    """A markdown table of several reports side by side (and tau_compare.png in out_dir); where the reports have
    outputs.jsonl, a second table pairs each one's prompts with the first report's (``paired_outputs``)."""
    reports = [read_report(p) for p in paths]
    datasets = sorted({name for r in reports for name in r["datasets"]})
    header = ["report", "mode", "budget"] + [f"τ {d}" for d in datasets] + [
        "τ all", "engine speedup (vLLM)", "harness speedup (dflashkit's decode loop)", "verify/AR step"]
    rows = []
    for path, r in zip(paths, reports):
        served = r.get("engine") == "vllm"  # its overall speedup is vLLM's, at the lowest concurrency
        rows.append([path, r["args"].get("mode"), r["args"].get("tree_budget") if r["args"].get("mode") == "tree"
                     else r["block_size"]] + [r["datasets"].get(d, {}).get("tau") for d in datasets]
                    + [r["overall"]["tau"], r["overall"].get("speedup") if served else None,
                       None if served else r["overall"].get("speedup"), r["overall"].get("verify_over_ar_step")])
    text = ("# Comparison\n\nEngine speedup: vLLM's output tok/s against no speculation at its report's lowest "
            f"concurrency (the report's headline has every level); {HARNESS_WORDS}.\n\n"
            + markdown_table(rows, header) + "\n")
    outputs = [read_outputs(p) for p in paths]
    if outputs[0] is not None and any(o is not None for o in outputs[1:]):
        paired = [[path] + list(paired_outputs(outputs[0], o).values()) for path, o in zip(paths[1:], outputs[1:])
                  if o is not None]
        text += (f"\n## The same prompts against {paths[0]} (outputs.jsonl)\n\n"
                 + markdown_table(paired, ["report", "prompts", "same answers", "median first difference (token)",
                                           "τ first", "τ this", "τ first, same answers", "τ this, same answers"])
                 + "\n")
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(out / "compare.md", text.encode())
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.2))
        width = 0.8 / len(reports)
        for i, (path, r) in enumerate(zip(paths, reports)):
            ax.bar([j + i * width for j in range(len(datasets))],
                   [r["datasets"].get(d, {}).get("tau", 0.0) for d in datasets], width, label=Path(path).name)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(datasets))], datasets)
        ax.set(ylabel="τ")
        ax.legend(fontsize=7)
        save_figure(fig, out / "tau_compare.png")
    return text
