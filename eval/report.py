"""Metrics of an evaluation run, and the files that hold them: report.json, report.md, PNG plots.

Design choices:
- Names follow docs/ARCHITECTURE.md: tau = mean over verification rounds of tokens produced (accepted drafts + bonus);
  per-position acceptance = fraction of rounds whose draft position k was accepted; speedup = AR wall time /
  speculative wall time over the same prompts in the same harness (prefill included in both).
- verify_over_ar_step = mean target forward of a speculative round / mean autoregressive step: the cost of
  checking N nodes instead of one token, independent of Python overhead elsewhere.
- The cost model: a round costs one draft and one verify, and yields tau tokens, where AR yields one token per
  step, so the expected speedup is tau / (verify/AR + draft/AR). The report prints it beside the measured
  speedup (and their ratio): a measured speedup well below it means time goes somewhere the model does not count.
  Both sides cover the same prompts: the model's tau, verify and draft come from the speculative runs of the
  baseline prompts (`cost_model_inputs`), and the ratio divides the measured speedup per token (AR time per new
  token / speculative time per new token, prefill included) by the model, which is a per-token prediction. With
  the same outputs it equals the wall-time speedup; in bf16 a near-tie can part the outputs and end them at
  different lengths (`paired_tokens` shows both counts), which the wall-time ratio would read as speed.
- The lossless check (greedy runs) is eval/lossless.py's, against an independent reference; report.md says it
  in words. A partial run (stopped early) says so at the top.
- matplotlib is imported only when plots are written, with the Agg backend (no display needed).
- outputs.jsonl (the local engine's runs; `--engine vllm --per-prompt`'s): one line per prompt, its dataset and
  id, the prompt's length, the rounds and their tokens (τ of the prompt) and the answer's token ids. A
  round's tokens are its accepted drafts and its bonus token before the cap at --max-new-tokens, as vLLM's
  counters count them (the report's τ counts the tokens kept: a capped answer's last round counts less).
  `--compare` pairs the prompts of reports that have one (eval/compare.py).
- A report directory holds only eval's files (`REPORT_FILES`): `dflashkit eval` refuses an --out that holds
  anything else, or an earlier report, unless --overwrite (`report_dir_problem`); nothing of the user's is replaced.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflashkit.files import atomic_write

from .decoder import GenerationResult

# every file `dflashkit eval` writes into --out, in any of its modes (local and vLLM reports, --server, --compare)
REPORT_FILES = ("report.json", "report.md", "acceptance_histogram.png", "per_position_acceptance.png",
                "tau_per_dataset.png", "speedup_vs_concurrency.png", "serving.json", "serving.md", "compare.md",
                "tau_compare.png", "schedule.json", "engines.partial.jsonl", "outputs.jsonl")



def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def summarize(spec: list[GenerationResult], ar: list[GenerationResult] | None, block_size: int,
              paired: list[GenerationResult] | None = None) -> dict:
    """Numbers for one dataset (or all of them): spec and ar are per-prompt results in the same order.

    ar may cover only the first prompts (``--baseline-prompts``): speedup and the lossless check then compare
    those prompts with their own speculative runs (``paired``, default the first len(ar) of spec); tau and
    acceptance use every prompt.
    """
    lengths = [n for r in spec for n in r.acceptance_lengths]
    accepted = [n for r in spec for n in r.accepted_drafts]
    rounds = len(lengths)
    histogram = {str(k): sum(1 for n in lengths if n == k) for k in range(1, max(lengths, default=1) + 1)}
    spec_tokens = sum(len(r.tokens) for r in spec)
    spec_wall = sum(r.prefill_s + r.decode_s for r in spec)
    out = {
        "prompts": len(spec),
        "tau": _mean(lengths),
        "rounds": rounds,
        "acceptance_histogram": histogram,
        "per_position_acceptance": [_mean(a >= k for a in accepted) for k in range(1, block_size)],
        "mean_nodes_per_round": _mean(n for r in spec for n in r.nodes_per_round),
        "new_tokens": spec_tokens,
        "spec_tokens_per_s": spec_tokens / spec_wall if spec_wall else 0.0,
        "spec_decode_tokens_per_s": sum(len(r.tokens) - 1 for r in spec) / max(sum(r.decode_s for r in spec), 1e-12),
        "draft_ms_per_round": 1e3 * sum(r.draft_s for r in spec) / max(rounds, 1),
        "verify_ms_per_round": 1e3 * sum(r.verify_s for r in spec) / max(rounds, 1),
    }
    if ar:
        paired = spec[:len(ar)] if paired is None else paired
        assert len(paired) == len(ar), "each baseline run needs its speculative run"
        paired_wall = sum(r.prefill_s + r.decode_s for r in paired)
        paired_tokens = sum(len(r.tokens) for r in paired)
        paired_rounds = max(sum(len(r.acceptance_lengths) for r in paired), 1)
        ar_tokens = sum(len(r.tokens) for r in ar)
        ar_wall = sum(r.prefill_s + r.decode_s for r in ar)
        ar_steps = sum(len(r.tokens) - 1 for r in ar)
        ar_step_ms = 1e3 * sum(r.decode_s for r in ar) / max(ar_steps, 1)
        per_token = (ar_wall / ar_tokens) / (paired_wall / paired_tokens) if paired_wall and ar_tokens else 0.0
        inputs = {"prompts": len(paired), "tau": sum(n for r in paired for n in r.acceptance_lengths) / paired_rounds,
                  "verify_ms_per_round": 1e3 * sum(r.verify_s for r in paired) / paired_rounds,
                  "draft_ms_per_round": 1e3 * sum(r.draft_s for r in paired) / paired_rounds,
                  "ar_step_ms": ar_step_ms}
        cost = (inputs["verify_ms_per_round"] + inputs["draft_ms_per_round"]) / ar_step_ms if ar_step_ms else 0.0
        out.update({
            "ar_tokens_per_s": ar_tokens / ar_wall if ar_wall else 0.0,
            "ar_step_ms": ar_step_ms,
            "baseline_prompts": len(ar),
            "speedup": ar_wall / paired_wall if paired_wall else 0.0,
            "speedup_per_token": per_token,
            "paired_tokens": {"speculative": paired_tokens, "autoregressive": ar_tokens},
            "verify_over_ar_step": out["verify_ms_per_round"] / ar_step_ms if ar_step_ms else 0.0,
            "draft_over_ar_step": out["draft_ms_per_round"] / ar_step_ms if ar_step_ms else 0.0,
            "cost_model_speedup": inputs["tau"] / cost if cost else 0.0,
            "cost_model_inputs": inputs,
        })
        out["speedup_over_cost_model"] = (per_token / out["cost_model_speedup"]
                                          if out["cost_model_speedup"] else 0.0)
    return out


def markdown_table(rows: list[list], header: list[str]) -> str:
    """A markdown table: floats to three decimals, None as a dash."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return "—" if value is None else str(value)


