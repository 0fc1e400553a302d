"""One evaluation run: load the pair, decode every prompt speculatively (and the baseline), write the report.

`run_eval` reads as its steps: load (the pair, loaded once: its Target is the parts the decoder and its verifier
run), prompts, prepare (every capture and the first-call costs), reference (lossless check), decode (the timed
prompt loop), then the report (built from the runs by eval/report.py's numbers, written by its `write_report`;
report.py never calls back into this module). `EvalRun` holds what the steps share.

Design choices:
- Per prompt: the speculative run; on the baseline prompts also the autoregressive run (speedup). The
  independent reference (lossless check, greedy only; eval/lossless.py) runs before the prompt loop for all its
  prompts at once, batched (not timed). Every decode step of the run is captured before the loop
  (`SpeculativeDecoder.prepare`), so that no capture lands in a timed prompt, and a prompt whose AR run is
  timed gets an untimed prefill and first round first (`warm_up`), so that first-call costs of its shapes fall
  on neither side of the speedup. report["timing"] says where the run's wall time went, in seconds: load,
  prepare, reference, warm_up, speculative, baseline, other (report.json holds all but `report`, the writing of
  the report itself, which only the returned dict has).
- A stop request (Ctrl-C, SIGTERM, time limit; dflashkit/stopping.py) is honoured between prompts: the report then
  covers the prompts done and says it is partial (report["partial"]); the caller exits non-zero. Once every
  prompt is done, a stop request no longer interrupts anything: the report is written in full.
- The prompts are rendered by training's renderer with the chat template and kwargs the drafter was trained with
  (its config.json records them) unless --chat-template / --chat-template-kwargs say otherwise
  (eval/chat_settings.py); the run's first line and the report say which and from where, and a flag that
  differs from the drafter's training is warned about.
"""

from __future__ import annotations

import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from dflashkit import launch
from dflashkit.errors import UserError
from dflashkit.extract.data.rendering import ChatConfig
from dflashkit.progress import progress_bar
from dflashkit.stopping import StopRequest

from .chat_settings import EvalChat, describe, mismatch_warnings, resolve_chat
from .confidence_cut import confidence_cut_report
from .decoder import DecodeConfig, GenerationResult, SpeculativeDecoder
from .options import EvalOptions, decode_config
from .prompts import Prompt


def _versions(device) -> dict:
    import transformers

    import dflashkit

    out = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "dflashkit": dflashkit.__version__,
           "device": str(device), "platform": platform.platform()}
    if str(device).startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name(device)
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    return out


def drafter_identity(path: str, drafter, chat: EvalChat) -> dict:
    """The report's drafter: its files, shape, and the chat settings its config.json records (None: not
    recorded; chat_template_sha256 None: trained with the target tokenizer's own)."""
    import hashlib

    weights = Path(path) / "model.safetensors"
    digest = hashlib.sha256(weights.read_bytes()).hexdigest() if weights.exists() else None
    trained = chat.trained.get("chat_template", "")
    return {"path": str(Path(path).resolve()), "weights_sha256": digest, "block_size": drafter.block_size,
            "target_layer_ids": list(drafter.target_layer_ids), "mask_token_id": drafter.mask_token_id,
            "num_hidden_layers": drafter.config.num_hidden_layers,
            "chat_template_recorded": "chat_template" in chat.trained,
            "chat_template_sha256": hashlib.sha256(trained.encode()).hexdigest() if trained else None,
            "chat_template_kwargs": chat.trained.get("chat_template_kwargs")}


def check_pair(target, drafter, drafter_path: str) -> None:
    """The drafter must read this target: same hidden size and vocabulary, tapped layers that exist."""
    problems = []
    if drafter.config.hidden_size != target.hidden_size:
        problems.append(f"hidden_size {drafter.config.hidden_size} != target's {target.hidden_size}")
    if drafter.config.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {drafter.config.vocab_size} != target's {target.vocab_size}")
    if max(drafter.target_layer_ids) >= target.num_layers:
        problems.append(f"target_layer_ids {drafter.target_layer_ids} exceed the target's {target.num_layers} layers")
    if problems:
        raise UserError(f"{drafter_path}/config.json does not fit target {target.path}: " + "; ".join(problems)
                        + ". Train or export the drafter for this target.")


