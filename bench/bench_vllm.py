"""The drafter served by vLLM on one GPU: τ(vLLM) vs τ(dflashkit eval), lossless agreement, the concurrency
table with and without the drafter, prefix cache on vs off, and a projection to a memory-bound 8B target.

One H200 (`. /tmp/vllm-site/vllm-env.sh` first; the testbed target and a trained drafter; the dflashkit eval
report of the same drafter on the same prompts, run beforehand):
    python -m bench.bench_vllm --target /root/testbed/smollm2-bf16 --drafter out/drafter \\
        --dflashkit-report runs/eval-chain/report.json --out runs/bench/vllm
CPU toy (a tiny random pair over a CPU twin of vllm.LLM with modelled step times, which the caller passes as
``main(argv, toy_api=...)``: the tests, and the lab's `python -m lab.standin_bench_vllm --out /tmp/bench_vllm_toy`;
the twin is a test double, tests/support/vllm_standin.py, so it does not ship with the benchmark).

Parts (--parts, default all), each writing its own JSON in --out (a failed part writes <part>.error.json with its
traceback and the others still run):
- serve -> a_tau.json, b_lossless.json, c_concurrency.json, d_prefix_caching.json, h_schedule.json (+ the report
  dir serve/ with schedule.json): one `dflashkit eval --engine vllm` run (eval/vllm_engine.py) over MT-bench (80
  prompts, 256 new tokens, greedy): (a) τ from vLLM's counters over every prompt once vs the dflashkit report's
  τ, and their ratio; (b) outputs with vs without the drafter; (c) output tok/s, TTFT and ITL per concurrency
  1 … 128 with and without the drafter (a level takes --max-requests-per-level prompts, cycled to fill its
  waves; each cell the median of --repeats runs); (d) τ and speed on MT-bench turn 2 with vLLM's prefix cache
  on and off; (h) with --serve-ks K..., every k's cells, the baselines of --baseline, the per-batch-size
  schedule derived from the cells and its own engine's cells.
- projection -> e_projection_times.json: a random-weight Qwen3-8B-shaped target (config.json only; vLLM's
  load_format="dummy" fills the weights, skip_tokenizer_init with prompt token ids, so no tokenizer) and a
  5-layer drafter of its dims (config written by dflashkit's DrafterConfig; --projection-drafter-weights also
  writes random weights with save_drafter). Measured: vLLM's time per decode step at each concurrency, without
  the drafter and with it at each k of --ks (steady decode: c random 128-token prompts, 128 new tokens, no stop).
  vLLM's share of the GPU is sized from the shape (``projection_memory``: weights, the KV cache of the largest
  level at the largest k, logits and a headroom) over the card's memory, so it fits an H100 80GB and an H200.
- projection_model -> e_projection.json (also written by projection when (a) exists): the speedup an 8B user
  would see at each k, E[accepted + 1] x t_AR_step / t_spec_step, with E[accepted + 1] = 1 + sum_j p_j from the
  testbed drafter's per-position acceptance measured in vLLM at that k (serve/report.json; else the first k
  positions of (a)) (a random drafter's own acceptance is not used), and the schedule an 8B user would deploy
  from those speedups. Modelled.
  The projection can run first, alone on the GPU, and its model after the serve part.
- tau_k -> g_tau_per_k.json: τ and per-position acceptance in vLLM for each drafter of --drafters at each
  num_speculative_tokens of --ks (one engine per pair, every prompt once, all at once, prefix cache off,
  eager: τ does not depend on timing), and for each pair the τ of its first j positions at the largest k
  (E[accepted within the first j] + 1), so a drafter's loss at small k is read beside what the same drafter
  gets from those positions in full blocks. A causal-in-block drafter (dflash_config.causal) should lose nothing.
- server -> f_server.json (+ the plan dir server/): `vllm serve` on 127.0.0.1 (no speculation; the drafter
  at the largest --serve-ks; when the serve part ran first, also the schedule of its schedule.json, each from the
  command its report prints, with VLLM_SERVER_DEV_MODE=1 so that /server_info tells what it serves), swept by
  `dflashkit eval --server none=URL kN=URL ... --engine-report serve` (eval/serving.py) with the same levels,
  repeats and requests per level, each cell beside the serve part's; or why a server could not start (the Python
  frontend needs uvicorn).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

from bench.common import QWEN3_8B, QWEN3_TOY

PARTS = ("serve", "tau", "projection", "projection_model", "server", "tau_k")
def write_json(out: Path, name: str, data: dict) -> None:
    (out / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")
    print(f"{name}: {json.dumps(data)[:300]}")


def api_for(args):
    """The vLLM calls of the run: the toy's twin when main was given one, else the installed vLLM."""
    from dflashkit.targets.vllm.api import load_api

    return load_api(args.toy_api)


