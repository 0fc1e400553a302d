"""Extraction throughput against the plain target forward and the output_hidden_states=True approach.

    python bench/bench_extract.py --target /root/testbed/smollm2-bf16 --out-dir /tmp/bench-shards
    python bench/bench_extract.py --random-qwen3-8b --layer-ids 1 9 17 25 33 --batch 8 --seq 2048

On the same batches (random token ids, every token real), median tokens/s over --repeats runs of --batches
batches each:
- forward: plain ``model(input_ids)`` (logits included), what serving the target costs;
- hidden_states: ``output_hidden_states=True`` then concatenating the chosen layers, still on the GPU (the
  approach of trainers that keep every layer; it writes nothing, so it is the baseline's best case);
- dflashkit: the extraction path: hooks on target_layer_ids with early exit (no later layers, no lm_head),
  real-token gather, codec encoding on the GPU, copy to the host and shards written to --out-dir on the
  background writer thread, ``close()`` (the last fsync) included in the time.
Prints a table (ratios computed from the same run) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dflashkit.target.capture import LayerCapture, real_tokens
from dflashkit.extract.shards import bytes_per_token
from dflashkit.target.loading import Target, find_decoder, load_target
from dflashkit.extract.writer import ShardWriter


def random_qwen3_8b(device) -> Target:
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    dec = find_decoder(model)
    return Target(model=model, tokenizer=None, config=cfg, path="random:qwen3-8b", model_dir=Path("."),
                  family="qwen3", decoder=dec, layers=dec.layers, embed_tokens=dec.embed_tokens,
                  embedding_scale=1.0, final_norm=dec.norm, lm_head=model.lm_head)


def timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--target")
    ap.add_argument("--random-qwen3-8b", action="store_true")
    ap.add_argument("--layer-ids", type=int, nargs="+")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batches", type=int, default=4, help="batches per timed run")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out-dir", default=None, help="where shards go (default: a temp dir on the local disk)")
    ap.add_argument("--json", default="bench_extract.json")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    target = random_qwen3_8b(dev) if args.random_qwen3_8b else load_target(args.target, dtype=torch.bfloat16,
                                                                          device=dev)
    ids = args.layer_ids or target.default_layer_ids(5)
    vocab = target.vocab_size
    batches = [torch.randint(0, vocab, (args.batch, args.seq), device=dev) for _ in range(args.batches)]
    mask = torch.ones_like(batches[0])
    tokens = args.batch * args.seq * args.batches
    model = target.model

    @torch.inference_mode()
    def plain():
        for x in batches:
            model(input_ids=x, attention_mask=mask, use_cache=False)

    @torch.inference_mode()
    def all_states():
        for x in batches:
            hs = model(input_ids=x, attention_mask=mask, use_cache=False, output_hidden_states=True).hidden_states
            torch.cat([hs[i + 1] for i in ids], dim=-1)

    results = {"target": target.path, "layer_ids": ids, "batch": args.batch, "seq": args.seq,
               "tokens_per_run": tokens, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    results["forward"] = timed(plain, args.repeats)
    results["hidden_states"] = timed(all_states, args.repeats)
    base = Path(args.out_dir or tempfile.mkdtemp(prefix="dflashkit-bench-"))
    for codec in ("bf16", "fp8"):
        out = base / codec
        written = []

        def extract():
            shutil.rmtree(out, ignore_errors=True)
            writer = ShardWriter(out, {"codec": codec, "schema_version": 1}, shard_bytes=1 << 30)
            with LayerCapture(target, ids) as capture:
                for n, x in enumerate(batches):
                    hidden, _ = capture(x, mask)
                    flat = torch.cat(real_tokens(hidden, mask))
                    lengths = mask.sum(1).tolist()
                    writer.add_batch(list(range(n * args.batch, (n + 1) * args.batch)), lengths,
                                     x[mask.bool()].int(), torch.ones(flat.shape[0], dtype=torch.bool), flat)
            m = writer.close()
            written.append(sum(s["bytes"] for s in m["shards"]))

        results[f"dflashkit_{codec}"] = timed(extract, args.repeats)
        results[f"bytes_per_token_{codec}"] = written[-1] / tokens
        results[f"feature_bytes_per_token_{codec}"] = bytes_per_token(codec, len(ids) * target.hidden_size)
    shutil.rmtree(base, ignore_errors=True)
    med = {k: tokens / statistics.median(results[k]) for k in
           ("forward", "hidden_states", "dflashkit_bf16", "dflashkit_fp8")}
    results["tokens_per_s"] = med
    for codec in ("bf16", "fp8"):
        results[f"ratio_vs_forward_{codec}"] = med[f"dflashkit_{codec}"] / med["forward"]
        results[f"ratio_vs_hidden_states_{codec}"] = med[f"dflashkit_{codec}"] / med["hidden_states"]
    json.dump(results, open(args.json, "w"), indent=2)
    print(f"target {target.path}, taps {ids}, batch {args.batch} x {args.seq}, median of {args.repeats}")
    print("| path | tok/s | ÷ forward | ÷ hidden_states | bytes/token on disk |")
    print("|---|---|---|---|---|")
    for k in ("forward", "hidden_states", "dflashkit_bf16", "dflashkit_fp8"):
        bpt = f"{results['bytes_per_token_' + k[10:]]:.0f}" if k.startswith("dflashkit") else "-"
        print(f"| {k} | {med[k]:,.0f} | {med[k] / med['forward']:.3f} | {med[k] / med['hidden_states']:.3f} | {bpt} |")


if __name__ == "__main__":
    main()
