"""What one drafter layer keeps for its backward in training: DFlash beside DFlash2, at the testbed's width.

    python -m lab.bench_layer_saved --out runs/bench/layer_saved/cpu.json              # CPU, compiled
    python -m lab.bench_layer_saved --device cuda --out runs/bench/layer_saved/h200.json
    TRITON_INTERPRET=1 python -m lab.bench_layer_saved --conv-kernel \
        --out runs/bench/layer_saved/cpu_conv_kernel.json

One decoder layer of each architecture (SmolLM2-135M's drafter: hidden 576, 9 heads of 64, 3 KV heads, MLP 1536;
DFlash2 with its default convolution, 2 taps over groups of 16 channels, its weights moved off the identity
start) runs forward on ``--blocks`` blocks of 16 positions beside ``--context`` context positions under bf16
autocast, compiled for symbolic shapes as the trainer compiles its layers (``--eager``: not compiled). Every
tensor the autograd graph keeps for the backward is counted once (by its storage): MiB and that size in units of
one bf16 activation of the block ([positions, 576]). The memory a layer keeps is what its backward reads back
and, compiled, what its forward writes beyond its output: a measure of the convolutions' cost in memory, which
the CPU gives as well as a GPU (the partitioner that decides what is kept is the same code). ``--conv-kernel``
adds a third row, DFlash2 with its convolutions by train/dynamic_conv.py's kernels (``conv_kernel: true``),
where Triton runs: CUDA, or the CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import argparse

import torch

from bench.common import write_json
from dflashkit.drafter import DrafterConfig, build_drafter
from dflashkit.targets.runtime.kernels import triton_available
from dflashkit.train.dynamic_conv import install

WIDTH = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
DFLASH2 = dict(architecture="dflash2", conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_top_k=16)


def layer_of(architecture: str, device: torch.device):
    """One decoder layer of a one-layer drafter at the testbed's width, and its rotary embedding."""
    cfg = DrafterConfig(num_target_layers=30, vocab_size=49152, num_hidden_layers=1,
                        target_layer_ids=[1, 8, 14, 20, 27], block_size=16, mask_token_id=0,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e5},
                        **WIDTH, **(DFLASH2 if architecture == "dflash2" else {}))
    torch.manual_seed(0)
    model = build_drafter(cfg).to(device)
    with torch.no_grad():  # the convolutions off their identity start, as in training
        for name, p in model.named_parameters():
            if "conv" in name:
                p.add_(0.01 * torch.randn_like(p))
    return model.layers[0], model.rotary_emb


def kept_for_backward(architecture: str, blocks: int, context: int, device: torch.device, compiled: bool,
                      conv_kernel: bool = False) -> dict:
    layer, rotary = layer_of(architecture, device)
    if conv_kernel:
        install(layer, device)
    if compiled:
        layer.compile(dynamic=True)
    q = 16 * blocks
    block = torch.randn(1, q, WIDTH["hidden_size"], device=device, requires_grad=True)
    ctx = torch.randn(1, context, WIDTH["hidden_size"], device=device)
    cos, sin = rotary(block, torch.arange(context + q, device=device)[None])
    kept: dict[int, int] = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autocast(device.type, dtype=torch.bfloat16), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(block, ctx, cos, sin)
    out.float().sum().backward()  # the graph runs through: what was kept was used
    total = sum(kept.values())
    return {"architecture": architecture + ("+conv_kernel" if conv_kernel else ""), "kept_mib": total / 2**20,
            "kept_tensors": len(kept),
            "block_activations": total / (q * WIDTH["hidden_size"] * 2)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--blocks", type=int, default=128, help="blocks of 16 draft positions")
    ap.add_argument("--context", type=int, default=2048, help="context positions the block attends to")
    ap.add_argument("--eager", action="store_true", help="the layers not compiled")
    ap.add_argument("--conv-kernel", action="store_true", help="also DFlash2 with conv_kernel (module docstring)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if args.conv_kernel and not triton_available(device):  # before any row is measured
        raise SystemExit(f"--conv-kernel: Triton does not run on {device} (CUDA, or the CPU with TRITON_INTERPRET=1)")
    forms = [("dflash", False), ("dflash2", False)] + [("dflash2", True)] * args.conv_kernel
    rows = [kept_for_backward(a, args.blocks, args.context, device, not args.eager, k) for a, k in forms]
    result = {"device": str(device), "compiled": not args.eager, "blocks": args.blocks, "context": args.context,
              "torch": torch.__version__, "layers": rows,
              "dflash2_extra_block_activations": rows[1]["block_activations"] - rows[0]["block_activations"]}
    for r in rows:
        print(f"{r['architecture']}: keeps {r['kept_mib']:.1f} MiB, {r['block_activations']:.2f} block activations")
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