def toy_pair(root: Path) -> tuple[str, str, str]:
    """A 6-token random Llama with a word tokenizer, a random drafter for it, and two-turn chats (CPU toy)."""
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    from dflashkit.drafter import DrafterConfig, build_drafter, save_drafter

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=6, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                            initializer_range=1.0)
    tf.LlamaForCausalLM(config).save_pretrained(root / "target")
    vocab = {t: i for i, t in enumerate(["<unk>", "<pad>", "<s>", "</s>", "w0", "w1"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = tf.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>",
                                           eos_token="</s>")
    tokenizer.chat_template = "{{ messages | map(attribute='content') | join('\n\n') }}"  # no turn markers
    tokenizer.save_pretrained(root / "target")
    save_drafter(build_drafter(DrafterConfig.for_target(config, num_hidden_layers=1, block_size=4, mask_token_id=5,
                                                        initializer_range=0.02)), root / "drafter")
    g = torch.Generator().manual_seed(1)

    def words(n: int) -> str:
        return " ".join(f"w{int(i)}" for i in torch.randint(0, 2, (n,), generator=g))

    with open(root / "chats.jsonl", "w") as f:
        for k in range(8):
            f.write(json.dumps({"id": f"toy{k}", "messages": [{"role": "user", "content": words(10)},
                                                             {"role": "user", "content": words(6)}]}) + "\n")
    return str(root / "target"), str(root / "drafter"), str(root / "chats.jsonl")


# ----------------------------------------------------------------------------- (a)-(d)
def part_serve(args, out: Path) -> None:
    from dflashkit.eval.options import EvalOptions
    from dflashkit.eval.vllm_engine import VllmEvalConfig, run_vllm_eval

    config = VllmEvalConfig(concurrency=args.concurrency, prefix_caching=args.prefix_caching,
                            max_new_tokens=args.max_new_tokens, gpu_memory_utilization=args.gpu_memory_utilization,
                            max_model_len=args.max_model_len, max_requests_per_level=args.max_requests_per_level,
                            min_waves=args.min_waves, cudagraph_capture=args.cudagraph_capture_size,
                            num_speculative_tokens=args.serve_ks, repeats=args.repeats, baselines=args.baseline,
                            schedule=json.loads(args.schedule) if args.schedule else None,
                            schedule_run=not args.no_schedule_run)
    opts = EvalOptions(target=args.target, drafter=args.drafter, out=out / "serve", dataset=args.dataset,
                       num_prompts=args.num_prompts)
    report = run_vllm_eval(opts, config, api=api_for(args))
    parts = {"a_tau": lambda: tau_comparison(report, args.dflashkit_report),
             "b_lossless": lambda: report["lossless"],
             "c_concurrency": lambda: {"verdict": report["verdict"], "levels": report["concurrency"],
                                       "max_new_tokens": args.max_new_tokens, "prompts": report["prompts"]},
             "d_prefix_caching": lambda: report["prefix_caching"],
             "h_schedule": lambda: {k: report[k] for k in ("plan_verdict", "schedule", "engines", "per_k",
                                                          "baselines", "ks", "timing")}}
    for name, build in parts.items():
        guarded(out, name, lambda: write_json(out, name, build()))


def part_tau(args, out: Path) -> None:
    """(a) again from the serve part's report, against a `dflashkit eval` report written after it (the GPU run
    serves the drafter first and evaluates it with dflashkit later, beside another training)."""
    served = out / "serve" / "report.json"
    if not served.is_file():
        raise FileNotFoundError(f"{served}: the tau part reads the serve part's report; run --parts serve first")
    if not args.dflashkit_report:
        raise ValueError("--parts tau compares with a dflashkit eval report: give --dflashkit-report")
    write_json(out, "a_tau", tau_comparison(json.loads(served.read_text()), args.dflashkit_report))


def tau_comparison(report: dict, dflashkit_report: str | None) -> dict:
    acc = report["acceptance"] or {}
    out = {"tau_vllm": acc.get("tau"), "per_position_acceptance_vllm": acc.get("per_position_acceptance"),
           "drafts": acc.get("drafts"), "num_speculative_tokens": report["num_speculative_tokens"],
           "prompts": report["prompts"], "measured": "vLLM spec-decode counters, every prompt once"}
    if dflashkit_report:
        other = json.loads(Path(dflashkit_report).read_text())
        served = report["args"]["datasets"]
        # the dflashkit report may hold more datasets than were served (MT-bench and HumanEval): compare on the
        # served one; its overall figures only when it holds exactly the served set
        same = other.get("datasets", {}).get(served[0]) if len(served) == 1 else None
        if same is None and sorted(other.get("datasets", {})) != sorted(served):
            raise ValueError(f"{dflashkit_report}: its datasets {sorted(other.get('datasets', {}))} are not the "
                             f"served {served}: evaluate the same prompts")
        scope = same or other["overall"]
        tau = scope["tau"]
        out.update({"tau_dflashkit": tau, "dflashkit_report": str(dflashkit_report),
                    "dflashkit_scope": served[0] if same is not None else "overall",
                    "per_position_acceptance_dflashkit": scope.get("per_position_acceptance"),
                    "ratio_vllm_over_dflashkit": acc["tau"] / tau if acc.get("tau") and tau else None,
                    "within_3_percent": abs(acc["tau"] / tau - 1) <= 0.03 if acc.get("tau") and tau else None})
        if scope.get("speedup") is not None:  # both ran: the engine's speedup first, the harness's named as such
            from dflashkit.eval.report import HARNESS_WORDS

            out.update({"engine_speedup": report.get("headline", {}).get("speedup"),
                        "harness_speedup": scope["speedup"], "harness_speedup_is": HARNESS_WORDS})
    return out


# ----------------------------------------------------------------------------- (g)
def served_prompts(target: str, datasets: list[str], num_prompts: int, scratch: str):
    """(served target dir, prompts as (name, token ids), stop ids) as `dflashkit eval --engine vllm` builds them."""
    from transformers import AutoTokenizer

    from dflashkit.drafter import vllm_rules as rules
    from dflashkit.eval.prompts import load_prompts, target_stop_ids
    from dflashkit.targets.loading import resolve_target_dir

    target_dir, _ = resolve_target_dir(target)
    served, _ = rules.vllm_target_dir(target_dir, scratch)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompts = [(f"{spec}#{p.id}", p.input_ids) for spec in datasets
               for p in load_prompts(spec, tokenizer, num_prompts)]
    return served, prompts, target_stop_ids(target_dir, tokenizer)


def part_tau_k(args, out: Path) -> None:
    import tempfile

    from dflashkit.eval.serving_plan import first_positions_tau
    from dflashkit.targets.vllm.api import close_engine, start_engine
    from dflashkit.targets.vllm.metrics import timed_generate

    drafters = dict(item.split("=", 1) for item in args.drafters) if args.drafters else {"drafter": args.drafter}
    api = api_for(args)
    scratch = tempfile.TemporaryDirectory(prefix="bench-vllm-")
    served, prompts, stop = served_prompts(args.target, args.dataset, args.num_prompts, scratch.name)
    params = api.sampling_params(max_tokens=args.max_new_tokens, temperature=0.0, stop_token_ids=stop)
    rows = []
    for name, drafter in drafters.items():
        for k in sorted(set(args.ks)):
            spec = {"method": "dflash", "model": str(Path(drafter).resolve()), "num_speculative_tokens": k}
            t0 = time.perf_counter()
            llm = start_engine(api, model=str(served), dtype="bfloat16", seed=0, enforce_eager=True,
                               gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
                               max_num_seqs=len(prompts), enable_prefix_caching=False, disable_log_stats=False,
                               speculative_config=spec)
            run = timed_generate(llm, api, prompts, len(prompts), params)
            close_engine(llm, api)
            acc = run["acceptance"] or {}
            rows.append({"drafter": name, "path": drafter, "k": k, "tau": acc.get("tau"), "drafts": acc.get("drafts"),
                         "per_position_acceptance": acc.get("per_position_acceptance"),
                         "output_tokens": run["output_tokens"], "engine_s": time.perf_counter() - t0})
            print(f"tau_k: {name} k={k} tau={acc.get('tau')}", flush=True)
    scratch.cleanup()
    for row in rows:  # the same drafter's first k positions when served with the largest k
        full = max((r for r in rows if r["drafter"] == row["drafter"]), key=lambda r: r["k"])
        if full["per_position_acceptance"] and row["tau"]:
            row["tau_first_k_at_max_k"] = first_positions_tau(full["per_position_acceptance"], row["k"])
            row["ratio_to_first_k_at_max_k"] = row["tau"] / row["tau_first_k_at_max_k"]
    write_json(out, "g_tau_per_k", {"rows": rows, "prompts": len(prompts), "datasets": args.dataset,
                                    "max_new_tokens": args.max_new_tokens, "standin": args.toy,
                                    "measured": "vLLM spec-decode counters; one engine per (drafter, k), eager, "
                                    "prefix cache off, every prompt once, all submitted together"})


# ----------------------------------------------------------------------------- (e)
GIB = 1 << 30
ACTIVATION_HEADROOM = 4 * GIB  # vLLM's profiling pass, CUDA graphs and allocator slack beyond weights and KV
KV_PAGE = 16  # tokens of one vLLM KV-cache block: a request holds whole blocks
MAX_UTILIZATION = 0.95  # more leaves nothing for the CUDA context outside vLLM's share


def layer_params(shape: dict) -> int:
    """Weights of one Qwen3 decoder layer (attention with q/k norms, SwiGLU MLP, two RMSNorms)."""
    h, i, hd = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    return h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h + 2 * hd


def projection_memory(shape: dict, drafter_layers: int, taps: int, max_num_seqs: int, tokens_per_request: int,
                      max_model_len: int, max_k: int, dtype_bytes: int = 2) -> dict:
    """Bytes the projection's engines need on the GPU (the largest of them: the drafter at ``max_k``): the target's
    and the drafter's weights, KV cache for ``max_num_seqs`` requests of ``tokens_per_request`` tokens (prompt,
    new tokens and the max_k + 1 lookahead slots, in whole pages) in every target and drafter layer, and at least
    one request of ``max_model_len`` (vLLM's start-up check), the logits of the largest step (fp32) and a fixed
    headroom for activations and CUDA graphs."""
    h, v = shape["hidden_size"], shape["vocab_size"]
    target = shape["num_hidden_layers"] * layer_params(shape) + v * h * (1 if shape["tie_word_embeddings"] else 2) + h
    drafter = drafter_layers * layer_params(shape) + taps * h * h + 2 * h  # fc, hidden_norm, norm
    kv_token = (shape["num_hidden_layers"] + drafter_layers) * 2 * shape["num_key_value_heads"] \
        * shape["head_dim"] * dtype_bytes
    pages = -(-(tokens_per_request + max_k + 1) // KV_PAGE)
    kv_tokens = max(max_num_seqs * pages * KV_PAGE, max_model_len)
    logits = max_num_seqs * (1 + max_k) * v * 4
    need = (target + drafter) * dtype_bytes + kv_tokens * kv_token + logits + ACTIVATION_HEADROOM
    return {"weights_bytes": (target + drafter) * dtype_bytes, "kv_bytes": kv_tokens * kv_token,
            "kv_tokens": kv_tokens, "logits_bytes": logits, "headroom_bytes": ACTIVATION_HEADROOM, "bytes": need}


def projection_utilization(need_bytes: int, total_bytes: int) -> float:
    """vLLM's gpu_memory_utilization that gives an engine ``need_bytes`` of a card of ``total_bytes``
    (torch.cuda.mem_get_info's total), rounded up to a hundredth; a card too small is named in one line."""
    fraction = -(-100 * need_bytes // total_bytes) / 100
    if fraction > MAX_UTILIZATION:
        raise RuntimeError(f"the projection needs {need_bytes / GIB:.1f} GiB, more than {MAX_UTILIZATION:.0%} of this "
                           f"GPU's {total_bytes / GIB:.1f} GiB: lower --concurrency or --projection-new-tokens")
    return fraction


def projection_gpu_memory_utilization(args, drafter_layers: int, taps: int) -> tuple[float, dict | None]:
    """(gpu_memory_utilization for the projection's engines, the sizing) from the 8B shape and the card's total
    memory; --projection-gpu-memory-utilization when given, the CPU twin's --gpu-memory-utilization (not modelled)."""
    if args.projection_gpu_memory_utilization is not None or args.toy:
        return args.projection_gpu_memory_utilization or args.gpu_memory_utilization, None
    import torch

    total = torch.cuda.mem_get_info()[1]
    sizing = projection_memory(QWEN3_8B, drafter_layers, taps, max(args.concurrency),
                               args.projection_prompt_tokens + args.projection_new_tokens, args.max_model_len,
                               max(args.ks))
    return projection_utilization(sizing["bytes"], total), {**sizing, "gpu_total_bytes": total}


def projection_dirs(root: Path, toy: bool, drafter_weights: bool) -> tuple[Path, Path]:
    """The 8B-shaped target dir (config.json; CPU toy: a tiny random Qwen3 with weights) and its 5-layer drafter."""
    import torch
    import transformers as tf

    from dflashkit.drafter import DrafterConfig, build_drafter, save_drafter

    shape = QWEN3_TOY if toy else QWEN3_8B
    target, drafter = root / "target", root / "drafter"
    target.mkdir(parents=True, exist_ok=True)
    hf = tf.Qwen3Config(**{k: v for k, v in shape.items() if k not in ("architectures", "model_type")})
    if toy:
        tf.Qwen3ForCausalLM(hf).save_pretrained(target)
    else:
        (target / "config.json").write_text(json.dumps(shape, indent=2) + "\n")
    dcfg = DrafterConfig.for_target(hf, num_hidden_layers=5, block_size=16, mask_token_id=shape["vocab_size"] - 1)
    if toy or drafter_weights:
        save_drafter(build_drafter(dcfg), drafter, dtype=None if toy else torch.bfloat16)
    else:
        drafter.mkdir(parents=True, exist_ok=True)
        (drafter / "config.json").write_text(json.dumps(dcfg.to_json_dict(), indent=2) + "\n")
    return target, drafter


def part_projection(args, out: Path) -> None:
    """The measured half: vLLM's time per decode step of the 8B-shaped pair, without the drafter and with it at
    each k of --ks (e_projection_times.json); then the model (part_projection_model) if the testbed acceptance
    (a) exists."""
    import torch

    from dflashkit.eval.serving_plan import capture_for
    from dflashkit.targets.vllm.api import close_engine, start_engine
    from dflashkit.targets.vllm.metrics import timed_generate

    ks = sorted(set(args.ks))
    target, drafter = projection_dirs(out / "projection", args.toy, args.projection_drafter_weights)
    api = api_for(args)
    levels = args.concurrency
    vocab = (QWEN3_TOY if args.toy else QWEN3_8B)["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompts = [(f"random{k}", torch.randint(10, vocab - 10, (args.projection_prompt_tokens,), generator=g).tolist())
               for k in range(max(levels))]
    params = api.sampling_params(max_tokens=args.projection_new_tokens, temperature=0.0, ignore_eos=True,
                                 **({} if args.toy else {"detokenize": False}))
    drafter_config = json.loads((drafter / "config.json").read_text())
    utilization, sizing = projection_gpu_memory_utilization(
        args, drafter_config["num_hidden_layers"], len(drafter_config["dflash_config"]["target_layer_ids"]))
    steps, graphs = {}, {}
    for k in [0] + ks[::-1]:  # the largest k first after no speculation: the headline, kept if a lease ends early
        spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": k} if k else None
        # CUDA graphs cover the largest level's step at k, as the serve part's engines (rule cudagraph_ceiling):
        # with vLLM's 512-token ceiling a step of c * (1 + k) tokens above it runs eagerly
        graphs[f"k{k}" if k else "ar"] = capture = capture_for(args.cudagraph_capture_size, levels, k)
        compilation = {"compilation_config": {"max_cudagraph_capture_size": capture}} if capture else {}
        llm = start_engine(api, model=str(target), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                           gpu_memory_utilization=utilization, max_model_len=args.max_model_len,
                           max_num_seqs=max(levels), disable_log_stats=False, enable_prefix_caching=False,
                           speculative_config=spec, **compilation)
        try:
            timed_generate(llm, api, prompts[:1], 1, params)  # warm-up
            for c in levels:
                run = timed_generate(llm, api, prompts[:c], c, params)
                decode_steps = run["acceptance"]["drafts"] if k and run["acceptance"] else run["decode_tokens"]
                steps.setdefault(str(c), {})[f"k{k}" if k else "ar"] = {
                    "step_ms": 1e3 * run["decode_s_sum"] / max(decode_steps, 1), "requests": c,
                    "decode_steps": decode_steps, "output_tokens_per_s": run["output_tokens_per_s"]}
        finally:
            close_engine(llm, api)
        print(f"projection: k={k} done", flush=True)
        # every engine's step times as soon as it ends: a lease that ends mid-part keeps the engines that ran
        write_json(out, "e_projection_times.partial", {"raw": steps, "max_cudagraph_capture_size": graphs})
    for per_level in steps.values():  # the largest k under its old name ("spec")
        per_level["spec"] = per_level[f"k{ks[-1]}"]
    write_json(out, "e_projection_times", {
        "target_shape": QWEN3_TOY if args.toy else QWEN3_8B, "drafter_layers": 5, "num_speculative_tokens": ks[-1],
        "ks": ks, "measured": "vLLM's time per decode step without the drafter and with it at each k, at each "
        "concurrency (random weights: load_format=dummy; steady decode, no stop)", "raw": steps,
        "max_cudagraph_capture_size": graphs, "gpu_memory_utilization": utilization, "memory_sizing": sizing,
        "standin": args.toy})
    (out / "e_projection_times.partial.json").unlink()
    if (out / "a_tau.json").exists() or (out / "serve" / "report.json").exists():
        part_projection_model(args, out)


def served_acceptance(args, out: Path) -> tuple[dict[int, list[float]], list[float], str]:
    """The testbed drafter's per-position acceptance: per k from the serve part's report when it measured
    several, the headline k's from (a), or a dflashkit eval report's."""
    tau_file, served = out / "a_tau.json", out / "serve" / "report.json"
    per_k = {}
    if served.exists():
        per_k = {int(k): v["per_position_acceptance"]
                 for k, v in json.loads(served.read_text()).get("per_k", {}).items()}
    if tau_file.exists():
        return per_k, json.loads(tau_file.read_text())["per_position_acceptance_vllm"], \
            f"vLLM's spec-decode counters ({tau_file.name}; per k: serve/report.json)"
    if per_k:  # the serve part alone: its largest k's positions stand for the k it did not serve
        return per_k, per_k[max(per_k)], f"vLLM's spec-decode counters (serve/report.json, k = {max(per_k)})"
    if args.acceptance_report:  # no vLLM acceptance of the testbed drafter: the dflashkit eval report's
        per_pos = json.loads(Path(args.acceptance_report).read_text())["overall"]["per_position_acceptance"]
        return per_k, per_pos, f"dflashkit eval ({args.acceptance_report})"
    raise FileNotFoundError(f"{tau_file}: the projection model needs the testbed drafter's per-position "
                            "acceptance; run the serve part first, or pass --acceptance-report REPORT.json")


def part_projection_model(args, out: Path) -> None:
    """The modelled half: speedup = E[accepted+1] x t_AR_step / t_spec_step per concurrency and k,
    E[accepted+1] from the testbed drafter's per-position acceptance in vLLM at that k (or the first k
    positions of the largest k's), the step times of part_projection; and the schedule an 8B user would deploy
    (per level the k with the highest modelled speedup above 1, else 0; eval/serving_plan.py's ranges)."""
    from dflashkit.eval.serving_plan import derive_schedule, first_positions_tau

    times_file = out / "e_projection_times.json"
    if not times_file.exists():
        raise FileNotFoundError(f"{times_file}: the projection model needs it; run the projection part first")
    per_k_acc, per_pos, source = served_acceptance(args, out)
    times = json.loads(times_file.read_text())
    ks = times.get("ks", [times["num_speculative_tokens"]])
    expected = {k: 1.0 + sum(per_k_acc[k]) if k in per_k_acc else first_positions_tau(per_pos, k) for k in ks}
    raw = sorted(times["raw"].items(), key=lambda kv: int(kv[0]))
    modelled = {k: {int(c): expected[k] * s["ar"]["step_ms"] / s[f"k{k}" if f"k{k}" in s else "spec"]["step_ms"]
                    for c, s in raw} for k in ks}
    schedule = derive_schedule({k: {c: {"speedup": v, "noise": 0.0} for c, v in per_c.items()}
                                for k, per_c in modelled.items()})
    largest = ks[-1]
    rows = [{"concurrency": int(c), "t_ar_step_ms": s["ar"]["step_ms"], "t_spec_step_ms": s["spec"]["step_ms"],
             "spec_over_ar_step": s["spec"]["step_ms"] / s["ar"]["step_ms"],
             "projected_speedup": expected[largest] * s["ar"]["step_ms"] / s["spec"]["step_ms"]} for c, s in raw]
    write_json(out, "e_projection", {
        **{k: v for k, v in times.items() if k != "raw"},
        "modelled": "speedup = E[accepted+1] x t_AR_step / t_spec_step, E[accepted+1] = 1 + sum of the testbed "
        "drafter's per-position acceptance at that k; the schedule's speedup at a level is its k's (1.0 at k = 0: "
        "the cost of serving a schedule at k = 0 is not modelled)", "acceptance_source": source,
        "expected_tokens_per_step": expected[largest], "per_position_acceptance": per_pos, "levels": rows,
        "per_k": {str(k): {"expected_tokens_per_step": expected[k],
                           "projected_speedup": {str(c): v for c, v in modelled[k].items()}} for k in ks},
        "schedule": schedule, "schedule_projected_speedup": {
            c: (modelled[v["k"]][int(c)] if v["k"] else 1.0) for c, v in schedule["per_level"].items()},
        "raw": times["raw"]})


# ----------------------------------------------------------------------------- (f)
SERVER_PORTS = {"none": 8731, "drafter": 8732, "schedule": 8733}


def report_server_command(serve_command: str, port: int, gpu_memory_utilization: float) -> list[str]:
    """A serve command that `--parts serve`'s report prints, as the process that runs it: the same words after
    `vllm serve`, through this Python's vLLM, on loopback at ``port``, with the in-process engines' GPU share."""
    import shlex

    words = shlex.split(serve_command.split("  #")[0])  # a DFlash2 line ends with a comment
    if words[:2] != ["vllm", "serve"]:
        raise ValueError(f"not a vllm serve command: {serve_command!r}")
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", *words[2:], "--host", "127.0.0.1", "--port",
            str(port), "--gpu-memory-utilization", str(gpu_memory_utilization)]


def report_servers(args, out: Path) -> dict[str, list[str]] | None:
    """name -> command for the servers of `--parts serve`'s report when it ran first: no speculation, the drafter
    at the largest k and the schedule of schedule.json, each from the command the report prints; None without
    the report."""
    engine = out / "serve" / "report.json"
    if not engine.exists():
        return None
    report = json.loads(engine.read_text())
    commands = {"none": report["engines"]["none"]["serve_command"]}
    k = f"k{report['ks'][-1]}"
    commands[k] = report["engines"][k]["serve_command"]
    schedule = out / "serve" / "schedule.json"
    if schedule.exists():
        written = json.loads(schedule.read_text())
        commands[written["engine"]] = written["serve_command"]
    ports = {"none": SERVER_PORTS["none"], k: SERVER_PORTS["drafter"]}
    return {name: report_server_command(command, ports.get(name, SERVER_PORTS["schedule"]),
                                        args.gpu_memory_utilization) for name, command in commands.items()}


def server_command(args, port: int, k: int | None, target: str) -> list[str]:
    """`vllm serve` as the in-process engine of `--parts serve` is built: the target directory it was given
    (``target``: a copy without a GGUF quantization_config where needed), max_num_seqs = the largest level, CUDA
    graphs per --cudagraph-capture-size as there (auto: covering its decode step at k), prefix caching vLLM's
    default (on)."""
    from dflashkit.eval.serving_plan import capture_for

    top = max(args.concurrency)
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", target, "--host", "127.0.0.1", "--port",
           str(port), "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--max-model-len",
           str(args.max_model_len), "--max-num-seqs", str(top)]
    capture = capture_for(args.cudagraph_capture_size, args.concurrency, k or 0)
    if capture:
        cmd += ["--max-cudagraph-capture-size", str(capture)]
    if k:
        cmd += ["--speculative-config", json.dumps({"method": "dflash", "model": args.drafter,
                                                    "num_speculative_tokens": k})]
    return cmd


def server_target(target: str, out: Path) -> Path:
    """The directory `vllm serve` is given: the target's, or (a config.json with a GGUF quantization_config,
    which vLLM refuses: the testbed's) the copy without it that the in-process engines serve, under out/server."""
    from dflashkit.drafter import vllm_rules as rules
    from dflashkit.targets.loading import resolve_target_dir

    return rules.vllm_target_dir(resolve_target_dir(target)[0], out / "server")[0]


def wait_for_server(server, port: int, seconds: float) -> bool:
    import urllib.request

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and server.poll() is None:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            return True
        except OSError:
            time.sleep(2)
    return False


def server_vs_engine(plan: dict, engine_report: dict | None) -> dict:
    """Each server cell beside the in-process engine's cell of the same name and level (`--parts serve`'s
    report): tok/s of both, their ratio, both speedups against no speculation, both taus."""
    if not engine_report:
        return {}
    cells = {}
    for name, levels in plan["engines"].items():
        engine = engine_report.get("engines", {}).get(name)
        if engine is None:
            continue
        for c, cell in levels.items():
            other = engine["levels"].get(str(c))
            if other is None:
                continue
            cells.setdefault(name, {})[str(c)] = {
                "server_tokens_per_s": cell["output_tokens_per_s"],
                "in_process_tokens_per_s": other["output_tokens_per_s"],
                "server_over_in_process": cell["output_tokens_per_s"] / other["output_tokens_per_s"],
                "server_speedup": cell.get("speedup"), "in_process_speedup": other.get("speedup"),
                "server_tau": cell.get("tau"), "in_process_tau": other.get("tau")}
    return cells


def part_server(args, out: Path) -> None:
    """Two `vllm serve` on loopback (no speculation; the drafter at k = the largest --serve-ks, else
    block_size - 1), swept by `dflashkit eval --server none=URL kN=URL` with the in-process part's levels, repeats
    and requests per level, and compared cell by cell with `--parts serve`'s report when it ran first."""
    import importlib.util

    if args.toy:
        write_json(out, "f_server", {"ran": False, "why": "a CPU toy run (a twin of vllm.LLM) has no vLLM server"})
        return
    missing = [m for m in ("uvicorn", "fastapi", "vllm.entrypoints.openai.api_server")
               if importlib.util.find_spec(m) is None]
    if missing:  # the slim vLLM has no Rust frontend; the Python one needs these
        write_json(out, "f_server", {"ran": False, "why": f"vllm serve cannot start: missing modules {missing}"})
        return
    k = max(args.serve_ks) if args.serve_ks else json.loads(
        (Path(args.drafter) / "config.json").read_text()).get("block_size", 16) - 1
    served = server_target(args.target, out)
    # the serve part's printed commands when it ran first (the servers then go beside its engines), else built here
    commands = report_servers(args, out) or {name: server_command(
        args, SERVER_PORTS["none" if kk is None else "drafter"], kk, str(served))
        for name, kk in (("none", None), (f"k{k}", k))}
    started, servers, logs, urls = {}, [], [], []
    try:
        for name, cmd in commands.items():  # one after the other: vLLM's start-up memory check
            port = int(cmd[cmd.index("--port") + 1])
            logs.append(open(out / f"f_server_{name}.log", "w"))
            t0 = time.perf_counter()
            servers.append(subprocess.Popen(cmd, stdout=logs[-1], stderr=subprocess.STDOUT,  # dev mode: /server_info
                                            env=dict(os.environ, VLLM_USE_RUST_FRONTEND="0",
                                                     VLLM_SERVER_DEV_MODE="1")))
            if not wait_for_server(servers[-1], port, 300):
                tail = (out / f"f_server_{name}.log").read_text()[-2000:]
                write_json(out, "f_server", {"ran": False, "why": f"vllm serve ({name}) did not come up: {tail}"})
                return
            started[name] = {"command": cmd, "startup_s": time.perf_counter() - t0}
            urls.append(f"{name}=http://127.0.0.1:{port}")
        from dflashkit.eval.options import EvalOptions
        from dflashkit.eval.serving import run_sweep

        engine = out / "serve" / "report.json"
        plan = run_sweep(EvalOptions(server=urls, dataset=args.dataset, num_prompts=args.num_prompts,
                                     concurrency=args.concurrency, max_new_tokens=args.max_new_tokens,
                                     out=out / "server", repeats=args.repeats,
                                     max_requests_per_level=args.max_requests_per_level, min_waves=args.min_waves,
                                     engine_report=engine.parent if engine.exists() else None))
        write_json(out, "f_server", {
            "ran": True, "servers": started, "plan": plan,
            "vs_in_process": server_vs_engine(plan, json.loads(engine.read_text()) if engine.exists() else None)})
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
        for log in logs:
            log.close()


def guarded(out: Path, name: str, run) -> bool:
    """Run one part; on failure its traceback goes to <name>.error.json and the caller goes on."""
    try:
        run()
        return True
    except Exception as error:  # one failed part must not lose the others
        write_json(out, f"{name}.error", {"error": f"{type(error).__name__}: {error}",
                                          "traceback": traceback.format_exc()})
        return False


def main(argv=None, toy_api=None) -> int:
    """The benchmark over the installed vLLM; ``toy_api`` (a targets/vllm/api.py ``VllmApi`` over a CPU twin of
    vllm.LLM) runs the CPU toy instead: that twin, and a tiny random pair unless --target and --drafter name one."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target")
    p.add_argument("--drafter")
    p.add_argument("--drafters", nargs="+", metavar="NAME=DIR", help="tau_k: several drafters (default: --drafter)")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 3, 7, 15],
                   help="tau_k and projection: num_speculative_tokens values")
    p.add_argument("--serve-ks", type=int, nargs="+", default=None,
                   help="serve: num_speculative_tokens values (default: block_size - 1); several give the schedule")
    p.add_argument("--repeats", type=int, default=3, help="serve: runs per engine and level")
    p.add_argument("--schedule", help="serve: a JSON [[first, last, k], ...] served instead of the derived one")
    p.add_argument("--no-schedule-run", action="store_true",
                   help="serve: derive the schedule but start no engine for it (eval's flag)")
    p.add_argument("--baseline", nargs="+", choices=["ngram", "mtp", "v1"], default=[], help="serve: baselines")
    p.add_argument("--prefix-caching", nargs="+", choices=["on", "off"], default=["on", "off"])
    p.add_argument("--out", required=True)
    p.add_argument("--dflashkit-report", help="report.json of `dflashkit eval` (chain) on the same prompts")
    p.add_argument("--acceptance-report", help="projection_model without (a): the per-position acceptance of "
                   "this dflashkit eval report.json instead of vLLM's")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=[p for p in PARTS if p != "tau"],
                   help="default: all but tau (serve writes a_tau.json itself when given --dflashkit-report)")
    p.add_argument("--dataset", nargs="+", default=["builtin:mtbench"])
    p.add_argument("--num-prompts", type=int, default=80)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    p.add_argument("--max-requests-per-level", type=int, default=32, help="prompts per level, cycled to fill waves")
    p.add_argument("--min-waves", type=int, default=1, help="serve: waves of c requests per level, at least")
    p.add_argument("--cudagraph-capture-size", default="auto", help="serve: auto, vllm or N (eval's flag)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.25)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--projection-gpu-memory-utilization", type=float, default=None,
                   help="projection: vLLM's share of the GPU (default: sized from the 8B shape's weights, the KV "
                        "cache of the largest level and a headroom, over the card's memory)")
    p.add_argument("--projection-prompt-tokens", type=int, default=128)
    p.add_argument("--projection-new-tokens", type=int, default=128)
    p.add_argument("--projection-drafter-weights", action="store_true",
                   help="write the 8B drafter's random weights (2 GB) instead of config.json alone")
    args = p.parse_args(argv)
    args.toy_api, args.toy = toy_api, toy_api is not None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.toy and not (args.target and (args.drafter or args.drafters)):
        args.target, args.drafter, chats = toy_pair(out / "toy")
        args.dataset = [chats]
    if {"serve", "server", "tau_k"} & set(args.parts):
        if not (args.target and (args.drafter or args.drafters)):
            p.error("--target and --drafter are needed")
    started, ok = time.perf_counter(), True
    for name in args.parts:
        ok &= guarded(out, name, lambda: globals()[f"part_{name}"](args, out))
    write_json(out, "timing", {"total_s": time.perf_counter() - started, "parts": args.parts, "ok": ok})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