# what the speedup of this harness is, wherever it is shown: users serve with an engine, whose speedup differs
HARNESS_WORDS = "harness speedup: dflashkit's own decode loop, not a serving engine"
SUMMARY_FIELDS = [("tau", "τ"), ("rounds", "rounds"), ("mean_nodes_per_round", "nodes/round"),
                  ("spec_tokens_per_s", "spec tok/s"), ("ar_tokens_per_s", "AR tok/s"),
                  ("speedup", "harness speedup"), ("speedup_per_token", "harness speedup per token"),
                  ("cost_model_speedup", "cost model τ/(verify/AR + draft/AR)"),
                  ("speedup_over_cost_model", "per token/model"), ("verify_ms_per_round", "verify ms"),
                  ("draft_ms_per_round", "draft ms"), ("ar_step_ms", "AR step ms"),
                  ("verify_over_ar_step", "verify/AR step"), ("draft_over_ar_step", "draft/AR step"),
                  ("baseline_prompts", "AR baseline prompts")]


def _template_words(args: dict) -> str:
    """Which chat template the prompts were rendered with, from where (eval/chat_settings.py)."""
    if "chat_template_from" not in args:  # a report from before the template was recorded
        return "not recorded"
    sha = args.get("chat_template_sha256")
    return f"{'`' + sha[:12] + '`' if sha else 'of the target'} (from {args['chat_template_from']})"


def render_markdown(report: dict) -> str:
    if report.get("engine") == "vllm":  # `eval --engine vllm`: its verdict, concurrency and prefix-cache tables
        from .serving_verdict import render_vllm_markdown

        return render_vllm_markdown(report)
    from .lossless import describe

    args = report["args"]
    partial = report.get("partial")
    parts = [f"# Acceptance report: {args.get('mode')} mode" + (" (PARTIAL)" if partial else "")]
    if partial:
        parts += [f"**Partial**: stopped by {partial['reason']} after {partial['prompts_done']} of "
                  f"{partial['prompts_planned']} prompts; the numbers cover the prompts done.", ""]
    recorded = report["drafter"].get("chat_template_kwargs")
    trained = ("the drafter's config.json does not record its training kwargs" if recorded is None
               else f"drafter trained with `{json.dumps(recorded)}`")
    sampling = (f"temperature {args.get('temperature')}, top-p {args.get('top_p')}, top-k {args.get('top_k')}"
                if args.get("temperature") else "greedy")
    parts += [f"target `{report['target'].get('path')}` ({report['target'].get('dtype')}), drafter "
              f"`{report['drafter'].get('path')}`, {sampling}, block size {report['block_size']}, "
              f"{args.get('max_new_tokens')} new tokens per prompt, device {report['versions'].get('device')}, "
              f"chat template kwargs `{json.dumps(args.get('chat_template_kwargs') or {})}` ({trained}), chat template "
              f"{_template_words(args)}", ""]
    names = list(report["datasets"]) + ["all"]
    rows = [[name] + [(report["datasets"].get(name) or report["overall"]).get(f) for f, _ in SUMMARY_FIELDS]
            for name in names]
    parts += ["## Summary", f"Speedups here are the {HARNESS_WORDS} (`dflashkit eval --engine vllm` measures "
              "vLLM's, per concurrency).", "",
              markdown_table(rows, ["dataset"] + [h for _, h in SUMMARY_FIELDS]), ""]
    if "cost_model_inputs" in report["overall"]:
        parts += ["Speedups and the cost model cover the AR baseline prompts (τ, verify and draft of their "
                  "speculative runs: `cost_model_inputs` in report.json); the other columns cover every prompt.", ""]
    overall = report["overall"]
    parts += ["## Accepted length per round (histogram)",
              markdown_table([[k, v] for k, v in overall["acceptance_histogram"].items()], ["tokens", "rounds"]),
              "", "## Per-position acceptance",
              markdown_table([[k + 1, v] for k, v in enumerate(overall["per_position_acceptance"])],
                             ["draft position", "accepted"]), ""]
    if "lossless" in overall:
        lossless = overall["lossless"]
        parts += ["## Lossless check (greedy: speculative tokens vs an independent reference)", describe(lossless), ""]
        if lossless["divergences"]:
            parts += [markdown_table([[d["prompt"], d["token_index"], d["speculative_token"], d["reference_token"],
                                       d["reference_margin"], d["tie_bound"], d["kind"]]
                                      for d in lossless["divergences"]],
                                     ["prompt", "token", "speculative", "reference", "ref. top-1 − top-2",
                                      "tie bound", "kind"]), ""]
    return "\n".join(parts)


