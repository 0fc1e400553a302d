"""``dflashkit regenerate``: rewrite every assistant turn with the target's own answer.

A drafter learns to predict what the target says; answers written by another model teach it the wrong thing.

CPU (testbed, a few prompts):
    python -m dflashkit.extract.regenerate --target testbed:smollm2 --data builtin:mtbench --limit 4 \\
        --max-new-tokens 64 --out runs/mtbench-smollm2.jsonl
One GPU, sampled, 256 sequences decoded at once:
    dflashkit regenerate --target /models/Qwen3-8B --data chats.jsonl --out regen.jsonl --temperature 0.6 --top-p 0.95 \
        --batch-size 256
Several GPUs (rank r answers conversations i % world_size == r; rank 0 merges the parts into --out):
    torchrun --standalone --nproc_per_node 8 -m dflashkit.extract.regenerate --target /models/Qwen3-8B \
        --data chats.jsonl --out regen.jsonl --batch-size 256
A running vLLM / SGLang server (OpenAI-compatible), 32 requests in flight:
    dflashkit regenerate --server http://localhost:8000/v1 --model Qwen/Qwen3-8B --data chats.jsonl --out regen.jsonl \\
        --concurrency 32
Then extract from the output: ``dflashkit extract --data regen.jsonl ...``.

Design choices:
- System and user turns are kept; every user turn gets the target's answer to the conversation so far (its own
  earlier answers included), so multi-turn data and prompt-only data (MT-bench) are treated alike.
- A local target (--target) answers --batch-size x --chunk-factor conversations at a time through
  ``generation.generator.SlotGenerator`` (--batch-size cache slots, continuous batching, a CUDA-graph decode
  step on a GPU): a conversation's next turn is queued as soon as its previous answer ends. A target with recurrent
  layers (Qwen3.5, Qwen3-Next) goes through Hugging Face ``generate`` in left-padded batches, one turn of every
  conversation per round. Generation stops at the template's end-of-turn token and the tokenizer's eos. A server
  gets one request per turn, several conversations in flight; its ``reasoning_content`` (thinking models) is
  kept as a ``<think>`` block.
- Output is JSONL in the input's order: {"index", "source", "messages"} plus how it was generated. A run killed
  at any point continues with --resume: finished conversations are skipped, a cut last line is dropped; Ctrl-C
  or SIGTERM first writes every conversation already answered (also mid-chunk), and the resumed run puts the
  file back in input order. With
  several ranks each writes ``<out>.rank<r>-of-<world>`` (resumed the same way) and rank 0 merges them, by
  index, into --out at the end. Greedy output is the same either way (up to bf16 rounding between batch
  shapes); sampled output is seeded per conversation (--seed + index) on a server, per chunk locally.
- An existing --out is continued only with --resume and replaced only with --overwrite, either only when it is
  regenerate's output; a directory at --out is an error, and so is an --out that is, lies inside or contains
  --data or --target (dflashkit/outputs.py ``check_apart``): the output is never read back as input.
  One run per --out: the run holds the lock file ``<out>.lock`` beside it (not a lock on the directory, so
  several runs can write files into one folder); the ranks of one launch share it (dflashkit/outputs.py).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dflashkit import launch
from dflashkit.errors import UserError
from dflashkit.extract.data.rendering import BadSample, normalize_record, read_chat_template
from dflashkit.files import atomic_write, disk_full_is_user_error, open_appending, pause_point, sync, whole_lines
from dflashkit.options import build_parser as options_parser
from dflashkit.options import parse_options
from dflashkit.stopping import StopRequest

from .generation.answerers import EMPTY_ANSWER, AnswerSettings, ServerGenerator, TargetGenerator
from .options import RegenerateOptions, data_paths
from .regenerated_data import check_or_record_data, data_record_path


def build_parser() -> argparse.ArgumentParser:
    """The command's parser, built from its flags (``RegenerateOptions``, extract/options.py)."""
    return options_parser(RegenerateOptions, prog="dflashkit regenerate", description=__doc__.split("\n\n")[0])


