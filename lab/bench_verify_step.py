"""Verification step vs autoregressive step of a target, in the same harness (CUDA).

    python -m lab.bench_verify_step --target random:qwen3-1b --prefix 1024 --nodes 16 32 64 128 --out verify.json
    python -m lab.bench_verify_step --target random:smollm2-135m --out verify_testbed_shape.json
    python -m lab.bench_verify_step --target /root/testbed/smollm2-bf16 --out verify_testbed.json
CPU toy (eager only, fp32; proves the harness runs):
    python -m lab.bench_verify_step --target random:toy --prefix 64 --nodes 4 8 --out /tmp/verify_toy.json

The target runs through dflashkit's TargetVerifier (its own KV cache, tree attention). After a prefill of
--prefix tokens, one forward over a best-first tree of N nodes (N = 1 is the AR step) is timed three ways:
eagerly (cuda_graphs=False: Python and launch overhead included, as a plain decode loop sees it), as the
verifier's forward with its CUDA graph (input copies + replay: what `dflashkit eval` pays per step), and as the
bare graph replay (the GPU's own time). verify/AR = time(N nodes) / time(1 node). Random-weight presets have the
shapes of real models; timing does not depend on the weights. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.common import seconds_per_call

PRESETS = {
    # a few-layer toy for the CPU run of this script
    "random:toy": ("LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=1000)),
    # ~1B parameters in the decoder (plus embeddings): Qwen3 attention shapes (16 q heads, 8 kv heads, d 128)
    "random:qwen3-1b": ("Qwen3Config", dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=20,
                                            num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                            vocab_size=151936, tie_word_embeddings=False)),
    # the testbed's architecture (SmolLM2-135M: Llama, 30 layers, hidden 576, 9/3 heads, d 64)
    "random:smollm2-135m": ("LlamaConfig", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                                num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                                vocab_size=49152, tie_word_embeddings=True)),
}


def load_model(spec: str, dtype, device: str):
    import transformers

    if spec in PRESETS:
        name, fields = PRESETS[spec]
        config = getattr(transformers, name)(**fields, max_position_embeddings=65536)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(spec, dtype=dtype).to(device)
    return model.eval()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="random:qwen3-1b", help=f"{', '.join(PRESETS)} or an HF model dir")
    parser.add_argument("--prefix", type=int, nargs="+", default=[1024])
    parser.add_argument("--nodes", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--backend", default="auto", choices=["auto", "triton", "torch"])
    parser.add_argument("--out", default="bench_verify_step.json")
    args = parser.parse_args(argv)
    from dflashkit import launch
    from dflashkit.drafter import default_target_layer_ids
    from dflashkit.eval.tree import build_tree
    from dflashkit.eval.verifier import TargetVerifier

    device = launch.local_device()
    cuda = device.type == "cuda"
    if cuda:
        from triton.testing import do_bench
    model = load_model(args.target, launch.default_dtype(device), device)
    layers = model.config.num_hidden_layers
    layer_ids = default_target_layer_ids(layers, 5) if layers >= 12 else list(range(1, layers))  # toy: fewer taps
    rows = []
    print(f"target {args.target} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params), "
          f"backend {args.backend}")
    print(f"{'prefix':>6} {'nodes':>5} | {'eager ms':>8} {'step ms':>8} {'graph ms':>8} | {'eager/AR':>8} "
          f"{'graph/AR':>8}")

    for prefix in args.prefix:
        prompt = torch.randint(0, model.config.vocab_size, (prefix,), device=device)
        verifiers = {}
        for graphs in ((False, True) if cuda else (False,)):  # the CPU runs eagerly
            verifier = TargetVerifier(model, layer_ids, args.backend, cuda_graphs=graphs)
            verifier.reserve(prefix + max(args.nodes) + 8)
            verifier.forward(prompt, last_logits_only=True)
            verifier.commit(list(range(prefix)))
            verifiers[graphs] = verifier
        base = {}
        for n in [1, *args.nodes]:
            tree = build_tree(0, torch.randn(15, 1000), budget=n, top_k=8)
            tokens, parents, depths = tree.tensors("cpu")
            times = {}
            for graphs, verifier in verifiers.items():  # forward without commit: the same step again and again
                times[graphs] = 1e3 * seconds_per_call(lambda: verifier.forward(tokens, parents, depths, pad_to=n),
                                                        20, 3, device)
            replay = do_bench(verifiers[True].steps[n, False].graph.replay, warmup=10, rep=100) if cuda else None
            if n == 1:
                base = {"eager": times[False], "graph": replay}
            row = {"target": args.target, "prefix": prefix, "nodes": n, "eager_ms": times[False],
                   "graph_step_ms": times.get(True), "graph_ms": replay, "eager_over_ar": times[False] / base["eager"],
                   "graph_over_ar": replay / base["graph"] if cuda else None}
            rows.append(row)
            cells = [row[k] for k in ("eager_ms", "graph_step_ms", "graph_ms", "eager_over_ar", "graph_over_ar")]
            print(f"{prefix:6d} {n:5d} | " + " ".join("       —" if c is None else f"{c:8.3f}" for c in cells))
        for verifier in verifiers.values():
            verifier.close()
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                   "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
