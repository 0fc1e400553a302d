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
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dflashkit import launch
from dflashkit.errors import UserError
from dflashkit.extract.data.rendering import BadSample, normalize_record, read_chat_template
from dflashkit.files import atomic_write, disk_full_is_user_error, open_appending, pause_point, sync, whole_lines
from dflashkit.stopping import StopRequest

from .generation.answerers import EMPTY_ANSWER, ServerGenerator, TargetGenerator
from .regenerated_data import check_or_record_data, data_record_path


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number >= 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflashkit regenerate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("generator (one of)")
    g.add_argument("--target", help="HF model dir, .gguf file, or testbed:smollm2 (Hugging Face generation)")
    g.add_argument("--server", help="base URL of an OpenAI-compatible server, e.g. http://localhost:8000/v1")
    g.add_argument("--model", help="model name to send to the server")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", ""), help="bearer token for the server")
    g = p.add_argument_group("data")
    g.add_argument("--data", action="append", required=True, help="as for `dflashkit extract`; repeatable")
    g.add_argument("--split", default=None, help="split of a saved DatasetDict")
    g.add_argument("--limit", type=int, default=None, help="only the first N records")
    g.add_argument("--out", required=True, help="output JSONL")
    g.add_argument("--resume", action="store_true", help="continue a killed run into the same --out")
    g.add_argument("--overwrite", action="store_true", help="start --out afresh, replacing what it holds")
    g.add_argument("--on-bad", choices=("skip", "fail"), default="skip", help="a bad record: skip it, or stop")
    g = p.add_argument_group("generation")
    g.add_argument("--max-new-tokens", type=positive_int, default=1024, help="longest answer per turn")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--top-k", type=int, default=0, help="0: no top-k")
    g.add_argument("--seed", type=int, default=0, help="sampling seed")
    g.add_argument("--chat-template", default=None,
                   help="--target: Jinja file replacing the tokenizer's chat template (as extract and train)")
    g.add_argument("--chat-template-kwargs", default="{}", help='JSON, e.g. \'{"enable_thinking": false}\'')
    g.add_argument("--max-prompt-length", type=int, default=None,
                   help="a turn whose prompt is longer ends its conversation there (the answered turns are kept; "
                        "a first turn that long: the conversation is skipped)")
    g.add_argument("--max-turns", type=int, default=None,
                   help="answer only the first N user turns of each conversation (later turns are dropped)")
    g.add_argument("--batch-size", type=positive_int, default=16,
                   help="--target: sequences decoded at once (cache slots; HF generate: per call)")
    g.add_argument("--chunk-factor", type=positive_int, default=8,
                   help="--target: conversations answered together, in multiples of --batch-size")
    g.add_argument("--no-cuda-graph", action="store_true", help="--target on a GPU: run each decode step eagerly")
    g.add_argument("--decode-attention", choices=("sdpa", "triton"), default="triton",
                   help="--target on a GPU: decode attention by the Triton kernel that reads each slot up to its "
                        "own length (default; SDPA where Triton cannot run), or by masked SDPA over the longest "
                        "slot's length")
    g.add_argument("--concurrency", type=positive_int, default=16, help="server requests in flight")
    g.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None)
    g.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    g.add_argument("--no-progress", action="store_true")
    return p


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


def regenerate(data: list[str], out, *, overwrite: bool = False, **kwargs) -> dict:
    """Answer every user turn of the conversations of ``data`` into the JSONL file ``out`` (see ``_regenerate``);
    ``overwrite`` starts ``out`` afresh. The run holds the lock ``<out>.lock`` (dflashkit/outputs.py)."""
    from dflashkit.outputs import OutputLock, check_apart, check_output_file

    check_apart({"--out": out}, {"--data": [data] if isinstance(data, (str, Path)) else list(data),
                                 "--target": kwargs.get("target")})
    check_output_file(out, "the output of dflashkit regenerate")
    with OutputLock(out, "regenerate", sidecar=True):
        return _regenerate(data, out, overwrite=overwrite, **kwargs)