# ---------------------------------------------------------------- output file


def check_regenerated(out: Path) -> None:
    """--resume: ``out`` must be regenerate's output (its first row has ``index`` and ``messages``)."""
    if not out.exists() or not out.stat().st_size:
        return
    with open(out, "rb") as f:
        first = f.readline()
    try:
        row = json.loads(first)
        ok = isinstance(row, dict) and "index" in row and "messages" in row
    except ValueError:
        # one cut line: a run killed while writing its first row (which starts as every row regenerate writes)
        ok = not first.endswith(b"\n") and first.startswith(b'{"index": ')
    if not ok:
        raise UserError(f"{out}: line 1 is not a row that dflashkit regenerate writes (index, messages), and "
                        f"regenerate continues (--resume) or removes (--overwrite) only its own output: move the "
                        f"file away or pick another --out")


def done_indices(out: Path) -> set[int]:
    """Indices already in the output; a cut last line (run killed while writing) is removed."""
    return {json.loads(line)["index"] for line in whole_lines(out).splitlines() if line.strip()}


# ---------------------------------------------------------------- conversations


def _prompt_turns(record, max_turns: int | None = None) -> list[dict]:
    kind, messages, _ = normalize_record(record, require_assistant=False)
    if kind != "chat" or not any(m["role"] == "user" for m in messages):
        raise BadSample("no_user_turn", "regeneration needs a conversation with a user turn")
    turns = [m for m in messages if m["role"] != "assistant"]
    if max_turns is not None:
        users = [k for k, m in enumerate(turns) if m["role"] == "user"]
        if len(users) > max_turns:
            turns = turns[: users[max_turns]]
    return turns


def part_path(out: Path, rank: int, world: int) -> Path:
    """Where rank `rank` of `world` writes its conversations before rank 0 merges them into `out`."""
    return out.with_name(f"{out.name}.rank{rank}-of-{world}")


def merge_parts(out: Path, world: int) -> int:
    """Rows of `out` (a earlier merged run) and of every rank's part, by index, into `out` (atomically); the parts
    are removed. Returns the number of rows."""
    rows: dict[int, bytes] = {}
    for path in [out, *(part_path(out, r, world) for r in range(world))]:
        if path.exists():
            for line in path.read_bytes().splitlines():
                if line.strip():
                    rows[json.loads(line)["index"]] = line
    atomic_write(out, b"".join(rows[i] + b"\n" for i in sorted(rows)))
    for r in range(world):
        part_path(out, r, world).unlink(missing_ok=True)
    return len(rows)


def regenerate(opts: RegenerateOptions) -> dict:
    """Answer every user turn of the conversations of ``opts.data`` with ``opts.target`` (a local model) or
    ``opts.server`` (an OpenAI-compatible URL) into the JSONL file ``opts.out``; return the counts. ``opts``: the
    command's flags (extract/options.py). The run holds the lock ``<out>.lock`` (dflashkit/outputs.py)."""
    from dflashkit.outputs import OutputLock, check_apart, check_output_file

    check_apart({"--out": opts.out}, {"--data": data_paths(opts.data), "--target": opts.target})
    check_output_file(opts.out, "the output of dflashkit regenerate")
    with OutputLock(opts.out, "regenerate", sidecar=True):
        return _regenerate(opts)


