"""Generated tokens/s of ``regenerate --target``: the slot generator against Hugging Face ``generate``.

    python -m bench.bench_regenerate --toy --prompts 24 --max-new-tokens 16 --slots 8 --out /tmp/bench_regen.json
    python -m bench.bench_regenerate --target /root/testbed/smollm2-bf16 --data .cache/gpu/sharegpt.jsonl \\
        --out runs/bench/regenerate_h200.json
    python -m bench.bench_regenerate --target /root/testbed/smollm2-bf16 --data .cache/gpu/sharegpt.jsonl \\
        --no-hf --decode-attention compare --out runs/bench/regenerate_decode_attention_h200.json
    torchrun --standalone --nproc_per_node 2 -m bench.bench_regenerate --target /root/testbed/smollm2-bf16 \\
        --data .cache/gpu/sharegpt.jsonl --out runs/bench/regenerate_2xh200.json

The same prompts (the first user turn of the first --prompts conversations of --data, rendered with the target's
chat template; longer than --max-prompt-length: left out) and the same --max-new-tokens go through
- hf_generate: ``model.generate`` in batches of --hf-batch prompts (sorted by length, left padding), greedy
  (--hf-prompts: only the first N of the same prompts, to bound its time);
- slots: ``SlotGenerator`` with --batch slots (static cache, continuous batching, CUDA-graph decode step on a
  GPU), greedy, after a warm-up that allocates the cache and captures the graph; its decode attention is
  --decode-attention (sdpa: masked SDPA over the longest live slot's length; triton: the kernel that reads each
  slot up to its own length). ``compare`` runs the same prompts with sdpa, then (the first generator freed)
  with triton, and adds ``slots_triton``, ``triton_vs_sdpa`` (tokens/s ratio) and ``triton_agree`` (share of
  answers identical to the sdpa run's) to the JSON.
tokens/s = new tokens (up to the stop token) / wall time, each side counting its own. ``agree`` is the share of
prompts whose greedy answers are identical (bf16 rounding may part them; fp32 on the CPU should give 1.0).
Launched with several ranks, rank 0 first runs every prompt alone (one GPU), then every rank runs its share
(prompt i on rank i % world) and the table adds the multi-GPU tokens/s and its ratio to the one-GPU run.
Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from bench.common import sync, write_json
from dflashkit import launch
from dflashkit.extract.data.rendering import BadSample, normalize_record, render
from dflashkit.extract.data.sources import iter_records, prompt_turns
from dflashkit.extract.generation.answerers import AnswerSettings, TargetGenerator
from dflashkit.extract.generation.generator import SlotGenerator


def save_toy_target(out: Path) -> None:
    """A random 2-layer Llama with the testbed's tokenizer and chat template (CPU-sized)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from dflashkit.targets.loading import resolve_target_dir

    tok = AutoTokenizer.from_pretrained(resolve_target_dir("testbed:smollm2")[0])
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True, initializer_range=0.3)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    tok.save_pretrained(out)


def first_turn_prompts(gen: TargetGenerator, data: list[str], n: int, max_prompt_length: int) -> list[list[int]]:
    """Token ids of the first user turn (system turns before it kept: extract/data/sources.prompt_turns, the one
    definition) of the first `n` usable conversations, rendered as regeneration renders them."""
    prompts = []
    for item in iter_records(data):
        if len(prompts) >= n:
            break
        if item.bad is not None:
            continue
        try:
            kind, messages, _ = normalize_record(item.record, require_assistant=False)
            turns = prompt_turns(messages) if kind == "chat" else []
            if not turns:
                continue
            ids = gen.tok(render(gen.tok, turns, gen.cfg, add_generation_prompt=True),
                          add_special_tokens=False)["input_ids"]
        except BadSample:
            continue
        if len(ids) <= max_prompt_length:
            prompts.append(ids)
    return prompts


def run_slots(gen: TargetGenerator, prompts, max_new: int) -> tuple[list[list[int]], float]:
    sync(gen.device)
    t = time.perf_counter()
    out = gen.slots.generate(prompts, max_new) if prompts else []
    sync(gen.device)
    return out, time.perf_counter() - t


