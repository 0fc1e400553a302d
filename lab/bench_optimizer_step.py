"""The optimizer step alone on the testbed drafter's shape: AdamW, Muon with one matrix per Newton-Schulz stack,
Muon as the trainer runs it (same-shape matrices stacked, train/muon.py) and the same with Newton-Schulz in bf16
(``muon_ns_dtype: bfloat16``), timed in turn on the same gradients.

Design choices:
- The drafter is built as the trainer builds one for the SmolLM2-135M testbed (``--smollm2-shape``: 5 layers of
  576, the config bench_train_throughput.py uses; ``--toy`` for a CPU check) and each optimizer as the trainer
  builds it (train/setup_drafter.build_optimizer). The step is the whole optimizer step, nothing else: what the change
  to stacks can move, without the drafter pass around it.
- The forms alternate step by step (each its own copy of the drafter and its own state) so a drift of the GPU
  clock falls on all of them; each step is synchronised before and after. Median of ``--steps`` after ``--warmup``.
- ``muon_one`` sets ``STACK_BYTES = 0`` around its steps: Newton-Schulz one matrix at a time, the step before the
  stacks; its momentum and decay stay foreach ops, so the gap to the step before is larger than the gap shown.

    python -m lab.bench_optimizer_step --smollm2-shape --out runs/bench/optimizer_step_h200.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from bench.bench_train_throughput import target_config
from dflashkit.drafter import DrafterConfig, build_drafter, default_target_layer_ids
from dflashkit.train import muon
from dflashkit.train.config import TrainConfig
from dflashkit.train.setup_drafter import build_optimizer

FORMS = ("adamw", "muon_one", "muon", "muon_bf16")


def step_once(opt, params, grads, device, one_matrix: bool) -> float:
    for p, g in zip(params, grads):
        p.grad = g
    saved = muon.STACK_BYTES
    if one_matrix:
        muon.STACK_BYTES = 0
    try:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start
    finally:
        muon.STACK_BYTES = saved


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smollm2-shape", action="store_true", help="the testbed drafter's shape (5 x 576)")
    ap.add_argument("--toy", action="store_true", help="a tiny drafter (a CPU check, not a measurement)")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--device", default=None, help="default: cuda when there is one")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.smollm2_shape == args.toy:
        ap.error("give one of --smollm2-shape, --toy")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tcfg = target_config("smollm2" if args.smollm2_shape else "toy", None)
    layers = 5 if args.smollm2_shape else 2
    taps = default_target_layer_ids(tcfg.num_hidden_layers, 5 if args.smollm2_shape else 3)  # as the bench's
    dcfg = DrafterConfig.for_target(tcfg, num_hidden_layers=layers, block_size=16, target_layer_ids=taps,
                                    mask_token_id=tcfg.vocab_size - 1)
    torch.manual_seed(0)
    base = build_drafter(dcfg).to(device)
    forms = {}
    for form in FORMS:
        model = copy.deepcopy(base)
        cfg = TrainConfig(optimizer="adamw" if form == "adamw" else "muon", lr=6e-4, weight_decay=0.01,
                          muon_ns_dtype="bfloat16" if form == "muon_bf16" else "float32")
        params = [p for p in model.parameters() if p.requires_grad]
        forms[form] = (build_optimizer(cfg, model, "NO"), params)
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = [p.shape for p in forms["muon"][1]]
    times = {form: [] for form in FORMS}
    for i in range(args.warmup + args.steps):
        grads = [torch.randn(s, generator=gen, device=device) * 1e-3 for s in shapes]
        order = FORMS if i % 2 == 0 else FORMS[::-1]
        for form in order:
            opt, params = forms[form]
            t = step_once(opt, params, [g.clone() for g in grads], device, form == "muon_one")
            if i >= args.warmup:
                times[form].append(t * 1e3)
    matrices = [p for g in forms["muon"][0].param_groups if g["use_muon"] for p in g["params"]]
    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "shape": "smollm2" if args.smollm2_shape else "toy",
           "parameters": sum(p.numel() for p in forms["muon"][1]), "muon_matrices": len(matrices),
           "muon_stacks": len(muon.stacks(matrices, muon.STACK_BYTES)), "steps": args.steps,
           "warmup": args.warmup,
           "forms": {f: {"step_ms_median": statistics.median(t), "step_ms": [round(x, 4) for x in t]}
                     for f, t in times.items()}}
    one, stacked = res["forms"]["muon_one"]["step_ms_median"], res["forms"]["muon"]["step_ms_median"]
    res["muon_one_over_stacked"] = one / stacked
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"{res['device']}: {res['muon_matrices']} matrices in {res['muon_stacks']} stacks; median step ms " +
          ", ".join(f"{f} {v['step_ms_median']:.3f}" for f, v in res["forms"].items()) +
          f"; muon one matrix / stacked {res['muon_one_over_stacked']:.2f}x")
    return res


if __name__ == "__main__":
    main()