def stop_ids(target, chat: ChatConfig | None = None) -> tuple[int, ...]:
    """The ids an answer of the loaded ``target`` ends on under the run's template (None: the tokenizer's, no
    kwargs): targets/chat_template.stop_token_ids, the set regeneration ends its answers on too."""
    from dflashkit.targets.chat_template import stop_token_ids

    chat = chat or ChatConfig()
    return stop_token_ids(target.tokenizer, getattr(target.model, "generation_config", None),
                          chat.chat_template, chat.template_kwargs)


# ----------------------------------------------------------------------------- what the steps share
class Laps:
    """Seconds per part of the run: ``lap(part)`` adds the time since the previous lap to ``part``."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.clock = time.perf_counter()

    def lap(self, part: str) -> None:
        now = time.perf_counter()
        self.seconds[part] = self.seconds.get(part, 0.0) + now - self.clock
        self.clock = now


class BaselineRuns:
    """The autoregressive runs and the lossless references of prompts, kept in ``store`` by prompt and decoding
    settings (keys ``("ar", ...)`` and ``("ref", ...)``): a dict the caller may keep across calls in one process, so
    that chain and tree of the same target, prompts and settings run them once."""

    def __init__(self, store: dict | None, config: DecodeConfig):
        self.store = {} if store is None else store
        self.config = config  # read at each look-up: its stop ids are set before the first

    def key(self, kind: str, prompt: Prompt) -> tuple:
        c = self.config
        return (kind, tuple(prompt.input_ids), c.max_new_tokens, c.temperature, c.top_p, c.top_k, c.seed,
                c.stop_token_ids)

    def has(self, kind: str, prompt: Prompt) -> bool:
        return self.key(kind, prompt) in self.store

    def get(self, kind: str, prompt: Prompt):
        return self.store[self.key(kind, prompt)]

    def keep(self, kind: str, prompt: Prompt, run) -> None:
        self.store[self.key(kind, prompt)] = run


@dataclass
class DatasetRuns:
    """One dataset's runs, in prompt order: speculative for every prompt; AR for the baseline prompts (the first
    ones); references and their prompt ids for the prompts of the lossless check (the first of those)."""

    spec: list[GenerationResult] = field(default_factory=list)
    ar: list[GenerationResult] = field(default_factory=list)
    ref: list = field(default_factory=list)  # lossless.ReferenceRun
    ids: list[str] = field(default_factory=list)  # "spec#id" of each reference
    prompt_ids: list[str] = field(default_factory=list)  # the id of each speculative run's prompt
    uncut: list[GenerationResult] = field(default_factory=list)  # with a confidence cut: each prompt without it


@dataclass
class EvalRun:
    """What the steps of one run share."""

    target: nn.Module  # the loaded Target (targets/loading.py): its parts go down to the decoder and verifier
    drafter: nn.Module
    drafter_path: str
    dtype: torch.dtype
    config: DecodeConfig
    prompts: dict[str, list[Prompt]]  # dataset spec -> its prompts
    chat: EvalChat  # the chat template and kwargs the prompts were rendered with
    baseline_prompts: int | None  # the AR baseline on the first N prompts of each dataset (None: all)
    reference_prompts: int | None  # the lossless check on the first N of those (None: all of them)
    baseline: BaselineRuns
    laps: Laps
    results: dict[str, DatasetRuns] = field(default_factory=dict)
    stop_reason: str | None = None  # set when a stop request cut the prompt loop short

    def paired(self, k: int) -> bool:
        """Whether the k-th prompt of a dataset gets the AR baseline (and is timed against it)."""
        return self.baseline_prompts is None or k < self.baseline_prompts

    def referenced(self, k: int) -> bool:
        """Whether the k-th prompt of a dataset is in the lossless check (greedy runs only)."""
        return (self.config.temperature == 0 and self.paired(k)
                and (self.reference_prompts is None or k < self.reference_prompts))

    def each_prompt(self):
        """(dataset spec, index in its dataset, prompt) in run order."""
        return [(spec, k, prompt) for spec, ps in self.prompts.items() for k, prompt in enumerate(ps)]

    @property
    def planned(self) -> int:
        return sum(map(len, self.prompts.values()))


# ----------------------------------------------------------------------------- the run
def run_eval(opts: EvalOptions, config: DecodeConfig | None = None, shared_baseline: dict | None = None) -> dict:
    """Evaluate the drafter at ``opts.drafter`` on the target ``opts.target``; report.json / report.md / plots in
    ``opts.out``. Reads the "what to evaluate" and hardware settings of ``opts`` (eval/options.py):
    baseline_prompts: the autoregressive baseline runs on the first N prompts of each dataset (None: all);
    reference_prompts: the lossless check (HF generate, slow) on the first N of those (None: all of them);
    chat_template (a Jinja file) / chat_template_kwargs: None renders as the drafter was trained
    (eval/chat_settings.py); time_limit: seconds before a stop request.
    config: the decoding settings (default: those of ``opts``, eval/options.py ``decode_config``); its
    stop_token_ids are filled from the target unless ``opts.no_stop``.
    shared_baseline: a dict that keeps the AR runs and references by prompt across calls in one process (chain
    and tree of the same target, prompts and decoding settings need them once).
    Returns the report; report["partial"] is set when a stop request cut the run short.
    """
    config = decode_config(opts) if config is None else config
    chat = resolve_chat(opts.drafter, opts.chat_template, opts.template_kwargs())
    print(f"dflashkit eval: {describe(chat)}")
    for warning in mismatch_warnings(chat, opts.drafter):
        print(warning, file=sys.stderr)
    settings = run_settings(opts, config, chat)
    laps = Laps()
    loaded, draft_model, torch_dtype = load_pair(opts.target, opts.drafter, opts.device, opts.device_map, opts.dtype)
    prompts = load_all_prompts(loaded, opts.dataset, opts.num_prompts, opts.max_prompt_tokens, chat)
    if not opts.no_stop:
        config.stop_token_ids = stop_ids(loaded, chat.config)
    run = EvalRun(loaded, draft_model, opts.drafter, torch_dtype, config, prompts, chat, opts.baseline_prompts,
                  opts.reference_prompts, BaselineRuns(shared_baseline, config), laps)
    laps.lap("load")
    with SpeculativeDecoder(loaded, draft_model, config) as decoder:  # the target given back however it ends
        prepare(run, decoder)
        laps.lap("prepare")
        if config.temperature == 0:
            run_references(run)
            laps.lap("reference")
        decode_prompts(run, decoder, opts.time_limit)
    return report_run(run, settings, opts.out)


def run_settings(opts: EvalOptions, config: DecodeConfig, chat: EvalChat) -> dict:
    """The report's ``args``: what the run was asked, the chat settings it rendered with and its decoding."""
    return {"target": opts.target, "drafter": opts.drafter, "datasets": list(opts.dataset),
            "num_prompts": opts.num_prompts, "baseline_prompts": opts.baseline_prompts,
            "reference_prompts": opts.reference_prompts, "max_prompt_tokens": opts.max_prompt_tokens,
            "use_stop_tokens": not opts.no_stop, "device": opts.device, "device_map": opts.device_map,
            "dtype": opts.dtype, **chat.record(), "time_limit_s": opts.time_limit,
            **{k: v for k, v in vars(config).items() if k != "stop_token_ids"}}