def write_plots(report: dict, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if report.get("engine") == "vllm":
        from .serving_verdict import write_vllm_plots

        return write_vllm_plots(report, out_dir)
    overall, written = report["overall"], []
    fig, ax = plt.subplots(figsize=(5, 3.2))
    histogram = overall["acceptance_histogram"]
    ax.bar([int(k) for k in histogram], list(histogram.values()))
    ax.set(xlabel="tokens produced per round", ylabel="rounds", title=f"τ = {overall['tau']:.2f}")
    written.append(save_figure(fig, out_dir / "acceptance_histogram.png"))
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for name, numbers in report["datasets"].items():
        curve = numbers["per_position_acceptance"]
        ax.plot(range(1, len(curve) + 1), curve, marker="o", label=name)
    ax.set(xlabel="draft position", ylabel="fraction of rounds accepted", ylim=(0, 1.02))
    ax.legend(fontsize=7)
    written.append(save_figure(fig, out_dir / "per_position_acceptance.png"))
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar(list(report["datasets"]), [d["tau"] for d in report["datasets"].values()])
    ax.set(ylabel="τ", title="τ per dataset")
    written.append(save_figure(fig, out_dir / "tau_per_dataset.png"))
    return written


def save_figure(fig, path: Path) -> str:
    """Write a matplotlib figure as a PNG and close it; its file name (report.json's ``plots``)."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path.name


def output_record(dataset: str, prompt_id: str, result: GenerationResult) -> dict:
    """One line of outputs.jsonl: a prompt's speculative run (module notes)."""
    # each round's accepted drafts and its bonus token before the cap at --max-new-tokens, as vLLM's counters
    # count them (1 + accepted per draft), so that a vLLM report's records pair with these
    rounds, round_tokens = len(result.accepted_drafts), len(result.accepted_drafts) + sum(result.accepted_drafts)
    return {"dataset": dataset, "id": prompt_id, "prompt_tokens": result.prompt_len, "rounds": rounds,
            "round_tokens": round_tokens, "tau": round_tokens / rounds if rounds else 0.0,
            "tokens": list(result.tokens)}


def write_report(report: dict, out_dir: str | Path, plots: bool = True, outputs: list[dict] | None = None) -> Path:
    """report.json, report.md and the plots in out_dir; outputs.jsonl first when ``outputs`` is given."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if outputs is not None:
        atomic_write(out / "outputs.jsonl", "".join(json.dumps(r) + "\n" for r in outputs).encode())
    for with_plots in (False, True) if plots else (False,):  # the numbers first: a failed plot loses nothing
        if with_plots:
            report["plots"] = write_plots(report, out)
        atomic_write(out / "report.json", (json.dumps(report, indent=2) + "\n").encode())
        atomic_write(out / "report.md", (render_markdown(report) + "\n").encode())
    return out


def report_dir_problem(path: Path) -> str | None:
    """Why the existing, non-empty directory ``path`` may not take a new report without --overwrite: files eval
    did not write, or an earlier eval's report (a measurement that is not replaced unasked). Never None: only an
    empty or new directory is written without --overwrite (dflashkit/outputs.py check_output_dir)."""
    from dflashkit.outputs import describe_foreign, foreign_entries

    foreign = foreign_entries(path, lambda name: name in REPORT_FILES)
    if foreign:
        return f"{describe_foreign(foreign)}, which eval does not write"
    names = foreign_entries(path, lambda name: False)
    return (f"it already holds {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}: an earlier report, or "
            "files of yours of those names")
