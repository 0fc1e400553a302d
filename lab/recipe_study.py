"""The recipe study: train one drafter per recipe variant (online, side by side on one GPU), evaluate each export
live (chain, MT-bench), and tabulate tau, per-position acceptance, steps and wall times.

One H200, the testbed (lab/testbed_data.py, then `dflashkit regenerate --max-turns 1 --max-new-tokens 256`):
    python -m lab.recipe_study --target /root/testbed/smollm2-bf16 --data regen.jsonl --out runs/bench/study \\
        --variants default,muon,anchors_per_token,tokens_8k --epochs 1 --parallel 4
    python -m lab.recipe_study ... --variants default,muon,mine:lr=1e-3,optimizer=muon --epochs 3 --parallel 3
CPU toy (a check that every stage runs, not a measurement; lab/tests/test_recipe_study.py):
    python -m lab.recipe_study --target TINY_DIR --data chats.jsonl --out /tmp/study --variants default,muon \\
        --epochs 1 --parallel 2 --device cpu --num-prompts 2 --max-new-tokens 8 \\
        --extra-overrides max_steps=2,num_hidden_layers=1,compile=false,mixed_precision=no

Each variant is `python -m dflashkit.train --recipe R --target T --data D output_dir=... epochs=N <extra overrides>
<the variant's overrides>` followed by `python -m dflashkit.eval --target T --drafter <its export> --dataset
builtin:mtbench --mode chain ...`; up to --parallel variants run at once (tau does not depend on timing; wall
times and tokens/s of runs sharing a GPU are not comparable with solo runs). A variant's failure is recorded in the
results and does not stop the others. As soon as a run writes its summary.json / metrics.jsonl, or its eval its
report.json, they are copied to OUT/results/NAME/ (checkpoints stay under OUT/work/), and OUT/results.json and
OUT/results.md are rewritten, so a session can copy results out stage by stage. A variant whose results are
already in OUT is not run again (--rerun runs it again). `--stage train` stops each variant at its export
(status "trained") and a later `--stage eval` over the same OUT evaluates those exports, so the GPU can serve other
work in between (lab/testbed_engine_run.sh); it evaluates again a row whose evaluation was cut by
--eval-time-limit (status "eval_partial"), failed or was killed. `--combine SCREEN/results.json` adds `combo`,
every variant of an earlier (screening) study that beat its `default` row, at once (lab/testbed_recipe_run.sh: a
1-epoch screen, then the combination at 3 epochs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import run_stage, say
from dflashkit.errors import UserError
from dflashkit.train.checkpoint import latest_checkpoint

ROOT = Path(__file__).resolve().parents[1]
SLIDING_4_FULL_1 = "[sliding_attention,sliding_attention,sliding_attention,sliding_attention,full_attention]"

# name -> TrainConfig overrides on top of the recipe (`{epochs}` is --epochs, `{double_epochs}` twice it,
# `{half_epochs}` half of it, at least 1). Each comment says what is compared.
VARIANTS: dict[str, list[str]] = {
    # the recipe as it is (recipes/smollm2-135m.yaml: 16k tokens per step and AdamW in lab/NOTEBOOK.md's first screen,
    # 8k and Muon in its second, 4k and Muon since); 512 anchors per sequence, cosine
    "default": [],
    "seed_1": ["seed=1"],  # the default again with another seed (init, split, data order, anchors): the noise
    "muon": ["optimizer=muon"],  # Muon on the 2-D matrices, AdamW on the rest, same lr (train/muon.py)
    # the recipe's Muon with Newton-Schulz in fp32 (the recipe's auto runs it in bf16 on a GPU: 1.09x its step)
    "muon_ns_fp32": ["muon_ns_dtype=float32"],
    "adamw": ["optimizer=adamw"],  # AdamW on every weight (the recipe's optimizer before the study)
    "anchors_per_token": ["anchor_density=0.375"],  # 3072 blocks per 8192 packed tokens instead of 512 per sequence
    "tokens_8k": ["micro_batch_tokens=8192"],  # 8k tokens per optimizer step (16k before the study): twice the steps
    "tokens_4k": ["micro_batch_tokens=4096"],  # 4k tokens per step (TrainConfig's default): twice the steps of 8k
    "linear_decay": ["lr_schedule=linear"],  # linear decay to min_lr after warmup instead of cosine
    # 4 sliding-window layers (causal in the block) + 1 full, as recipes/qwen3.6-27b.yaml; vLLM 0.24 serves such a
    # drafter as full attention (docs/ARCHITECTURE.md), so a win here is not a default for vLLM users
    "sliding_window": [f"layer_types={SLIDING_4_FULL_1}", "sliding_window=2048"],
    "target_argmax": ["labels=target_argmax"],  # labels = the target's greedy token at each position, not the data's
    "kl": ["loss=kl", "kl_weight=0.5"],  # half KL(target || draft) on the target's distribution, half CE
    "lr_1e3": ["lr=1e-3"],  # a higher peak lr (6e-4 today)
    "lr_2x": ["lr=1.2e-3"],  # twice the peak lr
    "longer": ["epochs={double_epochs}"],  # twice the epochs (longer training on the same data)
    "dflash2": ["drafter_architecture=dflash2"],  # the DFlash2 drafter (in-block convolutions + candidate selector)
    # DFlash2 with the selector's term reaching the drafter through its unary logits too (the public trainers')
    "dflash2_coupled": ["drafter_architecture=dflash2", "selector_unary_grad=true"],
    # and its positions weighted and normalised as the block loss's (SpecForge's form of the term)
    "dflash2_loss_weighted": ["drafter_architecture=dflash2", "selector_unary_grad=true", "selector_weights=loss"],
    # the coupled form with the codebooks at 10x the lr (a public trainer's; a codebook row moves only when drawn)
    "dflash2_codebook_lr": ["drafter_architecture=dflash2", "selector_unary_grad=true",
                            "selector_codebook_lr_scale=10"],
    # the coupled form with a missing label put among the candidates, so every valid position has a term
    # (speculators' form: the drafter's logit of the label rises against its top_k)
    "dflash2_injected": ["drafter_architecture=dflash2", "selector_unary_grad=true", "selector_missing_label=inject"],
    # DFlash2 whose layers learn from the block loss alone (the selector's term stops at its projection): is its
    # position-1 deficit against DFlash (lab/NOTEBOOK.md "DFlash beside DFlash2") the selector's pull on the layers?
    # Not by the one screen that ran it: behind the coupled form (lab/NOTEBOOK.md "The recipe's rows on every
    # answered turn")
    "dflash2_detached": ["drafter_architecture=dflash2", "selector_hidden_grad=false"],
    # DFlash2 with four taps in its in-block convolution instead of two (each position mixes the three before it);
    # at a 1,500-step screen +0.009 on MT-bench, +0.040 on HumanEval (lab/NOTEBOOK.md "DFlash2's sizes screened")
    "dflash2_kernel4": ["drafter_architecture=dflash2", "drafter={conv_kernel_size: 4}"],
    # DFlash2 whose selector chooses among each position's top 32 tokens instead of 16 (the same screen: no better)
    "dflash2_top32": ["drafter_architecture=dflash2", "drafter={selector_top_k: 32}"],
    # the DSpark drafter (DFlash + Markov and confidence heads, the paper's objective; vLLM 0.26 V2 serves it); its
    # term reads the target's distribution, so the run trains online or on shards with last_hidden
    "dspark": ["drafter_architecture=dspark"],
    "causal": ["causal=true"],  # causal inside the block, whole context: one drafter for every k (the recipe's)
    "non_causal": ["causal=false"],  # the block non-causal, as every recipe before the serving plan
    # more target-written data from the same prompts: a sampled answer per prompt beside the greedy one
    # (`--extra-data`, e.g. `dflashkit regenerate --temperature 0.8 --top-p 0.95 --seed 1`); not equal data
    "extra_answers": ["data+={extra_data}"],
    # the same, in half the epochs: about the default's steps, each step's answers twice as varied
    "extra_answers_same_steps": ["data+={extra_data}", "epochs={half_epochs}"],
    # runs planned to end early (the schedule decays by then, unlike a longer run stopped by time): what a budget of
    # a few minutes reaches (lab/NOTEBOOK.md "time to quality": τ 2.0 took ~1,500 steps of the 3-epoch schedule)
    "steps_1000": ["max_steps=1000"],
    "steps_1400": ["max_steps=1400"],
    # the schedule that could fit 300 s end to end at ~0.1 s a step (one H100 after the compile fixes, lab/NOTEBOOK.md
    # "Time to quality after the compile fixes": 37 s answering, 48 s to step 10), where 1,400 steps gave live 1.86
    "steps_2000": ["max_steps=2000"],
    "steps_1000_anchors": ["max_steps=1000", "anchor_density=0.375"],  # and the study's faster steps
    "steps_1400_anchors": ["max_steps=1400", "anchor_density=0.375"],  # as many steps in ~the time of 1,000
}
# variants that never go into a combination of winners (--combine): a layout vLLM 0.24 serves differently
# (docs/ARCHITECTURE.md), more data or more or fewer steps than the study compares at, another architecture
NOT_COMBINED = ("sliding_window", "extra_answers", "extra_answers_same_steps", "longer", "dflash2", "dflash2_coupled",
                "dflash2_loss_weighted", "dflash2_codebook_lr", "dflash2_injected", "dflash2_detached",
                "dflash2_kernel4", "dflash2_top32", "dspark", "steps_1000", "steps_1400", "steps_2000",
                "steps_1000_anchors", "steps_1400_anchors")


def is_replicate(overrides) -> bool:
    """A row that only changes the seed: the default again, a measure of the noise and never a winner."""
    return bool(overrides) and all(override_key(o) == "seed" for o in overrides)


def split_top_level(text: str, sep: str = ",") -> list[str]:
    """Split at ``sep`` outside brackets and braces (so ``layer_types=[a,b]`` stays one item)."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "[{"
        depth -= ch in "]}"
        if ch == sep and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def parse_variants(specs: list[str]) -> dict[str, list[str]]:
    """``default,muon,mine:lr=1e-3,loss=kl`` -> {default: [...], muon: [...], mine: [lr=1e-3, loss=kl]}: a name
    from VARIANTS, or ``name:key=value`` starting a new variant whose further ``key=value`` items follow it."""
    chosen: dict[str, list[str]] = {}
    current = None
    for spec in specs:
        for item in split_top_level(spec):
            if ":" in item.split("=", 1)[0]:
                name, first = item.split(":", 1)
                current = name.strip()
                if not current or "=" not in first:
                    raise UserError(f"--variants {item!r}: write NAME:key=value[,key=value...]")
                if current in chosen:
                    raise UserError(f"--variants: {current!r} is given twice; pick another name")
                chosen[current] = [first.strip()]
            elif "=" in item:
                if current is None:
                    raise UserError(f"--variants {item!r}: a key=value belongs to a variant; write NAME:{item}")
                chosen[current].append(item)
            else:
                if item not in VARIANTS:
                    raise UserError(f"--variants: unknown variant {item!r}; known: {', '.join(VARIANTS)} "
                                    f"(or define one as NAME:key=value,...)")
                chosen[item], current = list(VARIANTS[item]), None
    if not chosen:
        raise UserError("--variants: name at least one variant")
    return chosen


def fill(item: str, **values) -> str:
    """``epochs={double_epochs}`` with its placeholders filled; other braces stay (``drafter={selector_top_k: 32}``
    is a YAML mapping, not a placeholder)."""
    for key, value in values.items():
        item = item.replace("{" + key + "}", str(value))
    return item


def override_key(item: str) -> str:
    return item.split("=", 1)[0].strip()


# the statuses of a row whose training ended with its export: `--stage eval` evaluates it (again, after an evaluation
# that was cut by --eval-time-limit, failed or killed)
TRAINED = ("trained", "evaluating", "eval_partial", "eval_failed")


def evaluated(row: dict) -> bool:
    return row.get("status") in ("done", "eval_partial") and isinstance(row.get("tau"), (int, float))


def screen_margin(rows: dict[str, dict], margin: float) -> float:
    """``margin``, or the largest |tau(replicate) - tau(default)| of the screen's seed replicates if larger."""
    base = rows["default"]["tau"]
    spread = [abs(r["tau"] - base) for r in rows.values() if evaluated(r) and is_replicate(r.get("overrides"))]
    return max([margin, *spread])


def combine_winners(rows: dict[str, dict], margin: float, exclude=NOT_COMBINED) -> tuple[list[str], list[str]]:
    """The winners of a screening study: every evaluated variant whose live tau beats the ``default`` row's by more
    than the margin, best first, with the variants in ``exclude`` left out; where two winners set the same key
    (``lr=1e-3`` and ``lr=1.2e-3``) only the better one is kept. Returns (winner names, their overrides).
    The margin is ``margin`` or, where the screen has replicates of the default (rows that only set ``seed``), the
    largest distance between a replicate's tau and the default's, whichever is larger: a winner must beat the
    default by more than a change of seed moves it. Replicates are never winners.
    A row cut by the eval time limit (``eval_partial``) counts with the tau of the prompts it finished (the first
    ones, in the dataset's order): the GPU run of lab/NOTEBOOK.md cut every screen row at 69-76 of 80 prompts."""
    base = rows.get("default", {})
    if not evaluated(base):
        raise UserError("--combine: the screening results have no evaluated 'default' row to compare with")
    margin = screen_margin(rows, margin)
    done = [(r["tau"], name) for name, r in rows.items() if name != "default" and name not in exclude
            and evaluated(r) and not is_replicate(r.get("overrides"))]
    names, overrides, keys = [], [], set()
    for tau, name in sorted(done, reverse=True):
        own = list(rows[name].get("overrides") or [])
        if tau <= base["tau"] + margin or not own or keys & {override_key(o) for o in own}:
            continue
        names.append(name)
        overrides += own
        keys |= {override_key(o) for o in own}
    return names, overrides


def combined_variants(results_json: Path, margin: float) -> dict[str, list[str]]:
    """``combo`` = every winner of the screen in ``results_json`` at once; with two or more winners also
    ``combo_minus_W`` = the combination without its weakest winner W (what the last one adds)."""
    rows = json.loads(Path(results_json).read_text()).get("variants", {})
    names, overrides = combine_winners(rows, margin)
    if not names:
        return {}
    out = {"combo": overrides}
    if len(names) >= 2:
        weakest = set(rows[names[-1]].get("overrides") or [])
        out[f"combo_minus_{names[-1]}"] = [o for o in overrides if o not in weakest]
    margin = screen_margin(rows, margin)
    say(f"--combine: winners over default (tau {rows['default']['tau']:.3f} + {margin:.3f}): "
        + (", ".join(f"{n} {rows[n]['tau']:.3f}" for n in names)) + f" -> combo: {' '.join(overrides)}")
    return out


def log_tail(log: Path, lines: int = 3) -> str:
    text = log.read_text(errors="replace").strip().splitlines()[1:] if log.is_file() else []  # [0]: the command
    return " | ".join(t for t in text if t.strip())[-600:] if len(text) <= lines else " | ".join(text[-lines:])[-600:]


def train_numbers(run_dir: Path) -> dict:
    """Steps, held-out metrics and tokens/s from a run's summary.json and metrics.jsonl."""
    out: dict = {}
    summary = run_dir / "summary.json"
    if summary.is_file():
        s = json.loads(summary.read_text())
        out.update({k: s.get(k) for k in ("step", "planned_steps", "epochs_completed", "stopped_by_max_steps")})
        out.update({k: v for k, v in s.items() if k.startswith("eval/")})
    rates, last_step = [], None
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            row = json.loads(line) if line.strip() else {}
            if "tokens_per_s" in row:
                rates.append(float(row["tokens_per_s"]))
            last_step = row.get("step", last_step)
    if rates:  # the first window holds the compilation: the median is the steady rate
        out["train_tokens_per_s_median"] = statistics.median(rates)
        out["train_tokens_per_s_windows"] = len(rates)
    out.setdefault("step", last_step)
    return out


def finished_before_stop(run_dir: Path, started: float) -> bool:
    """Whether the trainer in ``run_dir`` exported and wrote summary.json (its last act, after the export) since
    ``started`` (time.time()): a run the time limit's SIGINT reached only while its process was ending, whose exit
    status is then the signal's although nothing was lost (a 1,400-step run on the H200, 2026-12-04, exported at
    406 s and was counted failed at the 420 s limit). A summary.json older than ``started`` is an earlier run's."""
    summary = run_dir / "summary.json"
    return (summary.is_file() and summary.stat().st_mtime >= started
            and (run_dir / "export" / "config.json").is_file())


def train_outcome(rc: int, stopped: bool, run_dir: Path, started: float) -> str:
    """What a training process left, from its exit status, whether our time limit stopped it and its files:
    "exported" (its export stands: it ended well, or the limit reached it only while it was ending), "checkpoint"
    (it ended well or the limit stopped it, without an export: its newest verified checkpoint, if any, is
    exported) or "failed" (it failed on its own: nothing of it is exported)."""
    exported = (run_dir / "export" / "config.json").is_file()
    if exported and (rc == 0 or (stopped and finished_before_stop(run_dir, started))):
        return "exported"
    return "checkpoint" if rc == 0 or stopped else "failed"


class Study:
    def __init__(self, args, variants: dict[str, list[str]]):
        self.args, self.variants = args, variants
        self.out = Path(args.out)
        self.work = Path(args.work_dir) if args.work_dir else self.out / "work"
        self.results_path = self.out / "results.json"
        self.lock = threading.Lock()
        self.rows: dict[str, dict] = {}
        if self.results_path.is_file() and not args.rerun:
            self.rows = json.loads(self.results_path.read_text()).get("variants", {})
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        self.env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // max(1, args.parallel))))
        if args.device == "cpu":
            self.env["CUDA_VISIBLE_DEVICES"] = ""  # training picks the GPU when it sees one

    # --- results on disk ---------------------------------------------------------------------------------------
    def record(self, name: str, **fields) -> None:
        with self.lock:
            self.rows.setdefault(name, {}).update(fields)
            self.out.mkdir(parents=True, exist_ok=True)
            study = {k: v for k, v in vars(self.args).items() if k not in ("func",)}
            tmp = self.results_path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"study": study, "variants": self.rows}, indent=1))
            tmp.replace(self.results_path)
            (self.out / "results.md").write_text(markdown_table(self.rows))

    def keep(self, name: str, *files: Path) -> None:
        """Copy a run's small result files into OUT/results/NAME/ (checkpoints stay in the work dir)."""
        dest = self.out / "results" / name
        dest.mkdir(parents=True, exist_ok=True)
        for f in files:
            if f.is_file():
                shutil.copy2(f, dest / f.name)

    # --- one variant: train, export, evaluate --------------------------------------------------------------
    def run_variant(self, name: str) -> None:
        a = self.args
        items = [fill(o, epochs=a.epochs, double_epochs=2 * a.epochs, half_epochs=max(1, a.epochs // 2),
                      extra_data=a.extra_data or "")
                 for o in self.variants[name]]
        extra_data = [o.split("=", 1)[1] for o in items if o.startswith("data+=")]  # more --data for this one
        overrides = [o for o in items if not o.startswith("data+=")]
        if any(not d for d in extra_data):
            self.record(name, overrides=items, status="train_failed", error="data+= needs a path (--extra-data)")
            say(f"{name}: data+= without a path: give --extra-data")
            return
        previous = self.rows.get(name, {})
        if previous.get("status") == "done" and not a.rerun:
            say(f"{name}: done in an earlier run of the study (tau {previous.get('tau')}); --rerun runs it again")
            return
        run_dir, eval_dir = self.work / "train" / name, self.work / "eval" / name
        if a.stage == "eval":  # the export of an earlier `--stage train` of this study
            if previous.get("status") not in TRAINED:
                say(f"{name}: --stage eval needs an earlier --stage train over this --out ({self.out}/results.json "
                    f"has {previous.get('status') or 'no row'} for it); skipped")
                self.record(name, status="not_trained", error="no finished training of an earlier --stage train")
                return
            if not (run_dir / "export" / "config.json").is_file():
                say(f"{name}: --stage eval needs the export of an earlier --stage train in {run_dir}; skipped")
                self.record(name, status="eval_failed", error="no export of an earlier --stage train")
                return
            self.evaluate(name, run_dir / "export", eval_dir)
            return
        if a.rerun:  # from scratch; otherwise an unfinished run resumes from its checkpoints (resume=auto)
            shutil.rmtree(run_dir, ignore_errors=True)
        logs = self.out / "results" / name
        logs.mkdir(parents=True, exist_ok=True)
        self.record(name, overrides=items, status="training", error=None)
        cmd = [sys.executable, "-m", "dflashkit.train", "--recipe", a.recipe, "--target", a.target,
               *[x for d in [*a.data, *extra_data] for x in ("--data", d)], f"output_dir={run_dir}",
               f"epochs={a.epochs}",
               "wandb=false", "progress=false", *a.extra_overrides, *overrides]
        say(f"{name}: training ({' '.join(items) or 'no overrides'})")
        started = time.time()
        rc, wall, stopped = run_stage(cmd, logs / "train.log", self.env, a.train_time_limit)
        self.keep(name, run_dir / "summary.json", run_dir / "metrics.jsonl")
        numbers = train_numbers(run_dir)
        self.record(name, train_rc=rc, train_wall_s=round(wall, 1), train_stopped_by_time_limit=stopped, **numbers)
        export = run_dir / "export"
        outcome = train_outcome(rc, stopped, run_dir, started)
        if outcome == "exported" and rc != 0:
            say(f"{name}: the time limit came after the run had exported (exit {rc} while it ended); kept")
        if outcome != "exported":  # the newest verified checkpoint is the one resume=auto would take
            ckpt = latest_checkpoint(run_dir, warn=say) if outcome == "checkpoint" else None
            if ckpt is None:  # failed, or stopped before its first checkpoint
                say(f"{name}: training failed (exit {rc}) after {wall:.0f} s: {log_tail(logs / 'train.log')}")
                self.record(name, status="train_failed", error=log_tail(logs / "train.log"))
                return
            say(f"{name}: stopped at {ckpt.name} by the time limit; exporting that checkpoint")
            rc_x, _, _ = run_stage([sys.executable, "-m", "dflashkit.train.export", str(ckpt), str(export)],
                                    logs / "export.log", self.env, None)
            if rc_x != 0:
                self.record(name, status="export_failed", error=log_tail(logs / "export.log"))
                return
        if a.stage == "train":
            say(f"{name}: trained in {wall:.0f} s ({numbers.get('step')} steps); --stage eval evaluates it")
            self.record(name, status="trained")
            return
        say(f"{name}: trained in {wall:.0f} s ({numbers.get('step')} steps); evaluating")
        self.evaluate(name, export, eval_dir)

    def evaluate(self, name: str, export: Path, eval_dir: Path) -> None:
        a = self.args
        logs = self.out / "results" / name
        shutil.rmtree(eval_dir, ignore_errors=True)
        self.record(name, status="evaluating")
        cmd = [sys.executable, "-m", "dflashkit.eval", "--target", a.target, "--drafter", str(export),
               "--dataset", *a.dataset, "--num-prompts", str(a.num_prompts), "--mode", "chain",
               "--max-new-tokens", str(a.max_new_tokens), "--dtype", a.dtype,
               "--baseline-prompts", str(a.baseline_prompts), "--out", str(eval_dir)]
        if a.device:
            cmd += ["--device", a.device]
        if a.eval_time_limit:
            cmd += ["--time-limit", str(a.eval_time_limit)]
        rc, wall, _ = run_stage(cmd, logs / "eval.log", self.env, None)
        self.keep(name, eval_dir / "report.json", eval_dir / "report.md")
        report_path = eval_dir / "report.json"
        if not report_path.is_file():
            say(f"{name}: eval failed (exit {rc}) after {wall:.0f} s: {log_tail(logs / 'eval.log')}")
            self.record(name, status="eval_failed", eval_rc=rc, eval_wall_s=round(wall, 1),
                        error=log_tail(logs / "eval.log"))
            return
        report = json.loads(report_path.read_text())
        overall = report["overall"]
        self.record(name, status="done" if rc == 0 else "eval_partial", eval_rc=rc, eval_wall_s=round(wall, 1),
                    tau=overall["tau"], rounds=overall.get("rounds"),
                    per_position_acceptance=overall.get("per_position_acceptance"),
                    eval_partial="partial" in report)
        say(f"{name}: tau {overall['tau']:.3f} (eval {wall:.0f} s)")

    def run(self) -> dict:
        say(f"study: {len(self.variants)} variant(s) {', '.join(self.variants)}, {self.args.parallel} at a time; "
            f"results in {self.out}")
        with ThreadPoolExecutor(max_workers=max(1, self.args.parallel)) as pool:
            futures = {name: pool.submit(self.run_variant, name) for name in self.variants}
            for name, fut in futures.items():
                try:
                    fut.result()
                except Exception as error:  # a harness bug in one variant must not hide the others' results
                    self.record(name, status="harness_error", error=f"{type(error).__name__}: {error}")
                    say(f"{name}: harness error {type(error).__name__}: {error}")
        print(markdown_table({k: self.rows[k] for k in self.variants if k in self.rows}))
        return self.rows


def markdown_table(rows: dict[str, dict], positions: int = 6) -> str:
    head = ["variant", "overrides", "τ", *[f"acc_{k}" for k in range(1, positions + 1)], "steps", "train s",
            "tokens/s", "eval s", "τ_walk (held-out)", "status"]

    def num(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else ""

    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in rows.items():
        acc = list(r.get("per_position_acceptance") or [])[:positions]
        cells = [name, " ".join(r.get("overrides") or []) or "(recipe)", num(r.get("tau"), ".3f"),
                 *[num(x, ".3f") for x in acc + [None] * (positions - len(acc))], num(r.get("step"), "d"),
                 num(r.get("train_wall_s"), ".0f"), num(r.get("train_tokens_per_s_median"), ".0f"),
                 num(r.get("eval_wall_s"), ".0f"), num(r.get("eval/tau_walk"), ".3f"), r.get("status", "")]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_argument_group("what to train")
    what.add_argument("--target", required=True, help="the target (HF dir, .gguf, testbed:smollm2)")
    what.add_argument("--data", required=True, action="append", help="chat data for online training (repeatable)")
    what.add_argument("--recipe", default=str(ROOT / "recipes" / "smollm2-135m.yaml"))
    what.add_argument("--variants", action="append", default=[],
                      help=f"comma-separated: names from {{{','.join(VARIANTS)}}} or NAME:key=value,key=value")
    what.add_argument("--epochs", type=int, default=3)
    what.add_argument("--extra-data", default="", help="chat data that variants with data+={extra_data} train on "
                                                        "besides --data (extra_answers)")
    what.add_argument("--combine", default="", metavar="RESULTS_JSON",
                      help="add the variants 'combo' (every winner of that screening study over its default row at "
                           "once) and, with two or more winners, 'combo_minus_W' (without the weakest W)")
    what.add_argument("--combine-margin", type=float, default=0.01,
                      help="a winner beats the default's tau by more than this (or by more than a seed "
                           "replicate of the default differs from it, if the screen has one: a row NAME:seed=N)")
    what.add_argument("--extra-overrides", default="", help="key=value,... applied to every run before the "
                                                            "variant's own (toy sizes, max_steps)")
    run = p.add_argument_group("how to run")
    run.add_argument("--out", required=True, help="results.json, results.md, results/NAME/ (logs, reports)")
    run.add_argument("--work-dir", default="", help="run and eval directories (default OUT/work)")
    run.add_argument("--parallel", type=int, default=1, help="variants trained (and evaluated) at once")
    run.add_argument("--rerun", action="store_true", help="run again the variants already done in OUT")
    run.add_argument("--stage", choices=["all", "train", "eval"], default="all",
                     help="train: train and export only (status 'trained'); eval: evaluate the exports of an "
                          "earlier --stage train over the same OUT and work dir (the GPU free for other work between)")
    run.add_argument("--train-time-limit", type=float, default=None, metavar="S",
                     help="stop a training after S seconds (it checkpoints; that checkpoint is exported)")
    run.add_argument("--eval-time-limit", type=float, default=None, metavar="S", help="eval --time-limit")
    ev = p.add_argument_group("evaluation (dflashkit eval)")
    ev.add_argument("--dataset", nargs="+", default=["builtin:mtbench"])
    ev.add_argument("--num-prompts", type=int, default=80, help="per dataset (80 = all of MT-bench)")
    ev.add_argument("--max-new-tokens", type=int, default=256)
    ev.add_argument("--dtype", default=None, help="default: bfloat16, float32 with --device cpu")
    ev.add_argument("--device", default=None, help="cpu: train and evaluate on the CPU (default: the GPU)")
    ev.add_argument("--baseline-prompts", type=int, default=0,
                    help="autoregressive baseline prompts (0: tau only; speedups of parallel runs mean little)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.extra_overrides = split_top_level(args.extra_overrides)
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    try:
        variants = parse_variants(args.variants or ["default"]) if args.variants or not args.combine else {}
        if args.combine:
            combined = combined_variants(Path(args.combine), args.combine_margin)
            if not combined:
                say(f"--combine: no variant of {args.combine} beats its default by more than "
                    f"{args.combine_margin} (or than a seed replicate differs from it); nothing to combine")
            variants.update(combined)
    except (UserError, json.JSONDecodeError, OSError) as error:  # the flags and the --combine file
        print(f"recipe_study: error: {error}", file=sys.stderr)
        return 2
    if not variants:
        return 0
    rows = Study(args, variants).run()
    finished = "trained" if args.stage == "train" else "done"
    return 0 if all(rows.get(n, {}).get("status") == finished for n in variants) else 1


if __name__ == "__main__":
    sys.exit(main())