def _regenerate(data: list[str], out, *, overwrite: bool = False, target: str | None = None, server: str | None = None,
               model: str | None = None, api_key: str = "", split: str | None = None, limit: int | None = None,
               resume: bool = False, on_bad: str = "skip", max_new_tokens: int = 1024, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, seed: int = 0, chat_template_kwargs: dict | None = None,
               max_prompt_length: int | None = None, max_turns: int | None = None, batch_size: int = 16,
               chunk_factor: int = 8, cuda_graph: bool = True, concurrency: int = 16, dtype: str | None = None,
               device: str | None = None, progress: bool = True, decode_attention: str = "triton",
               chat_template: str | None = None) -> dict:
    """Answer every user turn of the conversations of ``data`` with ``target`` (a local model) or ``server`` (an
    OpenAI-compatible URL) into the JSONL file ``out``; return the counts. The parameters are the command's flags
    (see ``build_parser``); ``chat_template_kwargs`` is a dict, ``chat_template`` a Jinja file."""
    from dflashkit.extract.data.sources import check_has_records

    # --- flags, this rank's output, what it holds already ------------------------------------------------
    _check_generation_flags(target, server, temperature, top_p, top_k)
    if server and chat_template:
        raise UserError("--chat-template renders prompts for --target; a server renders with its own template: "
                        "start it with that template (vLLM/SGLang --chat-template) instead")
    template = read_chat_template(chat_template)  # a missing file stops here, before the target loads
    rank, world, _ = launch.ranks()
    out = Path(out)
    data = [str(data)] if isinstance(data, (str, Path)) else [str(d) for d in data]
    path = part_path(out, rank, world) if world > 1 else out
    done = _prepare_output(out, path, rank, resume=resume, overwrite=overwrite)
    check_has_records(data, split)  # an empty data file stops here, before the target is loaded or a server asked
    check_or_record_data(out, data, resume=resume, has_rows=bool(done), rank=rank)  # other data: refused here

    # --- the generator -----------------------------------------------------------------------------------
    sampling = dict(template_kwargs=dict(chat_template_kwargs or {}), max_new_tokens=max_new_tokens,
                    temperature=temperature, top_p=top_p, top_k=top_k)
    if server:
        gen = ServerGenerator(server, model, api_key=api_key, concurrency=concurrency, **sampling)
    else:
        gen = TargetGenerator(target, max_prompt_length=max_prompt_length, batch_size=batch_size, dtype=dtype,
                              device=str(launch.local_device(device)), cuda_graph=cuda_graph,
                              decode_attention=decode_attention, chat_template=template, **sampling)
    # conversations answered together: several times the slots, so refills keep the slots busy
    chunk_size = concurrency * 4 if server else batch_size * chunk_factor

    # --- the conversations, answered chunk by chunk into the append log ----------------------------------
    answering = _Answering(gen, _row_meta(gen, sampling), seed=seed, on_bad=on_bad, world=world,
                           counts={"written": 0, "already_done": len(done), "skipped": {}, "cut_short": 0},
                           bar=_progress_bar(progress and rank == 0))
    out.parent.mkdir(parents=True, exist_ok=True)
    with open_appending(path) as log:
        answering.file = log
        for item in _rank_records(data, split, limit, rank, world, done):
            answering.add(item, max_turns)
            if len(answering.chunk) >= chunk_size:
                answering.answer_chunk()
        if answering.chunk:
            answering.answer_chunk()
    if answering.bar is not None:
        answering.bar.close()

    # --- summary; the ranks' parts merged into --out -----------------------------------------------------
    all_empty = bool(answering.counts["skipped"].get(EMPTY_ANSWER)) and not answering.counts["written"]
    if not all_empty:  # else the error below says the counts, in its one line
        _report(answering.counts, path, rank, world)
    _merge(out, rank, world, resumed=bool(done))
    if all_empty:
        raise _all_empty_error(answering.counts, gen, path)
    _check_not_all_skipped(answering.counts, out, world)
    return answering.counts


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


def _check_generation_flags(target: str | None, server: str | None, temperature: float, top_p: float,
                            top_k: int) -> None:
    if bool(target) == bool(server):
        raise UserError("give either --target (a local model) or --server (an OpenAI-compatible URL)")
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise UserError(f"--temperature {temperature}, --top-k {top_k}, --top-p {top_p}: give "
                         "temperature >= 0 (0: greedy), top-k >= 0 (0: off) and top-p in (0, 1]")


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


def _row_meta(gen, sampling: dict) -> dict:
    """How the rows were generated: the ``meta`` of every row."""
    return {"generator": gen.name, "temperature": sampling["temperature"], "top_p": sampling["top_p"],
            "top_k": sampling["top_k"], "max_new_tokens": sampling["max_new_tokens"],
            "chat_template_kwargs": sampling["template_kwargs"]}


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


def _regenerate_args(args, template_kwargs: dict) -> None:
    """``regenerate`` with the command line's flags."""
    regenerate(args.data, args.out, target=args.target, server=args.server, model=args.model,
               api_key=args.api_key, split=args.split, limit=args.limit, resume=args.resume,
               overwrite=args.overwrite, on_bad=args.on_bad,
               max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
               top_k=args.top_k, seed=args.seed, chat_template_kwargs=template_kwargs,
               max_prompt_length=args.max_prompt_length, max_turns=args.max_turns, batch_size=args.batch_size,
               chunk_factor=args.chunk_factor, cuda_graph=not args.no_cuda_graph,
               concurrency=args.concurrency, dtype=args.dtype, device=args.device,
               progress=not args.no_progress, decode_attention=args.decode_attention,
               chat_template=args.chat_template)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    # SIGTERM (a scheduler, a time limit, torchrun passing on Ctrl-C) stops like Ctrl-C: the conversations already
    # answered are written before the process ends, and --resume continues from there
    try:
        with StopRequest(interrupt=True):
            try:
                template_kwargs = json.loads(args.chat_template_kwargs)
            except json.JSONDecodeError as e:
                raise UserError(f"--chat-template-kwargs {args.chat_template_kwargs!r} is not JSON ({e}); "
                                """write e.g. '{"enable_thinking": false}'""") from None
            with disk_full_is_user_error(args.out, then="run the same command again with --resume"):
                _regenerate_args(args, template_kwargs)
    except BadSample as e:  # other user errors propagate to dflashkit.cli.run_main (one line, exit 2)
        raise UserError(f"{e}; fix the record, or pass --on-bad skip") from None
    except KeyboardInterrupt:
        print(f"dflashkit regenerate: stopped; the conversations answered so far are in {args.out} (or its rank "
              "parts): run the same command with --resume to continue", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    from dflashkit.cli import run_main

    sys.exit(run_main("dflashkit regenerate", main))