def _regenerate(opts: RegenerateOptions) -> dict:
    """The run under the lock: the flags and the output checked, the generator, the conversations answered chunk
    by chunk into this rank's append log, the summary and the ranks' parts merged."""
    from dflashkit.extract.data.sources import check_has_records

    # --- flags, this rank's output, what it holds already ------------------------------------------------
    _check_generation_flags(opts)
    template = read_chat_template(opts.chat_template)  # a missing file stops here, before the target loads
    rank, world, _ = launch.ranks()
    out, data = Path(opts.out), data_paths(opts.data)
    path = part_path(out, rank, world) if world > 1 else out
    done = _prepare_output(out, path, rank, resume=opts.resume, overwrite=opts.overwrite)
    check_has_records(data, opts.split)  # an empty data file stops here, before the target is loaded or a server asked
    check_or_record_data(out, data, resume=opts.resume, has_rows=bool(done), rank=rank)  # other data: refused here

    # --- the generator; the conversations, answered chunk by chunk into the append log --------------------
    gen = _generator(opts, template)
    answering = _Answering(gen, _row_meta(gen, opts.answer_settings()), seed=opts.seed, on_bad=opts.on_bad,
                           world=world, counts={"written": 0, "already_done": len(done), "skipped": {}, "cut_short": 0},
                           bar=_progress_bar(opts.progress and rank == 0))
    out.parent.mkdir(parents=True, exist_ok=True)
    _answer_all(answering, _rank_records(data, opts.split, opts.limit, rank, world, done), path, opts)

    # --- summary; the ranks' parts merged into --out -----------------------------------------------------
    all_empty = bool(answering.counts["skipped"].get(EMPTY_ANSWER)) and not answering.counts["written"]
    if not all_empty:  # else the error below says the counts, in its one line
        _report(answering.counts, path, rank, world)
    _merge(out, rank, world, resumed=bool(done))
    if all_empty:
        raise _all_empty_error(answering.counts, gen, path)
    _check_not_all_skipped(answering.counts, out, world)
    return answering.counts


def _generator(opts: RegenerateOptions, template: str | None):
    """Who answers: the server (--server) or the local target (--target; ``template``: --chat-template's text)."""
    if opts.server:
        return ServerGenerator(opts.server, opts.model, opts.answer_settings(), api_key=opts.api_key,
                               concurrency=opts.concurrency)
    return TargetGenerator(opts.target, opts.answer_settings(), max_prompt_length=opts.max_prompt_length,
                           batch_size=opts.batch_size, dtype=opts.dtype, device=str(launch.local_device(opts.device)),
                           cuda_graph=opts.cuda_graph, decode_attention=opts.decode_attention, chat_template=template)


def _answer_all(answering: _Answering, records, path: Path, opts: RegenerateOptions) -> None:
    """This rank's ``records`` answered chunk by chunk into its append log ``path``."""
    # conversations answered together: several times the slots, so refills keep the slots busy
    chunk_size = opts.concurrency * 4 if opts.server else opts.batch_size * opts.chunk_factor
    with open_appending(path) as log:
        answering.file = log
        for item in records:
            answering.add(item, opts.max_turns)
            if len(answering.chunk) >= chunk_size:
                answering.answer_chunk()
        if answering.chunk:
            answering.answer_chunk()
    if answering.bar is not None:
        answering.bar.close()


def _all_empty_error(counts: dict, gen, path: Path) -> UserError:
    """Every conversation this run sent came back empty from the server: nothing usable was written; the counts
    (an empty answer is a skipped conversation, ``EMPTY_ANSWER``) and what to check."""
    empty = counts["skipped"][EMPTY_ANSWER]
    return UserError(f"{gen.name}: the answers to all {empty} conversations sent were empty (0 written to {path}, "
                     f"skipped {counts['skipped']}); check that --model is what the server serves, and raise "
                     f"--max-new-tokens ({gen.max_new_tokens}) where a reasoning model spends it all thinking; then "
                     f"run again with --resume")


def _check_not_all_skipped(counts: dict, out: Path, world: int) -> None:
    """A run whose output holds no conversation because every one was skipped fails (exit 2 naming the reasons
    and counts, this rank's with several) instead of passing for a success."""
    rows = counts["written"] + counts["already_done"] if world == 1 else int(out.is_file() and out.stat().st_size > 0)
    if rows:
        return
    skipped = ", ".join(f"{k} {v}" for k, v in sorted(counts["skipped"].items())) or "none"
    raise UserError(f"regenerate: every conversation was skipped ({skipped}{' on this rank' if world > 1 else ''}): "
                    f"{out} holds none; fix the records (--on-bad fail stops at the first bad one, naming it)")