def load_pair(target: str, drafter: str, device: str | None, device_map: str | None, dtype: str | None):
    """(the loaded Target, the drafter on the target's device, the dtype of both), checked to fit each other."""
    from dflashkit.drafter import load_drafter
    from dflashkit.targets.loading import load_target

    torch_device = launch.local_device(device)
    torch_dtype = launch.default_dtype(torch_device, dtype)
    loaded = load_target(target, dtype=torch_dtype, device=torch_device, device_map=device_map)
    torch_device = next(loaded.model.parameters()).device
    draft_model = load_drafter(drafter, dtype=torch_dtype, device=torch_device)
    check_pair(loaded, draft_model, drafter)
    return loaded, draft_model, torch_dtype


def load_all_prompts(target, datasets: list[str], num_prompts: int | None, max_prompt_tokens: int | None,
                     chat: EvalChat) -> dict[str, list[Prompt]]:
    """Each dataset's prompts, rendered with the target's tokenizer and the run's chat settings."""
    from .prompts import load_prompts

    return {spec: load_prompts(spec, target.tokenizer, num_prompts, max_prompt_tokens, chat.config)
            for spec in datasets}


def prepare(run: EvalRun, decoder: SpeculativeDecoder) -> None:
    """Room for the longest prompt and every decode step captured, then one untimed speculative run (kernels,
    allocator) and, when some AR run is still to be timed, one untimed AR run."""
    decoder.prepare(max(len(p.input_ids) for ps in run.prompts.values() for p in ps))  # room + every capture
    first = next(iter(run.prompts.values()))[0].input_ids
    decoder.generate(first)  # warm-up: kernels, allocator
    if any(run.paired(k) and not run.baseline.has("ar", p) for _, k, p in run.each_prompt()):
        decoder.generate_autoregressive(first)


