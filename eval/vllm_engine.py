"""`dflashkit eval --engine vllm`: the target and the drafter inside vLLM (in-process `vllm.LLM`), measured as served.

Design choices:
- vLLM is an optional extra (`pip install 'dflashkit[vllm]'`), imported only here and only when this engine runs;
  without it the command fails in one line (`MISSING_VLLM`). Everything vLLM-specific goes through `VllmApi`
  (the LLM factory, SamplingParams, the clock, the GPU release), so tests and CPU runs inject the CPU twin
  (eval/vllm_standin.py) and the same code runs.
- The same prompts as the default engine (eval/prompts.py, the run's chat template kwargs), passed as token ids;
  greedy (temperature 0); the target's stop tokens unless --no-stop.
- τ and lossless agreement: every prompt once, all submitted together, in each engine (the headline numbers).
- Concurrency c means c requests submitted together: a level sends the prompts in waves of c (one
  `generate` call each, the last wave filled by cycling the prompts; `max_requests_per_level` caps the prompts a
  level takes, for benchmarks of many levels), so at most c are in flight; every engine is
  built with max_num_seqs = the largest level and serves all levels (one start-up per engine). Output tok/s =
  output tokens / wall time of the level's waves; time to first token and inter-token latency come from vLLM's
  RequestOutput.metrics (`first_token_latency`; (last_token_ts - first_token_ts) / (tokens - 1), the mean time
  per token after the first, several tokens per step with a drafter), averaged over requests.
- τ and per-position acceptance are deltas of vLLM's counters (`vllm:spec_decode_num_drafts`,
  `..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos`; LLM(disable_log_stats=False)) over the part
  measured: τ = 1 + accepted / drafts; position k's acceptance = accepted_per_pos[k] / drafts.
- Lossless: outputs with the drafter against the same requests without it (every prompt, and every level);
  identical outputs are counted and the first differing token index kept.
- Prefix caching (`--prefix-caching on off`): on multi-turn prompts (a record's second user turn after the
  target's own greedy answer to the first, written by the engine without the drafter), each engine first
  answers turn 1 (filling its prefix cache, untimed), then turn 2 all at once (timed, τ from the counters).
  The main measurements use the first setting listed.
- One vLLM at a time: without the drafter first (baselines, turn-1 answers), then with it; each engine is shut
  down and the GPU released before the next starts.
- num_speculative_tokens defaults to block_size - 1 (vLLM reads no block_size); another value runs with a
  warning. vLLM 0.24's other rules (drafter/engines.py VLLM_024_RULES): taps of the last target layer and
  sliding-window drafter layers are warned about; a target config.json with a GGUF quantization_config is
  served from a copy without it.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from dflashkit.errors import UserError

MISSING_VLLM = "--engine vllm needs vLLM: pip install 'dflashkit[vllm]'"
DRAFTS, ACCEPTED = "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass
class VllmEvalConfig:
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16, 64])  # requests submitted together
    num_speculative_tokens: int | None = None  # None: the drafter's block_size - 1 (another value warns)
    prefix_caching: list[str] = field(default_factory=lambda: ["on", "off"])  # the first serves the main run
    max_new_tokens: int = 256  # per request (the first token comes from the prefill)
    dtype: str = "bfloat16"  # vLLM's dtype for target and drafter
    gpu_memory_utilization: float = 0.3  # share of the GPU each vLLM engine may take
    max_model_len: int | None = None  # None: the longest prompt (multi-turn included) + new tokens + a block
    enforce_eager: bool = False  # True: no CUDA graphs in vLLM
    seed: int = 0  # vLLM's seed (greedy decoding does not use it)
    use_stop_tokens: bool = True  # False: requests end at max_new_tokens only
    max_requests_per_level: int | None = None  # a level takes at most this many prompts (None: all of them)

    def check(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise UserError(f"--concurrency {self.concurrency}: give levels >= 1, e.g. 1 4 16 64")
        bad = [p for p in self.prefix_caching if p not in ("on", "off")]
        if bad or not self.prefix_caching:
            raise UserError(f"--prefix-caching {self.prefix_caching}: use on, off or both")
        if self.max_new_tokens < 1:
            raise UserError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class VllmApi:
    llm_factory: Callable  # LLM(model=..., **engine kwargs) -> an object with generate() and get_metrics()
    sampling_params: Callable  # SamplingParams(max_tokens=..., temperature=..., stop_token_ids=..., ignore_eos=...)
    clock: Callable[[], float] = time.perf_counter  # what times the waves
    release: Callable[[], None] = lambda: None  # after an engine is dropped: free what it held (GPU memory)
    version: str = "stand-in"  # reported


def real_vllm_api() -> VllmApi:
    """The installed vLLM; UserError naming the extra when it is missing."""
    try:
        import vllm
    except ImportError:
        raise UserError(MISSING_VLLM) from None

    def release() -> None:
        import torch
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        wait_for_gpu_memory_to_settle()

    return VllmApi(vllm.LLM, vllm.SamplingParams, time.perf_counter, release, vllm.__version__)


def wait_for_gpu_memory_to_settle(limit_s: float = 60.0) -> None:
    """Until the GPU's used memory stops falling (nvidia-smi, read once a second): the engine core of the engine
    just shut down is another process, and the next engine's start-up profiling refuses to run while memory is
    being freed (vllm/v1/worker/gpu_worker.py). Without nvidia-smi it returns at once."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return
    query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
    readings, deadline = [], time.monotonic() + limit_s
    while time.monotonic() < deadline:
        used = sum(int(x) for x in subprocess.run(query, capture_output=True, text=True).stdout.split() if x.isdigit())
        readings.append(used)
        if len(readings) >= 5 and max(readings[-5:]) - min(readings[-5:]) < 16:  # MiB, steady for 4 s
            return
        time.sleep(1.0)