def _check_generation_flags(opts: RegenerateOptions) -> None:
    if bool(opts.target) == bool(opts.server):
        raise UserError("give either --target (a local model) or --server (an OpenAI-compatible URL)")
    if opts.temperature < 0 or opts.top_k < 0 or not 0 < opts.top_p <= 1:
        raise UserError(f"--temperature {opts.temperature}, --top-k {opts.top_k}, --top-p {opts.top_p}: give "
                         "temperature >= 0 (0: greedy), top-k >= 0 (0: off) and top-p in (0, 1]")
    if opts.server and opts.chat_template:
        raise UserError("--chat-template renders prompts for --target; a server renders with its own template: "
                        "start it with that template (vLLM/SGLang --chat-template) instead")


def _prepare_output(out: Path, path: Path, rank: int, *, resume: bool, overwrite: bool) -> set[int]:
    """The --resume / --overwrite rule on ``out`` and this rank's ``path``: --overwrite removes them (rank 0 the
    merged file, each rank its own part), --resume checks them and drops a cut last line. Returns the indices of
    the conversations already written."""
    from dflashkit.outputs import check_resume_flags

    check_resume_flags(out, resume=resume, overwrite=overwrite,
                       holds="rows" if any(p.exists() and p.stat().st_size for p in (out, path)) else None)
    if overwrite:  # each rank its own part; rank 0 the merged file and the data record; only files it wrote
        for p in {path, out} if rank == 0 else {path}:
            check_regenerated(p)
            p.unlink(missing_ok=True)
        if rank == 0:
            data_record_path(out).unlink(missing_ok=True)
    if not resume:
        return set()
    for p in {out, path}:
        check_regenerated(p)
    return done_indices(out) | done_indices(path)


def _row_meta(gen, answers: AnswerSettings) -> dict:
    """How the rows were generated: the ``meta`` of every row."""
    return {"generator": gen.name, "temperature": answers.temperature, "top_p": answers.top_p,
            "top_k": answers.top_k, "max_new_tokens": answers.max_new_tokens,
            "chat_template_kwargs": answers.template_kwargs}


def _progress_bar(show: bool):
    if not show:
        return None
    from dflashkit.progress import progress_bar

    return progress_bar(unit="conversation", desc="regenerate", dynamic_ncols=True)


def _rank_records(data: list[str], split: str | None, limit: int | None, rank: int, world: int, done: set[int]):
    """This rank's records (index % world == rank) up to ``limit``, without those already ``done``."""
    from dflashkit.extract.data.sources import iter_records

    for item in iter_records(data, split):
        if limit is not None and item.index >= limit:
            break
        if item.index % world == rank and item.index not in done:
            yield item


