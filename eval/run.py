"""One evaluation run: load the pair, decode every prompt speculatively (and the baseline), write the report.

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
- Chat template kwargs render the prompts through the same call as extraction and training; when the drafter's
  config.json records the kwargs it was trained with (`chat_template_kwargs`) and they differ, a warning says so
  and the report keeps both.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import torch

from dflashkit import launch
from dflashkit.errors import UserError
from dflashkit.stopping import StopRequest

from .engine import DecodeConfig, SpeculativeDecoder


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


def drafter_identity(path: str, drafter) -> dict:
    import hashlib

    weights = Path(path) / "model.safetensors"
    digest = hashlib.sha256(weights.read_bytes()).hexdigest() if weights.exists() else None
    return {"path": str(Path(path).resolve()), "weights_sha256": digest, "block_size": drafter.block_size,
            "target_layer_ids": list(drafter.target_layer_ids), "mask_token_id": drafter.mask_token_id,
            "num_hidden_layers": drafter.config.num_hidden_layers,
            "chat_template_kwargs": trained_template_kwargs(path)}


def trained_template_kwargs(drafter_path: str) -> dict | None:
    """The chat template kwargs the drafter was trained with, when its config.json records them."""
    config = Path(drafter_path) / "config.json"
    return json.loads(config.read_text()).get("chat_template_kwargs") if config.exists() else None


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


def stop_ids(target, template_kwargs: dict | None = None) -> tuple[int, ...]:
    """The ids an answer of the loaded ``target`` ends on: targets/chat_template.stop_token_ids, the set
    regeneration ends its answers on too."""
    from dflashkit.targets.chat_template import stop_token_ids

    return stop_token_ids(target.tokenizer, getattr(target.model, "generation_config", None),
                          template_kwargs=template_kwargs)


def run_eval(target: str, drafter: str, out: str | Path, datasets: list[str], config: DecodeConfig,
             num_prompts: int = 20, baseline_prompts: int | None = None, max_prompt_tokens: int | None = None,
             use_stop_tokens: bool = True, device: str | None = None, device_map: str | None = None,
             dtype: str | None = None, chat_template_kwargs: dict | None = None,
             time_limit_s: float | None = None, reference_prompts: int | None = None,
             shared_baseline: dict | None = None) -> dict:
    """Evaluate the drafter at `drafter` on the target `target`; report.json / report.md / plots in `out`.

    baseline_prompts: the autoregressive baseline runs on the first N prompts of each dataset (None: all);
    reference_prompts: the lossless check (HF generate, slow) on the first N of those (None: all of them).
    config.stop_token_ids is filled from the target unless use_stop_tokens is False.
    shared_baseline: a dict that keeps the AR runs and references by prompt across calls in one process (chain
    and tree of the same target, prompts and decoding settings need them once).
    Returns the report; report["partial"] is set when a stop request cut the run short.
    """
    from tqdm import tqdm

    from dflashkit.drafter import load_drafter
    from dflashkit.targets.loading import load_target

    from .lossless import classify, reference_greedy_batch
    from .prompts import load_prompts
    from .report import summarize, write_report

    settings = {"target": target, "drafter": drafter, "datasets": list(datasets), "num_prompts": num_prompts,
                "baseline_prompts": baseline_prompts, "reference_prompts": reference_prompts,
                "max_prompt_tokens": max_prompt_tokens,
                "use_stop_tokens": use_stop_tokens, "device": device, "device_map": device_map, "dtype": dtype,
                "chat_template_kwargs": chat_template_kwargs or {}, "time_limit_s": time_limit_s,
                **{k: v for k, v in vars(config).items() if k != "stop_token_ids"}}
    clock = time.perf_counter()
    timing = {}  # seconds per part of the run

    def lap(part: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timing[part] = timing.get(part, 0.0) + now - clock
        clock = now

    torch_device = launch.local_device(device)
    torch_dtype = launch.default_dtype(torch_device, dtype)
    loaded = load_target(target, dtype=torch_dtype, device=torch_device, device_map=device_map)
    torch_device = next(loaded.model.parameters()).device
    draft_model = load_drafter(drafter, dtype=torch_dtype, device=torch_device)
    check_pair(loaded, draft_model, drafter)
    trained = trained_template_kwargs(drafter)
    if trained is not None and trained != (chat_template_kwargs or {}):
        print(f"warning: {drafter}/config.json says the drafter was trained with chat template kwargs "
              f"{json.dumps(trained)}, this run renders with {json.dumps(chat_template_kwargs or {})}; "
              "pass --chat-template-kwargs to match", file=sys.stderr)
    prompts = {spec: load_prompts(spec, loaded.tokenizer, num_prompts, max_prompt_tokens, chat_template_kwargs)
               for spec in datasets}
    if use_stop_tokens:
        config.stop_token_ids = stop_ids(loaded, chat_template_kwargs)
    greedy = config.temperature == 0
    lap("load")
    results = {spec: {"spec": [], "ar": [], "ref": [], "ids": []} for spec in prompts}
    stop_reason = None
    shared = {} if shared_baseline is None else shared_baseline

    def key_of(prompt) -> tuple:
        return (tuple(prompt.input_ids), config.max_new_tokens, config.temperature, config.top_p, config.top_k,
                config.seed, config.stop_token_ids)

    baseline = [p for ps in prompts.values() for k, p in enumerate(ps) if baseline_prompts is None
                or k < baseline_prompts]
    decoder = SpeculativeDecoder(loaded.model, draft_model, config)
    decoder.prepare(max(len(p.input_ids) for ps in prompts.values() for p in ps))  # room + every capture
    first = next(iter(prompts.values()))[0].input_ids
    decoder.generate(first)  # warm-up: kernels, allocator
    if any(("ar",) + key_of(p) not in shared for p in baseline):  # some AR run is still to be timed
        decoder.generate_autoregressive(first)
    lap("prepare")

    if greedy:  # the reference for every prompt of the lossless check, batched, before the timed loop
        wanted = {("ref",) + key_of(p): p.input_ids for ps in prompts.values() for k, p in enumerate(ps)
                  if (baseline_prompts is None or k < baseline_prompts)
                  and (reference_prompts is None or k < reference_prompts)}
        missing = [key for key in wanted if key not in shared]
        for key, run in zip(missing, reference_greedy_batch(loaded.model, [wanted[key] for key in missing],
                                                            config.max_new_tokens, config.stop_token_ids)):
            shared[key] = run
        lap("reference")
    with StopRequest(time_limit_s) as stop, tqdm(total=sum(map(len, prompts.values())), desc=f"eval {config.mode}",
                                                  unit="prompt") as bar:
        for spec, ps in prompts.items():
            for k, prompt in enumerate(ps):
                stop.pause_point(f"eval.prompt.{bar.n}")
                r = results[spec]
                key = ("ar",) + key_of(prompt)
                paired = baseline_prompts is None or k < baseline_prompts
                lap("other")
                if paired and key not in shared:  # the two timed runs compared start from the same warm state
                    decoder.warm_up(prompt.input_ids)
                    lap("warm_up")
                r["spec"].append(decoder.generate(prompt.input_ids))
                lap("speculative")
                if paired:
                    if key not in shared:
                        shared[key] = decoder.generate_autoregressive(prompt.input_ids)
                    r["ar"].append(shared[key])
                    lap("baseline")
                    if greedy and (reference_prompts is None or k < reference_prompts):
                        r["ref"].append(shared[("ref",) + key[1:]])
                        r["ids"].append(f"{spec}#{prompt.id}")
                bar.update()
                stop_reason = stop.reason()
                if stop_reason:
                    break
            if stop_reason:
                break
    with StopRequest() as late:  # the prompts are done: a stop request now must not lose their report
        late.pause_point("eval.report")
        decoder.close()
        done = {spec: r for spec, r in results.items() if r["spec"]}

        def numbers(parts: list[dict]) -> dict:
            spec = [x for r in parts for x in r["spec"]]
            out = summarize(spec, [x for r in parts for x in r["ar"]], decoder.block_size,
                            paired=[x for r in parts for x in r["spec"][:len(r["ar"])]])
            refs = [x for r in parts for x in r["ref"]]
            if refs:
                paired = [x.tokens for r in parts for x in r["spec"][:len(r["ref"])]]
                out["lossless"] = classify([x for r in parts for x in r["ids"]], paired, refs, torch_dtype)
            return out

        report = {
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "args": settings,
            "block_size": decoder.block_size,
            "versions": _versions(torch_device),
            "target": {**loaded.identity(), "family": loaded.family, "num_layers": loaded.num_layers,
                       "dtype": str(torch_dtype).removeprefix("torch.")},
            "drafter": drafter_identity(drafter, draft_model),
            "datasets": {spec: numbers([r]) for spec, r in done.items()},
            "overall": numbers(list(done.values())),
        }
        if stop_reason:
            report["partial"] = {"reason": stop_reason, "prompts_done": report["overall"]["prompts"],
                                 "prompts_planned": sum(map(len, prompts.values()))}
        lap("other")
        report["timing"] = timing
        write_report(report, out)
    if late.signal_name:  # the caller learns of it (only the returned report has this key)
        report["stop_request"] = late.signal_name
        print(f"dflashkit eval: {late.signal_name} while the report was written; the report is written in full",
              file=sys.stderr)
    timing["report"] = time.perf_counter() - clock  # after report.json was written: only the returned report
    return report