def start_engine(api: VllmApi, **kwargs):
    """api.llm_factory(**kwargs), once more after the GPU settles if the engine core failed to start: seen on an
    H200, the engine before it was still freeing memory while this one profiled (vllm/v1/worker/gpu_worker.py
    asserts that free memory did not grow during its start-up profiling). The first try waits for the GPU to
    settle too: a process that ran on it just before may still be freeing its memory."""
    wait_for_gpu_memory_to_settle()
    try:
        return api.llm_factory(**kwargs)
    except RuntimeError as error:
        if "initialization failed" not in str(error):
            raise
        api.release()
        return api.llm_factory(**kwargs)


def close_engine(llm, api: VllmApi) -> None:
    """vLLM's own shutdown of the engine core, then drop it and free the GPU before another engine starts."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm
    gc.collect()
    api.release()


# ----------------------------------------------------------------------------- metrics
def spec_counters(llm) -> dict:
    """vLLM's speculative counters now, summed over label sets: drafts, accepted tokens, accepted per position."""
    out = {"drafts": 0, "accepted": 0, "per_pos": []}
    for metric in llm.get_metrics():
        if metric.name == DRAFTS:
            out["drafts"] += int(metric.value)
        elif metric.name == ACCEPTED:
            out["accepted"] += int(metric.value)
        elif metric.name == ACCEPTED_PER_POS:
            values = list(metric.values)
            out["per_pos"] = [a + b for a, b in zip(out["per_pos"] + [0] * len(values), values)]
    return out


def acceptance(before: dict, after: dict) -> dict | None:
    """τ and per-position acceptance over the change between two `spec_counters` (None without drafts)."""
    drafts = after["drafts"] - before["drafts"]
    if drafts <= 0:
        return None
    accepted = after["accepted"] - before["accepted"]
    per_pos = [a - (before["per_pos"][k] if k < len(before["per_pos"]) else 0) for k, a in enumerate(after["per_pos"])]
    return {"tau": 1.0 + accepted / drafts, "drafts": drafts, "accepted_tokens": accepted,
            "per_position_acceptance": [a / drafts for a in per_pos]}


def agreement(names: list[str], with_drafter: list[list[int]], without: list[list[int]]) -> dict:
    """Greedy outputs with and without the drafter, request by request: identical count, first divergences."""
    from .lossless import first_divergence

    divergences = []
    for name, a, b in zip(names, with_drafter, without):
        if a != b:
            divergences.append({"prompt": name, "token_index": first_divergence(a, b), "drafter_tokens": len(a),
                                "baseline_tokens": len(b)})
    return {"requests": len(names), "identical": len(names) - len(divergences),
            "identical_rate": (len(names) - len(divergences)) / max(len(names), 1), "divergences": divergences[:20]}