def run_references(run: EvalRun) -> None:
    """The lossless check's reference (eval/lossless.py) for each of its prompts not kept already: batched, before
    the timed loop."""
    from .lossless import reference_greedy_batch

    missing = list({run.baseline.key("ref", p): p for _, k, p in run.each_prompt()
                    if run.referenced(k) and not run.baseline.has("ref", p)}.values())  # each prompt once
    config = run.config
    references = reference_greedy_batch(run.target.model, [p.input_ids for p in missing], config.max_new_tokens,
                                        config.stop_token_ids)
    for prompt, reference in zip(missing, references):
        run.baseline.keep("ref", prompt, reference)


def decode_prompts(run: EvalRun, decoder: SpeculativeDecoder, time_limit_s: float | None) -> None:
    """Every prompt in order (eval_prompt); a stop request (Ctrl-C, SIGTERM, the time limit) ends the loop after the
    prompt it came during, and is kept in ``run.stop_reason`` when prompts are left (only then is the report
    partial)."""
    run.results = {spec: DatasetRuns() for spec in run.prompts}
    with StopRequest(time_limit_s) as stop, progress_bar(total=run.planned, desc=f"eval {run.config.mode}",
                                                         unit="prompt") as bar:
        for done, (spec, k, prompt) in enumerate(run.each_prompt()):
            stop.pause_point(f"eval.prompt.{done}")
            run.laps.lap("other")
            eval_prompt(run, decoder, spec, k, prompt)
            bar.update()
            if done + 1 < run.planned:  # a stop after the last prompt leaves nothing out: the report is whole
                run.stop_reason = stop.reason()
            if run.stop_reason:
                return


