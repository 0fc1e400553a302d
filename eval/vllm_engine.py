"""`dflashkit eval --engine vllm`: the target and the drafter inside vLLM (in-process `vllm.LLM`), measured as served.

Design choices:
- vLLM is an optional extra (`pip install 'dflashkit[vllm]'`), imported (targets/vllm/) only when this engine runs;
  without it the command fails in one line (`MISSING_VLLM`). Everything vLLM-specific goes through `VllmApi`
  (targets/vllm/api.py: the LLM factory, SamplingParams, the clock, the GPU release), so tests pass the CPU twin
  (tests/support/vllm_standin.py) and the same code runs.
- The same prompts as the default engine (eval/prompts.py, the run's chat template kwargs), passed as token ids;
  greedy (temperature 0); the target's stop tokens unless --no-stop.
- τ and lossless agreement: every prompt once, all submitted together, in each engine (the headline numbers).
- Concurrency c means c requests submitted together: a level sends the prompts in waves of c (one
  `generate` call each, the last wave filled by cycling the prompts; `max_requests_per_level` caps the prompts a
  level takes, for benchmarks of many levels, and `min_waves` makes every level at least that many waves, so
  that a level of many requests runs long enough to time: one wave of 16 requests takes half a second on the
  H200 testbed, where repeats of it spread by 20-30%), so at most c are in flight; every engine is
  built with max_num_seqs = the largest level and serves all levels (one start-up per engine). Output tok/s =
  output tokens / wall time of the level's waves; time to first token and inter-token latency come from vLLM's
  RequestOutput.metrics (`first_token_latency`; (last_token_ts - first_token_ts) / (tokens - 1), the mean time
  per token after the first, several tokens per step with a drafter), averaged over requests.
- τ and per-position acceptance are deltas of vLLM's counters (`vllm:spec_decode_num_drafts`,
  `..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos`; LLM(disable_log_stats=False)) over the part
  measured: τ = 1 + accepted / drafts; position k's acceptance = accepted_per_pos[k] / drafts
  (targets/vllm/metrics.py reads them, times the waves and sends the prompts one by one).
- Lossless: outputs with the drafter against the same requests without it (every prompt, and every level);
  identical outputs are counted and the first differing token index kept.
- Prefix caching (`--prefix-caching on off`): on multi-turn prompts (a record's second user turn after the
  target's own greedy answer to the first, written by the engine without the drafter), each engine first
  answers turn 1 (filling its prefix cache, untimed), then turn 2 all at once (timed, τ from the counters).
  The main measurements use the first setting listed.
- Per prompt (`--per-prompt`): the headline drafter engine also answers every prompt alone, the counters read
  around each, and writes outputs.jsonl as the local engine does (eval/report.py): a prompt's rounds are its
  drafts, its round tokens drafts + accepted, so its τ is 1 + accepted / drafts; the answer is that run's. With a
  `dflashkit eval` report of the same prompts, `--compare` tells answers that part (vLLM's bf16 kernels against
  the local run's dtype) from proposals that differ on the same answer. The report's `per_prompt` holds their τ
  beside the batched one.
- One vLLM at a time: without the drafter first (baselines, turn-1 answers), then with it; each engine is shut
  down and the GPU released before the next starts.
- CUDA graphs (``cudagraph_capture``): vLLM 0.24 captures graphs only up to 512 tokens a step by default and runs
  larger steps eagerly (drafter/vllm_rules.py rule "cudagraph_ceiling"); a decode step of c requests at k queries
  c * (1 + k) tokens. "auto" (default) raises max_cudagraph_capture_size of each engine to cover its largest
  level at its k (``vllm_cudagraph_capture_size``) and the serve commands carry the same flag; "vllm" keeps
  vLLM's default (what a deployment gets without the flag); a number sets it for every engine.
- num_speculative_tokens defaults to block_size - 1 (vLLM reads no block_size); another value runs with a
  warning. The other rules of the vLLM that runs (drafter/vllm_rules.py VLLM_RULES, by ``VllmApi.version``): taps of
  the last target layer are warned about, sliding-window drafter layers on 0.24 (0.26 serves them as trained);
  a target config.json with a GGUF quantization_config is
  served from a copy without it, kept in the report's directory (the report's serve commands name it).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from dflashkit.errors import UserError
from dflashkit.targets.vllm.api import VllmApi, close_engine, load_api, start_engine
from dflashkit.targets.vllm.metrics import per_prompt_records, per_prompt_summary, timed_generate
from dflashkit.targets.vllm.runtime import model_runner

from .chat_settings import EvalChat, describe, mismatch_warnings, resolve_chat
from .options import EvalOptions
from .prompts import load_prompts, multi_turn_prompts, target_stop_ids
from .serving_plan import (
    BASELINES,
    REVISED,
    V1_RUNNER,
    baseline_specs,
    capture_size,
    derive_schedule,
    given_schedule,
    revise_zero_ranges,
    run_requests,
    schedule_lookup,
    schedule_spec,
)

PARTIAL_FILE = "engines.partial.jsonl"  # one line per engine as it finishes (eval/report.py REPORT_FILES)


@dataclass
class VllmEvalConfig:
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16, 64])  # requests submitted together
    # k values, one engine each (None: the drafter's block_size - 1; another k warns unless the drafter is causal)
    num_speculative_tokens: list[int] | int | None = None
    repeats: int = 3  # runs of every (engine, level) cell; its tok/s is their median, their spread reported
    baselines: list[str] = field(default_factory=list)  # ngram, mtp: what a user would deploy instead
    schedule_run: bool = True  # one more engine served with the per-batch-size schedule derived from the cells
    schedule: list | None = None  # [[first, last, k], ...]: serve this schedule instead of the derived one
    prefix_caching: list[str] = field(default_factory=lambda: ["on", "off"])  # the first serves the main run
    max_new_tokens: int = 256  # per request (the first token comes from the prefill)
    dtype: str = "bfloat16"  # vLLM's dtype for target and drafter
    gpu_memory_utilization: float = 0.3  # share of the GPU each vLLM engine may take
    max_model_len: int | None = None  # None: the longest prompt (multi-turn included) + new tokens + a block
    enforce_eager: bool = False  # True: no CUDA graphs in vLLM
    seed: int = 0  # vLLM's seed (greedy decoding does not use it)
    use_stop_tokens: bool = True  # False: requests end at max_new_tokens only
    max_requests_per_level: int | None = None  # a level takes at most this many prompts (None: all of them)
    min_waves: int = 1  # a level sends at least this many waves of c requests (prompts cycled)
    cudagraph_capture: str | int = "auto"  # auto: graphs cover every level's step; vllm: vLLM's default; N tokens
    per_prompt: bool = False  # also every prompt alone on the headline drafter engine: outputs.jsonl (module notes)

    def check(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise UserError(f"--concurrency {self.concurrency}: give levels >= 1, e.g. 1 4 16 64")
        bad = [p for p in self.prefix_caching if p not in ("on", "off")]
        if bad or not self.prefix_caching:
            raise UserError(f"--prefix-caching {self.prefix_caching}: use on, off or both")
        if self.max_new_tokens < 1:
            raise UserError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if isinstance(self.num_speculative_tokens, int):
            self.num_speculative_tokens = [self.num_speculative_tokens]
        if self.num_speculative_tokens is not None and (not self.num_speculative_tokens
                                                        or min(self.num_speculative_tokens) < 1):
            raise UserError(f"--num-speculative-tokens {self.num_speculative_tokens}: give values >= 1, e.g. 1 3 7 15")
        if self.repeats < 1:
            raise UserError(f"--repeats must be >= 1, got {self.repeats}")
        if self.min_waves < 1:
            raise UserError(f"--min-waves must be >= 1, got {self.min_waves}")
        capture = self.cudagraph_capture
        if not (capture in ("auto", "vllm") or (str(capture).isdigit() and int(capture) >= 1)):
            raise UserError(f"--cudagraph-capture-size {capture}: use auto, vllm or a number of tokens >= 1")
        if str(capture).isdigit():
            self.cudagraph_capture = int(capture)
        if self.schedule is not None:
            schedule_lookup(self.schedule, max(self.concurrency), 1 << 30)  # UserError naming a bad entry
        unknown = [b for b in self.baselines if b not in BASELINES]
        if unknown:
            raise UserError(f"--baseline {' '.join(unknown)}: choose from {', '.join(BASELINES)}")


def vllm_config(opts: EvalOptions) -> VllmEvalConfig:
    """The settings of `--engine vllm` from the command's options (eval/options.py), its defaults filled, checked."""
    if opts.mode != "chain" or opts.temperature != 0:
        raise UserError("--engine vllm measures greedy chain drafting (vLLM's dflash): "
                        "drop --mode tree and --temperature")
    config = VllmEvalConfig(concurrency=opts.concurrency or [1, 4, 16, 64],
                            num_speculative_tokens=opts.num_speculative_tokens, prefix_caching=opts.prefix_caching,
                            max_new_tokens=opts.max_new_tokens, dtype=opts.dtype or "bfloat16",
                            gpu_memory_utilization=opts.gpu_memory_utilization, max_model_len=opts.max_model_len,
                            enforce_eager=opts.enforce_eager, seed=opts.seed, use_stop_tokens=not opts.no_stop,
                            repeats=opts.repeats or 3, baselines=opts.baseline or [],
                            max_requests_per_level=opts.max_requests_per_level, min_waves=opts.min_waves or 1,
                            cudagraph_capture=opts.cudagraph_capture_size or "auto",
                            schedule_run=not opts.no_schedule_run, per_prompt=bool(opts.per_prompt))
    config.check()
    return config


