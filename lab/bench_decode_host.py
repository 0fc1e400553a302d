"""Host work per decoding round: what a chain round, a tree round and an AR step cost outside the captured steps.

CPU (a tiny random target and drafter, fp32, eager; the measurement this file is made for):
    python -m lab.bench_decode_host --out /tmp/decode_host.json
One H200 (a real pair, CUDA graphs; adds host syncs per round from CUDA's sync debug mode):
    python -m lab.bench_decode_host --target /root/testbed/smollm2-bf16 --drafter DRAFTER \\
        --out runs/bench/decode_host.json

Every step that the evaluator replays as a CUDA graph on the GPU (the verifier's static steps, the drafter's
static step, the cache compaction) runs eagerly on the CPU through one `_compute` method; the script times those
calls and subtracts them from the round's wall time. What is left is the host's own work per round: acceptance,
tree building, cache bookkeeping, input copies, Python between the steps, which on the GPU sits between graph
replays. A second, untimed pass counts per round the torch calls made outside the captured steps (each a kernel
launch or a Python-level tensor operation on the GPU) and the reads of tensor values to the host (tolist, item,
int, bool, cpu, nonzero: each one a host sync when the tensor lives on the GPU). On CUDA a third pass counts the
synchronizing CUDA calls with torch.cuda.set_sync_debug_mode. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import time
import warnings

import torch
from torch.overrides import TorchFunctionMode

HOST_READS = {"tolist", "item", "__int__", "__bool__", "__float__", "cpu", "numpy", "nonzero"}


class _Count(TorchFunctionMode):
    """Counts torch calls and host reads made while no captured step runs."""

    def __init__(self):
        super().__init__()
        self.calls = self.reads = 0
        self.inside = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.inside:
            name = getattr(func, "__name__", "")
            self.calls += 1
            self.reads += name in HOST_READS
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def captured_steps(counter: _Count | None = None):
    """Times every `_compute` of a step that is a CUDA graph on the GPU, and keeps it (and the prefill, which is
    not part of a round) out of the counts."""
    from dflashkit.eval import draft_step, verifier

    kv_cache = importlib.import_module("dflashkit.eval.kv_cache") if importlib.util.find_spec(
        "dflashkit.eval.kv_cache") else None
    classes = [getattr(m, c) for m, c in ((verifier, "StaticStep"), (kv_cache, "Compaction"),
                                          (draft_step, "DraftStep")) if m is not None and hasattr(m, c)]
    methods = [(c, "_compute", True) for c in classes] + [(verifier.TargetVerifier, "_prefill", False)]
    spent = {"s": 0.0}
    originals = {(c, name): getattr(c, name) for c, name, _ in methods}

    def wrap(original, timed):
        def call(self, *args, **kwargs):
            if counter is not None:
                counter.inside += 1
            start = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                if timed:
                    spent["s"] += time.perf_counter() - start
                if counter is not None:
                    counter.inside -= 1
        return call

    for c, name, timed in methods:
        setattr(c, name, wrap(originals[c, name], timed))
    try:
        yield spent
    finally:
        for (c, name), original in originals.items():
            setattr(c, name, original)


def toy_pair(vocab: int, block_size: int):
    import transformers as tf

    from dflashkit.drafter import DrafterConfig, build_drafter

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)
    target = tf.LlamaForCausalLM(config).eval()
    drafter = build_drafter(DrafterConfig.for_target(config, num_hidden_layers=1, block_size=block_size,
                                                     mask_token_id=vocab - 1)).eval()
    return target, drafter


def measure(decoder, prompts: list[list[int]], autoregressive: bool, cuda: bool) -> dict:
    run = decoder.generate_autoregressive if autoregressive else decoder.generate
    for p in prompts:  # warm-up: every shape these prompts take is built (captured) before the timed pass
        run(p)
    with captured_steps() as spent:
        results = [run(p) for p in prompts]
    rounds = sum(len(r.tokens) - 1 for r in results) if autoregressive else \
        sum(len(r.acceptance_lengths) for r in results)
    decode_s = sum(r.decode_s for r in results)
    counter = _Count()
    with captured_steps(counter), counter:
        for p in prompts:
            run(p)
    out = {"rounds": rounds, "tokens": sum(len(r.tokens) - 1 for r in results),
           "round_ms": 1e3 * decode_s / rounds,
           "captured_ms": 1e3 * spent["s"] / rounds if not cuda else None,
           "host_ms": 1e3 * (decode_s - spent["s"]) / rounds if not cuda else None,
           "torch_calls_per_round": counter.calls / rounds, "host_reads_per_round": counter.reads / rounds}
    if cuda:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for p in prompts:
                    run(p)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        out["cuda_syncs_per_round"] = sum("synchronizing" in str(w.message) for w in caught) / rounds
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", help="HF model dir or spec (default: a tiny random Llama)")
    parser.add_argument("--drafter", help="drafter export (with --target)")
    parser.add_argument("--vocab", type=int, default=512, help="tiny target: vocabulary")
    parser.add_argument("--block-size", type=int, default=16, help="tiny drafter: block size")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--tree-budget", type=int, default=64)
    parser.add_argument("--tree-top-k", type=int, default=4)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (1: steadier host timing)")
    parser.add_argument("--out", default="runs/bench/decode_host.json")
    args = parser.parse_args(argv)

    from dflashkit import launch
    from dflashkit.eval.decoder import DecodeConfig, SpeculativeDecoder

    torch.set_num_threads(args.threads)
    device = launch.local_device(None if args.target else "cpu")  # the toy pair: host timing on the CPU
    if args.target:
        from dflashkit.drafter import load_drafter
        from dflashkit.targets.loading import load_target

        dtype = launch.default_dtype(device, args.dtype)
        target = load_target(args.target, dtype=dtype, device=device).model
        drafter = load_drafter(args.drafter, dtype=dtype, device=device)
    else:
        target, drafter = toy_pair(args.vocab, args.block_size)
    vocab = target.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=generator).tolist() for _ in range(args.prompts)]
    rows = []
    for name, mode, autoregressive in [("AR step", "chain", True), ("chain round", "chain", False),
                                       ("tree round", "tree", False)]:
        config = DecodeConfig(mode=mode, tree_budget=args.tree_budget, tree_top_k=args.tree_top_k,
                              max_new_tokens=args.max_new_tokens)
        decoder = SpeculativeDecoder(target, drafter, config)
        try:
            rows.append({"step": name, **measure(decoder, prompts, autoregressive, device.type == "cuda")})
        finally:
            decoder.close()
    keys = ["step", "rounds", "round_ms", "captured_ms", "host_ms", "torch_calls_per_round", "host_reads_per_round"]
    keys += ["cuda_syncs_per_round"] if device.type == "cuda" else []
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(f"{row[k]:.3f}" if isinstance(row[k], float) else str(row[k]) for k in keys))
    result = {"rows": rows, "device": str(device), "torch": torch.__version__, "args": vars(args)}
    with open(args.out, "w") as f:
        f.write(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