def eval_prompt(run: EvalRun, decoder: SpeculativeDecoder, spec: str, k: int, prompt: Prompt) -> None:
    """One prompt: its speculative run; on a baseline prompt its AR run (timed here unless kept from an earlier
    call, both runs then starting from the same warm state) and, in the lossless check, its reference."""
    runs, laps = run.results[spec], run.laps
    timed_ar = run.paired(k) and not run.baseline.has("ar", prompt)
    if timed_ar:  # the two timed runs compared start from the same warm state
        decoder.warm_up(prompt.input_ids)
        laps.lap("warm_up")
    runs.spec.append(decoder.generate(prompt.input_ids))
    runs.prompt_ids.append(prompt.id)
    if run.config.confidence_threshold > 0:  # the same prompt verifying every draft (eval/confidence_cut.py)
        runs.uncut.append(decoder.generate(prompt.input_ids, confidence_threshold=0.0))
    laps.lap("speculative")
    if not run.paired(k):
        return
    if timed_ar:
        run.baseline.keep("ar", prompt, decoder.generate_autoregressive(prompt.input_ids))
    runs.ar.append(run.baseline.get("ar", prompt))
    laps.lap("baseline")
    if run.referenced(k):
        runs.ref.append(run.baseline.get("ref", prompt))
        runs.ids.append(f"{spec}#{prompt.id}")


# ----------------------------------------------------------------------------- the report
def report_run(run: EvalRun, settings: dict, out: str | Path) -> dict:
    """Build and write the report (eval/report.py) of the prompts done; a stop request from here on waits until
    the report is written in full (the caller learns of it: report["stop_request"], only in the returned dict)."""
    from .report import write_report

    with StopRequest() as late:  # the prompts are done: a stop request now must not lose their report
        late.pause_point("eval.report")
        report = build_report(run, settings)
        run.laps.lap("other")
        report["timing"] = run.laps.seconds
        write_report(report, out, outputs=prompt_outputs(run))
    if late.signal_name:
        report["stop_request"] = late.signal_name
        print(f"dflashkit eval: {late.signal_name} while the report was written; the report is written in full",
              file=sys.stderr)
    run.laps.seconds["report"] = time.perf_counter() - run.laps.clock  # after report.json: the returned dict only
    return report


def build_report(run: EvalRun, settings: dict) -> dict:
    """The report's fields (all but timing) from the runs of the prompts done."""
    done = {spec: runs for spec, runs in run.results.items() if runs.spec}
    block_size = run.config.block_size or run.drafter.block_size
    device = next(run.target.model.parameters()).device
    report = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "args": settings,
        "block_size": block_size,
        "versions": _versions(device),
        "target": {**run.target.identity(), "family": run.target.family, "num_layers": run.target.num_layers,
                   "dtype": str(run.dtype).removeprefix("torch.")},
        "drafter": drafter_identity(run.drafter_path, run.drafter, run.chat),
        "datasets": {spec: numbers([runs], block_size, run.dtype) for spec, runs in done.items()},
        "overall": numbers(list(done.values()), block_size, run.dtype),
    }
    if run.config.confidence_threshold > 0:
        report["confidence_cut"] = confidence_cut_report(run.config.confidence_threshold,
                                                         [x for r in done.values() for x in r.spec],
                                                         [x for r in done.values() for x in r.uncut])
    if run.stop_reason:
        report["partial"] = {"reason": run.stop_reason, "prompts_done": report["overall"]["prompts"],
                             "prompts_planned": run.planned}
    return report


def prompt_outputs(run: EvalRun) -> list[dict]:
    """outputs.jsonl's records (eval/report.py ``output_record``): each speculative run, in prompt order."""
    from .report import output_record

    return [output_record(spec, prompt_id, result) for spec, runs in run.results.items()
            for prompt_id, result in zip(runs.prompt_ids, runs.spec)]


def numbers(parts: list[DatasetRuns], block_size: int, dtype: torch.dtype) -> dict:
    """eval/report.py's numbers of these datasets' runs together, with the lossless check where it ran."""
    from .lossless import classify
    from .report import summarize

    out = summarize([x for r in parts for x in r.spec], [x for r in parts for x in r.ar], block_size,
                    paired=[x for r in parts for x in r.spec[:len(r.ar)]])
    refs = [x for r in parts for x in r.ref]
    if refs:
        paired = [x.tokens for r in parts for x in r.spec[:len(r.ref)]]
        out["lossless"] = classify([x for r in parts for x in r.ids], paired, refs, dtype)
    return out