# ----------------------------------------------------------------------------- measuring
def level_requests(prompts: list[tuple[str, list[int]]], concurrency: int,
                   cap: int | None = None) -> list[tuple[str, list[int]]]:
    """The first `cap` prompts (all when None) in order, cycled to fill whole waves of `concurrency`."""
    total = -(-min(len(prompts), cap or len(prompts)) // concurrency) * concurrency
    return [prompts[k % len(prompts)] for k in range(total)]


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def timed_generate(llm, api: VllmApi, requests: list[tuple[str, list[int]]], wave: int, params) -> dict:
    """The requests in waves of `wave`; outputs, wall time, TTFT / ITL per request, τ over the waves."""
    before = spec_counters(llm)
    outputs, ttft, itl, wall = [], [], [], 0.0
    for start in range(0, len(requests), wave):
        batch = [{"prompt_token_ids": ids} for _, ids in requests[start:start + wave]]
        t0 = api.clock()
        results = llm.generate(batch, params, use_tqdm=False)
        wall += api.clock() - t0
        for r in results:
            tokens = list(r.outputs[0].token_ids)
            outputs.append(tokens)
            m = getattr(r, "metrics", None)
            ttft.append(getattr(m, "first_token_latency", None) if m is not None else None)
            itl.append((m.last_token_ts - m.first_token_ts) / (len(tokens) - 1)
                       if m is not None and len(tokens) > 1 and m.last_token_ts > m.first_token_ts else None)
    tokens = sum(map(len, outputs))
    decode = [(i or 0.0) * (len(o) - 1) for i, o in zip(itl, outputs)]  # per request: last - first token time
    return {"outputs": outputs, "requests": len(requests), "output_tokens": tokens, "wall_s": wall,
            "decode_s_sum": sum(decode), "decode_tokens": sum(max(len(o) - 1, 0) for o in outputs),
            "output_tokens_per_s": tokens / wall if wall > 0 else 0.0, "ttft_mean_s": _mean(ttft),
            "ttft_p50_s": statistics.median([t for t in ttft if t is not None]) if any(t is not None for t in ttft)
            else None, "itl_mean_s": _mean(itl), "acceptance": acceptance(before, spec_counters(llm))}


def multi_turn_prompts(datasets: list[str], num_prompts: int) -> list[tuple[str, list[dict], str]]:
    """(id, opening turns, second user turn) of the records that have a second user turn (MT-bench does; so do
    ShareGPT ``conversations``), the turns read as every eval prompt is (eval/prompts.py)."""
    from dflashkit.extract.data.sources import iter_records

    from .prompts import conversation_turns, opening_turns

    out = []
    for spec in datasets:
        taken = 0
        for item in iter_records(spec):
            if taken >= num_prompts:
                break
            if item.record is None:
                continue
            taken += 1
            users = [t["content"] for t in conversation_turns(item.record) or [] if t["role"] == "user"]
            if len(users) >= 2:
                out.append((f"{spec}#{item.record.get('id', item.where)}", opening_turns(item.record, item.where),
                            users[1]))
    return out


def target_stop_ids(target_dir: Path, tokenizer, template_kwargs: dict | None = None) -> list[int]:
    """The ids an answer ends on (targets/chat_template.stop_token_ids, as the default engine's and
    regeneration's), with the generation config of ``target_dir`` read as transformers reads it for the model."""
    from transformers import GenerationConfig

    from dflashkit.targets.chat_template import stop_token_ids

    generation = (GenerationConfig.from_pretrained(target_dir)
                  if (Path(target_dir) / "generation_config.json").is_file() else None)
    return list(stop_token_ids(tokenizer, generation, template_kwargs=template_kwargs))


def run_vllm_eval(target: str, drafter: str, out: str | Path, datasets: list[str], config: VllmEvalConfig,
                  num_prompts: int = 20, max_prompt_tokens: int | None = None,
                  chat_template_kwargs: dict | None = None, api: VllmApi | None = None, warn=None) -> dict:
    """Serve the pair with vLLM in-process; report.json / report.md / plots in `out` (the returned report)."""
    from transformers import AutoTokenizer

    from dflashkit.drafter import engines as rules
    from dflashkit.drafter import read_drafter_config
    from dflashkit.targets.loading import resolve_target_dir

    from .prompts import load_prompts, render
    from .report import write_report
    from .run import trained_template_kwargs
    from .serving_verdict import verdict

    config.check()
    warn = warn or (lambda message: print(message, file=sys.stderr))
    started = time.perf_counter()
    api = api or real_vllm_api()
    dcfg = read_drafter_config(drafter)
    num_spec = rules.vllm_num_speculative_tokens(dcfg.block_size, config.num_speculative_tokens, warn)
    notes = [f"warning: {reason}" for reason in rules.vllm_warnings(dcfg)]
    for note in notes:
        warn(note)
    if num_spec != dcfg.block_size - 1:  # (vllm_num_speculative_tokens has warned)
        notes.append(f"warning: num_speculative_tokens {num_spec} != block_size - 1 = {dcfg.block_size - 1}: "
                     "acceptance differs from what the drafter gets with the blocks it was trained on")
    kwargs = chat_template_kwargs or {}
    trained = trained_template_kwargs(drafter)
    if trained is not None and trained != kwargs:
        notes.append(f"warning: drafter trained with chat template kwargs {json.dumps(trained)}, "
                     f"rendered with {json.dumps(kwargs)}")
        warn(notes[-1])
    scratch = tempfile.TemporaryDirectory(prefix="dflashkit-vllm-")
    target_dir, _ = resolve_target_dir(target)
    served_dir, stripped = rules.vllm_target_dir(target_dir, scratch.name)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompts = [(f"{spec}#{p.id}", p.input_ids) for spec in datasets
               for p in load_prompts(spec, tokenizer, num_prompts, max_prompt_tokens, kwargs)]
    turns = multi_turn_prompts(datasets, num_prompts)
    turn1 = [(name, render(tokenizer, messages, kwargs)) for name, messages, _ in turns]
    stop = target_stop_ids(target_dir, tokenizer, kwargs) if config.use_stop_tokens else []
    params = api.sampling_params(max_tokens=config.max_new_tokens, temperature=0.0, stop_token_ids=stop,
                                 ignore_eos=not config.use_stop_tokens)
    longest = max([len(ids) for _, ids in prompts]
                  + [len(ids) + config.max_new_tokens + len(tokenizer(t[2])["input_ids"]) + 64
                     for (_, ids), t in zip(turn1, turns)])
    max_len = config.max_model_len or -(-(longest + config.max_new_tokens + num_spec + 1) // 256) * 256
    levels = sorted(set(config.concurrency))
    spec_config = {"method": "dflash", "model": str(Path(drafter).resolve()), "num_speculative_tokens": num_spec}
    engine_s: dict[str, float] = {}

    def engine(with_drafter: bool, prefix: str):
        t0 = time.perf_counter()
        kwargs = dict(model=str(served_dir), dtype=config.dtype, seed=config.seed,
                      gpu_memory_utilization=config.gpu_memory_utilization, max_model_len=max_len,
                      max_num_seqs=max(levels), enable_prefix_caching=prefix == "on",
                      enforce_eager=config.enforce_eager, disable_log_stats=False,
                      speculative_config=spec_config if with_drafter else None)
        llm = start_engine(api, **kwargs)
        engine_s[f"{'drafter' if with_drafter else 'no_drafter'}_{prefix}_start"] = time.perf_counter() - t0
        return llm

    def sweep(llm) -> dict:
        runs = {"all": timed_generate(llm, api, prompts, len(prompts), params)}  # every prompt once: tau, lossless
        cap = config.max_requests_per_level
        out = {}
        for c in levels:  # each level from a cold prefix cache: the "all" run has prefilled every prompt
            if hasattr(llm, "reset_prefix_cache"):
                llm.reset_prefix_cache()
            out[c] = timed_generate(llm, api, level_requests(prompts, c, cap), c, params)
        return runs | out

    def second_turns(llm, answers: list[list[int]] | None = None) -> tuple[dict, list]:
        first = llm.generate([{"prompt_token_ids": ids} for _, ids in turn1], params, use_tqdm=False)
        answers = answers or [list(r.outputs[0].token_ids) for r in first]
        chats = [(name, render(tokenizer, messages + [
            {"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)},
            {"role": "user", "content": second}], kwargs)) for (name, messages, second), answer in zip(turns, answers)]
        return timed_generate(llm, api, chats, max(len(chats), 1), params), answers

    main_prefix, multi = config.prefix_caching[0], {}
    llm = engine(False, main_prefix)
    baseline = sweep(llm)
    answers = None
    if turns:
        multi[(False, main_prefix)], answers = second_turns(llm)
    close_engine(llm, api)
    llm = engine(True, main_prefix)
    drafted = sweep(llm)
    if turns:
        multi[(True, main_prefix)], _ = second_turns(llm, answers)
    close_engine(llm, api)
    for prefix in config.prefix_caching[1:] if turns else []:
        for with_drafter in (True, False):
            llm = engine(with_drafter, prefix)
            multi[(with_drafter, prefix)], _ = second_turns(llm, answers)
            close_engine(llm, api)
    scratch.cleanup()

    rows = []
    for c in levels:
        a, b = drafted[c], baseline[c]
        names = [name for name, _ in level_requests(prompts, c, config.max_requests_per_level)]
        rows.append({"concurrency": c, "requests": a["requests"],
                     "drafter": {k: v for k, v in a.items() if k not in ("outputs", "acceptance")},
                     "no_drafter": {k: v for k, v in b.items() if k != "outputs"},
                     "speedup": a["output_tokens_per_s"] / b["output_tokens_per_s"] if b["output_tokens_per_s"]
                     else 0.0, "tau": (a["acceptance"] or {}).get("tau"), "acceptance": a["acceptance"],
                     "lossless": agreement(names, a["outputs"], b["outputs"])})
    overall_acc = drafted["all"]["acceptance"]
    names = [name for name, _ in prompts]
    prefix_rows = {}
    for prefix in config.prefix_caching:
        a, b = multi.get((True, prefix)), multi.get((False, prefix))
        if a and b:
            prefix_rows[prefix] = {"tau": (a["acceptance"] or {}).get("tau"), "acceptance": a["acceptance"],
                                   "drafter_tokens_per_s": a["output_tokens_per_s"],
                                   "no_drafter_tokens_per_s": b["output_tokens_per_s"],
                                   "speedup": a["output_tokens_per_s"] / b["output_tokens_per_s"]
                                   if b["output_tokens_per_s"] else 0.0,
                                   "ttft_mean_s": {"drafter": a["ttft_mean_s"], "no_drafter": b["ttft_mean_s"]},
                                   "requests": a["requests"]}
    first = rows[0]
    report = {
        "engine": "vllm", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "args": {"mode": "vllm", "target": target, "drafter": drafter, "datasets": list(datasets),
                 "num_prompts": num_prompts, "max_prompt_tokens": max_prompt_tokens, "chat_template_kwargs": kwargs,
                 "max_model_len": max_len, **{k: v for k, v in vars(config).items()}},
        "block_size": dcfg.block_size, "num_speculative_tokens": num_spec,
        "serve_command": rules.vllm_serve_command(str(target_dir), str(Path(drafter).resolve()), dcfg.block_size),
        "versions": {"vllm": api.version, "python": sys.version.split()[0]},
        "target": {"path": str(target_dir), "served_dir": str(served_dir), "gguf_quantization_config_stripped":
                   stripped},
        "drafter": {"path": str(Path(drafter).resolve()), "block_size": dcfg.block_size,
                    "target_layer_ids": list(dcfg.target_layer_ids), "mask_token_id": dcfg.mask_token_id,
                    "layer_types": list(dcfg.layer_types)},
        "warnings": notes, "prompts": len(prompts), "acceptance": overall_acc,
        "lossless": agreement(names, drafted["all"]["outputs"], baseline["all"]["outputs"]),
        "all_prompts": {"drafter_tokens_per_s": drafted["all"]["output_tokens_per_s"],
                        "no_drafter_tokens_per_s": baseline["all"]["output_tokens_per_s"]},
        "concurrency": rows,
        "prefix_caching": prefix_rows if turns else {"skipped": "no dataset record has a second user turn "
                                                                "(builtin:mtbench has)"},
        "datasets": {},
        "overall": {"tau": (overall_acc or {}).get("tau", 1.0), "speedup": first["speedup"],
                    "per_position_acceptance": (overall_acc or {}).get("per_position_acceptance", [])},
        "timing": {**engine_s, "total": time.perf_counter() - started},
    }
    report["verdict"] = verdict(rows, num_spec + 1)
    write_report(report, out)
    return report