def warm_up(slots: SlotGenerator, prompts, max_new: int, batch: int) -> None:
    """Allocate the cache, capture the decode steps, compile the kernels."""
    slots.reserve(max(len(p) for p in prompts) + max_new)
    slots.generate([max(prompts, key=len)] * min(4, batch), 4)


def slot_row(slots: SlotGenerator, out, seconds: float) -> dict:
    tokens = sum(map(len, out))
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "cuda_graph": slots.graphed,
            "decode_attention": slots.decode_attention, "kernel_layers": slots.kernel_layers, **slots.stats}


def run_hf(gen: TargetGenerator, prompts, batch: int) -> tuple[list[list[int]], float]:
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list = [None] * len(prompts)
    sync(gen.device)
    t = time.perf_counter()
    for start in range(0, len(order), batch):
        rows = order[start:start + batch]
        for i, tokens in zip(rows, gen.hf_generate([prompts[i] for i in rows], seed=0)):
            out[i] = tokens
    sync(gen.device)
    return out, time.perf_counter() - t


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=None, help="HF model dir, .gguf or testbed:smollm2")
    ap.add_argument("--toy", action="store_true", help="a random 2-layer Llama built here (CPU smoke run)")
    ap.add_argument("--data", default="builtin:sharegpt", help="conversations (as for regenerate --data)")
    ap.add_argument("--prompts", type=int, default=2048)
    ap.add_argument("--max-new-tokens", type=int, default=384)
    ap.add_argument("--max-prompt-length", type=int, default=512)
    ap.add_argument("--batch", type=int, default=512, help="slots of the slot generator")
    ap.add_argument("--hf-batch", type=int, default=None, help="prompts per HF generate call (default: --batch)")
    ap.add_argument("--hf-prompts", type=int, default=None,
                    help="the HF baseline runs the first N of the same prompts only (default: all)")
    ap.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--no-hf", action="store_true", help="skip the Hugging Face baseline")
    ap.add_argument("--no-cuda-graph", action="store_true")
    ap.add_argument("--decode-attention", choices=("sdpa", "triton", "compare"), default="triton",
                    help="the slot generator's decode attention; compare: sdpa, then triton on the same prompts "
                         "(one rank only)")
    ap.add_argument("--out", default="bench_regenerate.json")
    args = ap.parse_args(argv)
    if bool(args.target) == args.toy:
        ap.error("give --target or --toy")
    rank, world, _ = launch.ranks()
    if args.decode_attention == "compare" and world > 1:
        ap.error("--decode-attention compare runs on one rank: launch it without torchrun")
    launch.join_process_group("cpu")  # several ranks: gloo, their few collectives move CPU tensors
    device = str(launch.local_device())
    target = args.target
    if args.toy:  # rank 0 writes it, every rank loads it
        run_id = os.environ.get("TORCHELASTIC_RUN_ID") if world > 1 else None
        toy = Path(tempfile.gettempdir()) / f"dflashkit-toy-{run_id}" if run_id else Path(tempfile.mkdtemp()) / "toy"
        if rank == 0:
            save_toy_target(toy)
        launch.barrier()
        target = str(toy)
    gen = TargetGenerator(target, AnswerSettings(max_new_tokens=args.max_new_tokens), batch_size=args.batch,
                          dtype=args.dtype, device=device, cuda_graph=not args.no_cuda_graph,
                          decode_attention="triton" if args.decode_attention == "triton" else "sdpa")
    if gen.slots is None:
        raise SystemExit(f"{target}: has recurrent layers; the slot generator does not apply")
    prompts = first_turn_prompts(gen, [args.data], args.prompts, args.max_prompt_length)
    warm_up(gen.slots, prompts, args.max_new_tokens, args.batch)
    result = {"target": gen.name, "device": torch.cuda.get_device_name(device) if device != "cpu" else "cpu",
              "dtype": str(next(gen.target.model.parameters()).dtype), "prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "batch": args.batch, "world_size": world,
              "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts), "date": time.strftime("%Y-%m-%d %H:%M")}
    if rank == 0:
        slot_out, slot_s = run_slots(gen, prompts, args.max_new_tokens)
        result["slots"] = slot_row(gen.slots, slot_out, slot_s)
        if args.decode_attention == "compare":
            gen.slots = None  # its cache and graphs go before the second generator allocates its own
            gc.collect()
            if device != "cpu":
                torch.cuda.empty_cache()
            gen.slots = SlotGenerator(gen.target, gen.stop_ids, num_slots=args.batch,
                                      cuda_graph=not args.no_cuda_graph, decode_attention="triton")
            warm_up(gen.slots, prompts, args.max_new_tokens, args.batch)
            triton_out, triton_s = run_slots(gen, prompts, args.max_new_tokens)
            result["slots_triton"] = slot_row(gen.slots, triton_out, triton_s)
            result["triton_vs_sdpa"] = result["slots_triton"]["tokens_per_s"] / result["slots"]["tokens_per_s"]
            result["triton_agree"] = sum(a == b for a, b in zip(slot_out, triton_out)) / len(prompts)
        if not args.no_hf:
            hf_prompts = prompts[: args.hf_prompts]
            hf_out, hf_s = run_hf(gen, hf_prompts, args.hf_batch or args.batch)
            hf_tokens = sum(map(len, hf_out))
            result["hf_generate"] = {"seconds": hf_s, "tokens": hf_tokens, "tokens_per_s": hf_tokens / hf_s,
                                     "prompts": len(hf_prompts), "batch": args.hf_batch or args.batch}
            result["speedup"] = result["slots"]["tokens_per_s"] / result["hf_generate"]["tokens_per_s"]
            result["agree"] = sum(a == b for a, b in zip(slot_out, hf_out)) / len(hf_prompts)
    if world > 1:
        import torch.distributed as dist

        launch.barrier()
        mine = [p for i, p in enumerate(prompts) if i % world == rank]
        out, seconds = run_slots(gen, mine, args.max_new_tokens)
        stats = torch.tensor([seconds, float(sum(map(len, out)))], dtype=torch.float64)
        wall = stats[:1].clone()
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        dist.all_reduce(stats, op=dist.ReduceOp.SUM)
        if rank == 0:
            tps = stats[1].item() / wall.item()
            result["slots_all_ranks"] = {"seconds": wall.item(), "tokens": int(stats[1].item()),
                                         "tokens_per_s": tps, "scaling": tps / result["slots"]["tokens_per_s"]}
        launch.leave_process_group()
    if rank == 0:
        write_json(args.out, result)
        print(f"target {gen.name} ({result['dtype']}, {result['device']}), {len(prompts)} prompts "
              f"(mean {result['mean_prompt_tokens']:.0f} tokens), {args.max_new_tokens} new tokens max, "
              f"{args.batch} slots" + (f"; HF: {result['hf_generate']['prompts']} prompts in batches of "
                                       f"{result['hf_generate']['batch']}" if "hf_generate" in result else ""))
        print("| generator | tokens | seconds | tokens/s | ratio |")
        print("|---|---|---|---|---|")
        hf_tps = result.get("hf_generate", {}).get("tokens_per_s")

        def slots_name(r: dict) -> str:
            return f"slots, {r['decode_attention']} attention" + (" (CUDA graph)" if r["cuda_graph"] else "")

        rows = [("hf_generate", result.get("hf_generate"), 1.0),
                (slots_name(result["slots"]), result["slots"], result.get("speedup"))]
        if "slots_triton" in result:
            r = result["slots_triton"]
            rows.append((slots_name(r), r, r["tokens_per_s"] / hf_tps if hf_tps else None))
        rows.append((f"slots x {world} ranks", result.get("slots_all_ranks"),
                     result.get("slots_all_ranks", {}).get("scaling")))
        for name, r, ratio in rows:
            if r:
                print(f"| {name} | {r['tokens']:,} | {r['seconds']:.2f} | {r['tokens_per_s']:,.0f} | "
                      f"{'' if ratio is None else f'{ratio:.2f}x'} |")
        if "agree" in result:
            print(f"greedy answers identical to hf_generate: {result['agree']:.1%}")
        if "slots_triton" in result:
            print(f"triton / sdpa decode attention: {result['triton_vs_sdpa']:.2f}x tokens/s; greedy answers "
                  f"identical: {result['triton_agree']:.1%}")
        if world > 1:
            print(f"the {world}-rank row's ratio is to the one-rank slots row")
        print(f"wrote {args.out}")
    if args.toy and rank == 0:
        shutil.rmtree(Path(target).parent if world == 1 else target, ignore_errors=True)
    return result


if __name__ == "__main__":
    main()