@dataclass
class ServedRun:
    """What every engine of one `eval --engine vllm` run shares (built once by `prepare_run`)."""
    api: VllmApi
    config: VllmEvalConfig
    drafter: str  # resolved path
    dcfg: object  # the drafter's DrafterConfig
    ks: list[int]  # num_speculative_tokens measured, ascending
    headline_k: int  # the k of the report's concurrency rows (block_size - 1 when measured, else the largest)
    target_dir: Path
    served_dir: Path  # what vLLM is given (a copy without a GGUF quantization_config, or target_dir)
    stripped: bool
    target_config: dict
    tokenizer: object
    chat: EvalChat  # the chat template and kwargs the prompts are rendered with (eval/chat_settings.py)
    prompts: list[tuple[str, list[int]]]
    keys: list[tuple[str, str]]  # (dataset spec, prompt id) of each prompt
    turns: list[tuple[str, list[dict], str]]  # multi-turn records: (id, opening turns, second user turn)
    params: object  # SamplingParams
    max_len: int
    notes: list[str]
    engine_s: dict[str, float] = field(default_factory=dict)
    out: Path | None = None  # the output directory (engines.partial.jsonl)

    @property
    def levels(self) -> list[int]:
        return sorted(set(self.config.concurrency))


def prepare_run(opts: EvalOptions, config: VllmEvalConfig, chat: EvalChat, api: VllmApi, warn) -> ServedRun:
    """Read the drafter, the target and the prompts of ``opts`` (a target copy without a GGUF
    quantization_config goes to ``opts.out``); the checks and warnings that come before any engine."""
    from transformers import AutoTokenizer

    from dflashkit.drafter import vllm_rules as rules
    from dflashkit.extract.data.rendering import prompt_ids
    from dflashkit.targets.loading import resolve_target_dir

    dcfg, ks, notes = drafter_plan(opts.drafter, config, chat, api, warn)
    target_dir, _ = resolve_target_dir(opts.target)
    served_dir, stripped = rules.vllm_target_dir(target_dir, str(opts.out))
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    loaded = [(spec, p) for spec in opts.dataset
              for p in load_prompts(spec, tokenizer, opts.num_prompts, opts.max_prompt_tokens, chat.config, warn)]
    prompts = [(f"{spec}#{p.id}", p.input_ids) for spec, p in loaded]
    keys = [(spec, p.id) for spec, p in loaded]
    turns = multi_turn_prompts(opts.dataset, opts.num_prompts)
    stop = target_stop_ids(target_dir, tokenizer, chat.config) if config.use_stop_tokens else []
    params = api.sampling_params(max_tokens=config.max_new_tokens, temperature=0.0, stop_token_ids=stop,
                                 ignore_eos=not config.use_stop_tokens)
    longest = max([len(ids) for _, ids in prompts]
                  + [len(prompt_ids(tokenizer, messages, chat.config)) + config.max_new_tokens
                     + len(tokenizer(second)["input_ids"]) + 64 for _, messages, second in turns])
    max_len = config.max_model_len or -(-(longest + config.max_new_tokens + max(ks) + 1) // 256) * 256
    headline = dcfg.block_size - 1 if dcfg.block_size - 1 in ks else ks[-1]
    target_config = json.loads((Path(target_dir) / "config.json").read_text())
    window = rules.target_window_reason(target_config, max_len, api.version)
    if window:
        notes.append(f"warning: {window}")
        warn(notes[-1])
    return ServedRun(api, config, str(Path(opts.drafter).resolve()), dcfg, ks, headline, target_dir, served_dir,
                     stripped, target_config, tokenizer, chat, prompts, keys, turns, params, max_len,
                     notes)


def drafter_plan(drafter: str, config: VllmEvalConfig, chat: EvalChat, api: VllmApi, warn) -> tuple:
    """(the drafter's DrafterConfig, the k values to serve, ascending, the run's warnings so far): vLLM's rules
    for this drafter checked, each warning given to ``warn`` as it comes."""
    from dflashkit.drafter import read_drafter_config
    from dflashkit.drafter import vllm_rules as rules
    from dflashkit.drafter.vllm_dflash2 import check_vllm_num_speculative_tokens, check_vllm_schedule

    dcfg = read_drafter_config(drafter)
    ks = sorted({rules.vllm_num_speculative_tokens(dcfg.block_size, k, warn, causal=dcfg.causal)
                 for k in config.num_speculative_tokens or [None]})
    for k in ks:  # a DFlash2 drafter: N = block_size - 1 and no schedule (drafter/vllm_dflash2.py: vLLM 0.28)
        check_vllm_num_speculative_tokens(dcfg, k)
    if config.schedule or (len(ks) > 1 and config.schedule_run):
        check_vllm_schedule(dcfg, config.schedule or [[1, 1, ks[-1]]])
    notes = [f"warning: {reason}" for reason in rules.vllm_warnings(dcfg, api.version)]
    for note in notes:
        warn(note)
    notes += [f"warning: num_speculative_tokens {k} != block_size - 1 = {dcfg.block_size - 1}: acceptance "
              "differs from what the drafter gets with the blocks it was trained on"
              for k in ks if k != dcfg.block_size - 1 and not (dcfg.causal and k < dcfg.block_size)]
    for note in mismatch_warnings(chat, drafter):
        notes.append(note)
        warn(note)
    return dcfg, ks, notes


def dflash_spec(run: ServedRun, k: int) -> dict:
    return {"method": "dflash", "model": run.drafter, "num_speculative_tokens": k}


def start_served(run: ServedRun, name: str, spec: dict | None, prefix: str):
    """One vLLM engine of the run (its start-up time recorded under ``name``); the ``v1`` baseline on the V1
    model runner with piecewise CUDA graphs only, as vLLM 0.24 runs a schedule's engine (config/vllm.py:758-773),
    so that it differs from the schedule's engine at k = 0 by the drafter's pass alone (on 0.26 a schedule stays
    on the default runner: drafter/vllm_rules.py rule "schedule_runner")."""
    t0 = time.perf_counter()
    capture = capture_size(run, spec)
    compilation = {"max_cudagraph_capture_size": capture} if capture else {}
    if name == V1_RUNNER and not run.config.enforce_eager:
        compilation["cudagraph_mode"] = "PIECEWISE"
    graphs = {"compilation_config": compilation} if compilation else {}
    with model_runner(name == V1_RUNNER):
        llm = start_engine(run.api, model=str(run.served_dir), dtype=run.config.dtype, seed=run.config.seed,
                           gpu_memory_utilization=run.config.gpu_memory_utilization, max_model_len=run.max_len,
                           max_num_seqs=max(run.levels), enable_prefix_caching=prefix == "on",
                           enforce_eager=run.config.enforce_eager, disable_log_stats=False,
                           speculative_config=spec, **graphs)
    run.engine_s[f"{name}_{prefix}_start"] = time.perf_counter() - t0
    return llm


def sweep_levels(run: ServedRun, llm) -> dict:
    """Every prompt once (τ, lossless), then each level `repeats` times, each from a cold prefix cache."""
    out = {"all": timed_generate(llm, run.api, run.prompts, len(run.prompts), run.params)}
    for c in run.levels:
        out[c] = []
        for _ in range(run.config.repeats):
            if hasattr(llm, "reset_prefix_cache"):
                llm.reset_prefix_cache()
            out[c].append(timed_generate(llm, run.api, run_requests(run, c), c, run.params))
    return out


def second_turns(run: ServedRun, llm, answers: list[list[int]] | None = None) -> tuple[dict, list]:
    """Turn 1 of the multi-turn records (untimed, filling the prefix cache), then turn 2 all at once (timed);
    turn 2 follows ``answers`` (the engine without speculation's), or this engine's own turn-1 answers."""
    from dflashkit.extract.data.rendering import prompt_ids

    turn1 = [prompt_ids(run.tokenizer, messages, run.chat.config) for _, messages, _ in run.turns]
    first = llm.generate([{"prompt_token_ids": ids} for ids in turn1], run.params, use_tqdm=False)
    answers = answers or [list(r.outputs[0].token_ids) for r in first]
    chats = [(name, prompt_ids(run.tokenizer, messages + [
        {"role": "assistant", "content": run.tokenizer.decode(answer, skip_special_tokens=True)},
        {"role": "user", "content": second}], run.chat.config))
        for (name, messages, second), answer in zip(run.turns, answers)]
    return timed_generate(llm, run.api, chats, max(len(chats), 1), run.params), answers


def measure_engine(run: ServedRun, name: str, spec: dict | None, answers: list | None = None,
                   multi_turn: bool = False) -> dict:
    """One engine over the whole sweep (and the multi-turn prompts when asked), shut down after; its cells are
    appended to ``engines.partial.jsonl`` in the output directory at once, so a run stopped later keeps them."""
    prefix = run.config.prefix_caching[0]
    llm = start_served(run, name, spec, prefix)
    try:
        result = sweep_levels(run, llm)
        if multi_turn and run.turns:
            result["multi_turn"], result["turn1_answers"] = second_turns(run, llm, answers)
        if name == "drafter" and run.config.per_prompt:  # the headline k's engine
            result["per_prompt"] = per_prompt_records(llm, run.keys, run.prompts, run.params)
    finally:
        close_engine(llm, run.api)
    record_engine(run, name, spec, result)
    return result


def record_engine(run: ServedRun, name: str, spec: dict | None, result: dict) -> None:
    """One line of engines.partial.jsonl: the engine, its start-up time, τ over every prompt once and each
    level's repeats (tok/s, TTFT, ITL; no outputs)."""
    from dflashkit.files import open_appending, sync

    if run.out is None:
        return
    keep = ("requests", "output_tokens", "wall_s", "output_tokens_per_s", "ttft_mean_s", "itl_mean_s")
    line = {"engine": name, "speculative_config": spec, "max_cudagraph_capture_size": capture_size(run, spec),
            "start_s": {k: v for k, v in run.engine_s.items() if k.startswith(f"{name}_")},
            "tau": (result["all"]["acceptance"] or {}).get("tau"),
            "levels": {str(c): [{k: r[k] for k in keep} | {"tau": (r["acceptance"] or {}).get("tau")}
                                for r in result[c]] for c in run.levels}}
    with open_appending(Path(run.out) / PARTIAL_FILE) as f:
        f.write(json.dumps(line) + "\n")
        sync(f)


def measure_prefix_settings(run: ServedRun, answers: list | None) -> dict:
    """The multi-turn prompts on fresh engines for every further prefix-cache setting, with and without the
    drafter at the headline k."""
    out = {}
    for prefix in run.config.prefix_caching[1:] if run.turns else []:
        for name, spec in (("drafter", dflash_spec(run, run.headline_k)), ("no_drafter", None)):
            llm = start_served(run, name, spec, prefix)
            try:
                out[(name, prefix)], _ = second_turns(run, llm, answers)
            finally:
                close_engine(llm, run.api)
    return out


def run_vllm_eval(opts: EvalOptions, config: VllmEvalConfig | None = None, api: VllmApi | None = None,
                  warn=None) -> dict:
    """Serve the pair of ``opts`` with vLLM in-process: no speculation, the drafter at each k, the baselines, then
    the schedule derived from them and, where its k = 0 levels cost, its revision (eval/serving_plan.py
    ``revise_zero_ranges``); report.json / report.md / schedule.json / plots in ``opts.out`` (the returned
    report). Reads target, drafter, dataset, num_prompts, max_prompt_tokens and the chat settings of ``opts``
    (chat_template, a Jinja file, and chat_template_kwargs: None renders as the drafter was trained,
    eval/chat_settings.py). config: the engine's settings (default: those of ``opts``, ``vllm_config``);
    api: vLLM or its stand-in (default: the installed vLLM)."""
    from .report import write_report
    from .vllm_report import build_vllm_report, write_schedule

    config = vllm_config(opts) if config is None else config
    config.check()
    started, warn = time.perf_counter(), warn or (lambda message: print(message, file=sys.stderr))
    chat = resolve_chat(opts.drafter, opts.chat_template, opts.template_kwargs())
    print(f"dflashkit eval: {describe(chat)}")
    # a target copy without a GGUF quantization_config stays in `out`: the report's serve commands name it
    run = prepare_run(opts, config, chat, load_api(api), warn)
    run.out = Path(opts.out)
    run.out.mkdir(parents=True, exist_ok=True)
    (run.out / PARTIAL_FILE).unlink(missing_ok=True)
    results, schedule, baselines, skipped = measure_engines(run)
    prefix_runs = measure_prefix_settings(run, results["none"].get("turn1_answers"))
    args = {"target": opts.target, "datasets": list(opts.dataset), "num_prompts": opts.num_prompts,
            "max_prompt_tokens": opts.max_prompt_tokens}
    report = build_vllm_report(run, results, schedule, baselines, skipped, prefix_runs, args, started)
    outputs = results[f"k{run.headline_k}"].get("per_prompt")
    if outputs is not None:
        report["per_prompt"] = per_prompt_summary(outputs)
    write_report(report, opts.out, outputs=outputs)
    write_schedule(report, opts.out)
    return report


def measure_engines(run: ServedRun) -> tuple[dict, dict, dict, list]:
    """(every engine's results by name, the schedule, the baseline engines' specs, the baselines skipped): no
    speculation, the drafter at each k, the baselines, then the schedule derived from them (or the one given) and,
    where its k = 0 levels cost, its revision."""
    from .vllm_report import level_speedups

    config = run.config
    baselines, skipped = baseline_specs(config.baselines, run.target_config)
    results = {"none": measure_engine(run, "no_drafter", None, multi_turn=True)}
    answers = results["none"].get("turn1_answers")
    for k in run.ks:
        results[f"k{k}"] = measure_engine(run, "drafter" if k == run.headline_k else f"drafter_k{k}",
                                          dflash_spec(run, k), answers, multi_turn=k == run.headline_k)
    for name, spec in baselines.items():
        results[name] = measure_engine(run, name, spec)
    fixed = {k: level_speedups(results, f"k{k}", run.levels) for k in run.ks}
    schedule = given_schedule(config.schedule, run.levels, max(run.ks)) if config.schedule else derive_schedule(fixed)
    if config.schedule_run:
        results["schedule"] = measure_engine(run, "schedule", schedule_spec(run.drafter, schedule))
        measured = {str(c): v for c, v in level_speedups(results, "schedule", run.levels).items()}
        schedule["zero_k_ranges"] = revise_zero_ranges(schedule, measured, fixed)  # serving_plan's notes
        revised = schedule["zero_k_ranges"].get("schedule")
        if revised:
            results[REVISED] = measure_engine(run, REVISED, schedule_spec(run.drafter, revised))
    return results, schedule, baselines, skipped