@dataclass
class _Answering:
    """One rank's conversations on their way into its append log: the chunk being gathered, what was counted."""

    gen: object  # TargetGenerator or ServerGenerator
    meta: dict  # how the rows were generated (``_row_meta``)
    seed: int  # --seed
    on_bad: str  # --on-bad: "skip" counts a bad record, "fail" raises it
    world: int  # ranks of the launch (the progress bar counts them all)
    counts: dict  # written, already_done, skipped (by reason), cut_short: what _regenerate returns
    bar: object | None = None  # tqdm on rank 0 with progress, else None
    file: object = None  # the append log (files.open_appending), open while answering
    chunk: list = field(default_factory=list)  # (index, prompt turns, where) of the conversations gathered

    def skip(self, reason: str, where: str, detail: str) -> None:
        if self.on_bad == "fail" and reason != EMPTY_ANSWER:  # an empty answer is the server's, not the record's
            raise BadSample(reason, detail, where)
        self.counts["skipped"][reason] = self.counts["skipped"].get(reason, 0) + 1

    def add(self, item, max_turns: int | None) -> None:
        """The record's prompt turns join the chunk; a bad record is skipped (or raised)."""
        try:
            if item.bad is not None:
                raise BadSample(*item.bad)
            self.chunk.append((item.index, _prompt_turns(item.record, max_turns), item.where))
        except BadSample as e:
            self.skip(e.reason, item.where, e.detail)

    def answer_chunk(self) -> None:
        """Answer the chunk and write its rows; stopped (SIGINT/SIGTERM, an error), the conversations already
        answered are written first."""
        finished: dict[int, list[dict] | BadSample] = {}  # conversations complete so far, by chunk position
        try:
            self.gen.answer_turns([(i, t) for i, t, _ in self.chunk], self.seed,
                                  on_done=functools.partial(self._finished, finished))
        except BaseException:
            self.write(finished, failing=True)
            raise
        self.write(finished, failing=False)
        if self.bar is not None:
            self.bar.update(len(self.chunk) * self.world)
        self.chunk.clear()

    def _finished(self, finished: dict, k: int, result) -> None:
        finished[k] = result
        pause_point(f"regenerate-{self.chunk[k][0]}-done")  # test hook (dflashkit/files.py)

    def write(self, finished: dict, failing: bool) -> None:
        """The rows of the ``finished`` conversations, in chunk order, then synced."""
        for k in sorted(finished):
            (index, turns, where), messages = self.chunk[k], finished[k]
            if isinstance(messages, BadSample):
                if not failing:  # (while another error propagates, only the answered conversations count)
                    self.skip(messages.reason, where, messages.detail)
                continue
            self.file.write(json.dumps({"index": index, "source": where, "messages": messages, "meta": self.meta},
                                       ensure_ascii=False) + "\n")
            self.counts["written"] += 1
            asked = sum(m["role"] == "user" for m in turns)
            self.counts["cut_short"] += sum(m["role"] == "user" for m in messages) < asked
        sync(self.file)


def _report(counts: dict, path: Path, rank: int, world: int) -> None:
    where = f"rank {rank}/{world}: " if world > 1 else ""
    print(f"regenerate: {where}{counts['written']} conversations written ({counts['already_done']} already there), "
          f"{counts['cut_short']} of them ended before a turn longer than --max-prompt-length, "
          f"skipped {counts['skipped'] or 'none'}, to {path}", file=sys.stderr)


def _merge(out: Path, rank: int, world: int, resumed: bool) -> None:
    """Restore the input order: one process after a resumed run (it appended after an interrupted chunk); several
    ranks always (rank 0 merges the parts once every rank is done)."""
    if world == 1 and resumed:
        merge_parts(out, 1)
    if world > 1:
        # the ranks only wait for each other here: a gloo group, which moves no tensors, serves GPU runs as well
        launch.join_process_group("cpu")
        launch.barrier()
        if rank == 0:
            print(f"regenerate: {merge_parts(out, world)} conversations merged into {out}", file=sys.stderr)
        launch.barrier()


def main(argv=None) -> int:
    opts = parse_options(RegenerateOptions, argv, build_parser())
    # SIGTERM (a scheduler, a time limit, torchrun passing on Ctrl-C) stops like Ctrl-C: the conversations already
    # answered are written before the process ends, and --resume continues from there
    try:
        with StopRequest(interrupt=True):
            with disk_full_is_user_error(opts.out, then="run the same command again with --resume"):
                regenerate(opts)
    except BadSample as e:  # other user errors propagate to dflashkit.cli.run_main (one line, exit 2)
        raise UserError(f"{e}; fix the record, or pass --on-bad skip") from None
    except KeyboardInterrupt:
        print(f"dflashkit regenerate: stopped; the conversations answered so far are in {opts.out} (or its rank "
              "parts): run the same command with --resume to continue", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    from dflashkit.cli import run_main

    sys.exit(run_main("dflashkit regenerate", main))
