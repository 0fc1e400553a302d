"""Training throughput: the drafter step offline and online, the target's share of an online step, DDP scaling,
and MFU; context tokens/s throughout (real tokens of the packed sequences, padding excluded).

    python -m bench.bench_train_throughput --toy --out runs/bench/train_throughput_toy.json      # CPU, tiny
    python -m bench.bench_train_throughput --target /root/testbed/smollm2-bf16 \\
        --out runs/bench/train_throughput_smollm2.json
    accelerate launch --num_processes 2 -m bench.bench_train_throughput --target /root/testbed/smollm2-bf16 \\
        --out runs/bench/train_throughput_smollm2_ddp.json
    python -m bench.bench_train_throughput --qwen3-8b --out runs/bench/train_throughput_qwen3_8b.json
    python -m bench.bench_train_throughput --target /root/testbed/smollm2-bf16 --attention flex,split \
        --out runs/bench/train_throughput_smollm2_split.json   # the same steps with each block attention
    python -m bench.bench_train_throughput --smollm2-shape --drafter-architecture dflash,dflash2 --modes offline \
        --out runs/bench/dflash2_pair.json     # both drafters, their steps in turn (below), DFlash2 against DFlash
Defaults: the testbed shape (5 drafter layers, block 16, 512 anchors, sequences of 256-1024 tokens, 8192 tokens
per micro-batch, G=2); --qwen3-8b packs 4096 tokens per micro-batch.

One optimizer step is the trainer's own: train/train_step.train_step on the objects train/setup.py builds for a
run (a TrainConfig of this script's settings, ``make_accelerator``, ``build_model`` for the target,
``build_optimizer``, ``accelerator.prepare``, ``compile_layers``, ``drafter_pass_options``): G micro-batches
(--grad-accum), each a packed run of whole sequences under --micro-batch-tokens (train/data.collate_blocks: anchors
per sequence, block mask kept inside each sequence), the step's one collective (global loss denominators, stop
vote, non-finite flags), per micro-batch the drafter pass + backward under accelerate (bf16 autocast over fp32
master weights on a GPU, no_sync until the last micro-batch under DDP), gradient clipping at TrainConfig's 1.0,
AdamW at the peak lr (the schedule's factor is 1: it costs nothing). Each drafter layer is torch.compile'd as the
trainer does (train/drafter_pass.compile_layers), and with it the fused (compiled) logit kernels of the loss
(--no-compile: neither; --eager-loss: compiled layers, eager loss), flex_attention block masks. The device is the
trainer's: accelerate's (this rank's GPU, else the CPU); ``--device cpu`` hides the GPUs (no other value: the
trainer has no device setting).
Measured, after --warmup steps (compilation included there), over --steps steps:
- offline: the drafter step on micro-batches already collated on the device (random features, as shards
  read by DataLoader workers would arrive);
- target: the target forward alone on the same micro-batches (targets/capture.LayerCapture: hooks on the tapped
  layers, early exit after the deepest; the micro-batch's sequences as one right-padded batch);
- online: what one online step does: per micro-batch the target forward, then collate_blocks on its features,
  then the drafter step; target share = target time / online time.
- with ``--drafter-architecture dflash,dflash2`` (one process, offline only): both drafters built alike, their
  steps timed in turn on the same micro-batches (step i of one, then of the other, the order alternating), so a
  ratio is not moved by the host's drift between two runs (two runs of the same DFlash2 code differed by 11%,
  lab/BENCHMARKS.md); JSON ``paired``: each one's figures and ``dflash2_vs_dflash`` (throughput ratio over all steps,
  of the median steps, and each step pair's); ``--profile FILE`` profiles each into FILE with its name added
  (operators, then the same apart by their inputs' shapes);
- under ``accelerate launch`` (or torchrun) with W processes: first rank 0 alone (the same train_step on the
  unwrapped drafter and the run's optimizer, its collective left to rank 0; the other ranks wait), then all ranks
  with DDP; scaling = summed tokens/s of the W ranks / tokens/s of rank 0 alone.
FLOPs (2 per multiply-add; only real tokens and visible attention pairs count): drafter forward = fc over the
context, per layer q/o projections and MLP over block tokens, k/v over context + block tokens, attention over
the visible pairs; backward 2x forward, except fc (its input needs no gradient) 1x; lm_head forward + input
gradient over the B-1 predicted positions of real blocks; target forward = every layer that runs (early exit:
layers after the deepest tap never run and are not counted), causal attention pairs per sequence. MFU divides by
989 TFLOP/s (H100/H200 SXM dense bf16 datasheet); the measured 8192^3 bf16 matmul rate is reported too
(bench/common.py holds both).
``--smollm2-shape`` builds a random-weight target of the testbed's shape (SmolLM2-135M: the same drafter and the
same target compute as ``--target /root/testbed/smollm2-bf16``, no weights to carry). ``--layer-compile automatic``
compiles the drafter layers as torch.compile does by default (the trainer's form until 2026-12-01; the default
is train/drafter_pass.compile_layers as the trainer calls it). ``--layer-probe FILE`` (one process) then times
the first drafter layer alone (forward+backward, flex kernels profiled) on the inputs it received in training, on
other inputs, and against fresh compiles of the same layer.
``--qwen3-8b`` builds a random-weight Qwen3-8B target from its config in code (bench/common.QWEN3_8B, 36 layers;
--target-layers cuts it for memory, and the FLOPs then count only the layers that exist and run) and a drafter of
its dimensions.
JSON: the keys of before, plus ``train_config`` (the TrainConfig fields the step reads). Since the step became
train_step: the drafter is TrainConfig's (``causal`` false, as its default), and ``--device`` takes only ``cpu``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
from contextlib import nullcontext
from pathlib import Path

import torch

from bench.common import PEAK_BF16, matmul_rate, qwen3_8b_config, random_target, timed, write_json
from dflashkit import launch
from dflashkit.drafter import DrafterConfig, default_target_layer_ids
from dflashkit.targets.capture import LayerCapture
from dflashkit.targets.loading import Target, load_target
from dflashkit.train.config import MUON_NS_DTYPES, TrainConfig
from dflashkit.train.data import CollateOptions, PackedBlocks, collate_blocks, pack_order
from dflashkit.train.drafter_pass import PassOptions, compile_layers, forward_blocks, mask_backend
from dflashkit.train.metrics import MetricSums
from dflashkit.train.pass_options import drafter_pass_options
from dflashkit.train.setup import make_accelerator
from dflashkit.train.setup_drafter import build_model, build_optimizer, conv_kernels
from dflashkit.train.train_step import StepVotes, train_step


# --------------------------------------------------------------------------- target, drafter, data
def target_config(kind: str, layers: int | None):
    """The config of a random-weight target built in code: "toy" (tiny Llama), "smollm2" (the testbed's
    SmolLM2-135M shape) or "qwen3-8b"."""
    from transformers import LlamaConfig

    if kind == "qwen3-8b":
        cfg = qwen3_8b_config(num_hidden_layers=layers or 36)
    elif kind == "smollm2":
        cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers or 30,
                          num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                          rope_parameters={"rope_type": "default", "rope_theta": 1e5}, tie_word_embeddings=True)
    else:
        cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers or 6,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          tie_word_embeddings=False)
    return cfg


def make_pool(n: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[dict]:
    """n random sequences, lengths uniform in [min_len, max_len]; the first eighth is the prompt (no loss)."""
    g = torch.Generator().manual_seed(seed)
    pool = []
    for i in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        mask = torch.ones(length, dtype=torch.bool)
        mask[: max(1, length // 8)] = False
        pool.append({"input_ids": torch.randint(0, vocab - 1, (length,), generator=g), "loss_mask": mask,
                     "index": i})
    return pool


def train_pack(k: int, block_size: int, num_anchors: int, toy: bool):
    """The k-th micro-batch of this benchmark's default pool (rank 0), laid out as it lays it out."""
    lo, hi, budget, n = (24, 96, 256, 24) if toy else (256, 1024, 8192, 128)
    pool = make_pool(n, lo, hi, vocab=1000, seed=1000)
    packs = pack_order(list(range(len(pool))), [s["input_ids"].numel() for s in pool], budget)
    samples = [{**pool[i], "hidden": torch.zeros(pool[i]["input_ids"].numel(), 1)} for i in packs[k % len(packs)]]
    return collate_blocks(samples, CollateOptions(block_size, 0, num_anchors, seed=0), check_finite=False)


def kernel_times(fn, calls: int = 5) -> dict:
    """Device ms per call of each CUDA kernel with "flex" in its name over ``calls`` calls of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if "flex" in e.key and t:
            out[e.key] = max(out.get(e.key, 0.0), t / 1e3 / calls)  # the same kernel may be listed twice
    return out


def padded_batch(samples: list[dict], pin: bool) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    lens = [s["input_ids"].numel() for s in samples]
    ids = torch.zeros(len(samples), max(lens), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for b, s in enumerate(samples):
        ids[b, : lens[b]], attn[b, : lens[b]] = s["input_ids"], 1
    return (ids.pin_memory(), attn.pin_memory(), lens) if pin else (ids, attn, lens)


# --------------------------------------------------------------------------- FLOPs
def drafter_flops(d: DrafterConfig, layout: PackedBlocks) -> float:
    """Useful FLOPs of one forward + backward of the drafter on a micro-batch (full-attention layers)."""
    H, inter, B, V = d.hidden_size, d.intermediate_size, d.block_size, d.vocab_size
    hq, hkv, hd = d.num_attention_heads, d.num_key_value_heads, d.head_dim
    n = layout.block_offsets[-1]  # real blocks
    L, Q = layout.num_tokens, n * B
    visible = B * int((layout.anchors[:n] - layout.context_start[:n]).sum()) + n * B * B
    fc = 2 * L * d.num_taps * H * H
    layer = 2 * Q * H * hq * hd * 2 + 2 * (L + Q) * H * hkv * hd * 2 + 2 * Q * 3 * H * inter + 4 * visible * hq * hd
    head = 2 * n * (B - 1) * H * V
    return 2 * fc + 3 * d.num_hidden_layers * layer + 2 * head


def target_flops(target: Target, layer_ids: list[int], lens: list[int]) -> float:
    c = target.config
    H, inter, hq = c.hidden_size, c.intermediate_size, c.num_attention_heads
    hkv = getattr(c, "num_key_value_heads", hq)
    hd = getattr(c, "head_dim", None) or H // hq
    last = target.num_layers - 1
    runs = target.num_layers if last in layer_ids else max(layer_ids) + 1  # early exit after the deepest tap
    params = H * hq * hd * 2 + H * hkv * hd * 2 + 3 * H * inter
    return float(sum(runs * (2 * params * t + 4 * (t * (t + 1) // 2) * hq * hd) for t in lens))


def muon_layout(optimizer) -> dict | None:
    """How the Muon step orthogonalises the drafter's matrices: their count, the stacks (train/muon.py
    ``stacks``), the byte cap that made them and Newton-Schulz's dtype; None for AdamW."""
    from dflashkit.train import muon

    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds the optimizer
    if not isinstance(inner, muon.Muon):
        return None
    matrices = [p for g in inner.param_groups if g["use_muon"] for p in g["params"]]
    dtype = inner.ns_dtype_on(matrices[0].device) if matrices else inner.ns_dtype
    return {"matrices": len(matrices), "stacks": len(muon.stacks(matrices, muon.STACK_BYTES)),
            "stack_bytes": muon.STACK_BYTES, "ns_dtype": str(dtype).removeprefix("torch.")}


# --------------------------------------------------------------------------- steps
STEP_FIELDS = ("loss", "gamma", "dpace_alpha", "labels", "causal", "grad_accum", "max_grad_norm", "mixed_precision",
               "optimizer", "lr", "compile", "attention", "loss_chunk_tokens", "drafter_architecture",
               "selector_kernel", "conv_kernel", "selector_unary_grad", "muon_ns_dtype")  # in the JSON


def train_config(args, attention: str, compiled: bool, gpu: bool, architecture: str) -> TrainConfig:
    """The TrainConfig of this script's settings (the drafter's layer ids and mask token follow the target)."""
    return TrainConfig(num_hidden_layers=args.drafter_layers, block_size=args.block_size, num_anchors=args.num_anchors,
                       micro_batch_tokens=args.micro_batch_tokens, grad_accum=args.grad_accum, loss=args.loss,
                       loss_chunk_tokens=args.chunk_tokens, compile=compiled, attention=attention,
                       mixed_precision="bf16" if gpu else "no", lr=1e-4, wandb=False, progress=False,
                       drafter_architecture=architecture, selector_kernel=args.selector_kernel,
                       conv_kernel=args.conv_kernel, selector_unary_grad=args.selector_unary_grad,
                       optimizer=args.optimizer, muon_ns_dtype=args.muon_ns_dtype)


class OneProcess:
    """The run's accelerator as rank 0 sees it when it measures alone while the other ranks wait: one process, so
    train_step's collective stays on this rank; everything else (device, accumulation, backward, clipping) is
    the accelerator's own."""

    num_processes = 1

    def __init__(self, accelerator):
        self.accelerator = accelerator

    def reduce(self, tensor, reduction="sum"):
        return tensor

    def __getattr__(self, name):
        return getattr(self.accelerator, name)


class Step:
    """train/train_step.train_step with the run's objects: one optimizer step per call on the given micro-batches;
    the previous step's non-finite flags ride in the next step's collective, as in the trainer."""

    def __init__(self, model, optimizer, accelerator, head, cfg: TrainConfig, options: PassOptions):
        self.model, self.optimizer, self.accelerator, self.head = model, optimizer, accelerator, head
        self.cfg, self.options = cfg, options
        self.sums = MetricSums(options.block_size - 1, accelerator.device)
        self.nonfinite = None

    def __call__(self, micros: list[PackedBlocks]) -> None:
        result = train_step(self.model, self.optimizer, self.accelerator, self.head, micros, cfg=self.cfg,
                            lr_factor=1.0, sums=self.sums, pass_options=self.options,
                            votes=StepVotes(nonfinite=self.nonfinite))
        if result.stopped:
            raise RuntimeError(f"the benchmark's training diverged ({result.diverged}); its timings mean nothing")
        self.nonfinite = result.nonfinite


def summarize(times: list[float], tokens: list[int], flops: list[float], peak: float | None) -> dict:
    total = sum(times)
    r = {"step_ms_median": 1e3 * statistics.median(times), "steps": len(times),
         "step_ms": [round(1e3 * t, 2) for t in times], "step_tokens": tokens,
         "ctx_tokens_per_s": sum(tokens) / total, "tflops_per_s": sum(flops) / total / 1e12}
    r["mfu"] = r["tflops_per_s"] * 1e12 / peak if peak else None
    return r


# --------------------------------------------------------------------------- main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_argument_group("target")
    src.add_argument("--target", help="HF directory of the target (e.g. /root/testbed/smollm2-bf16)")
    src.add_argument("--qwen3-8b", action="store_true", help="random-weight Qwen3-8B target built in code")
    src.add_argument("--toy", action="store_true", help="tiny random target and drafter (runs on a CPU)")
    src.add_argument("--smollm2-shape", action="store_true",
                     help="random-weight target of the testbed's shape (SmolLM2-135M) built in code")
    src.add_argument("--target-layers", type=int, default=None, help="cut a random target to this many layers")
    src.add_argument("--layer-ids", type=int, nargs="+", help="tapped target layers (default: 5 evenly spaced)")
    shape = ap.add_argument_group("drafter and data")
    shape.add_argument("--drafter-layers", type=int, default=5)
    shape.add_argument("--block-size", type=int, default=16)
    shape.add_argument("--num-anchors", type=int, default=512)
    shape.add_argument("--min-len", type=int, default=256)
    shape.add_argument("--max-len", type=int, default=1024)
    shape.add_argument("--micro-batch-tokens", type=int, default=8192)
    shape.add_argument("--grad-accum", type=int, default=2)
    shape.add_argument("--pool", type=int, default=128, help="sequences per rank")
    shape.add_argument("--chunk-tokens", type=int, default=2048, help="logit rows alive at once in the loss")
    shape.add_argument("--loss", default="dpace")
    shape.add_argument("--drafter-architecture", default="dflash",
                       help="dflash, or dflash2: the convolutions and the candidate selector (its term in the step); "
                            "a comma list (one process, offline) times them step by step in turn, e.g. dflash,dflash2")
    run = ap.add_argument_group("run")
    run.add_argument("--steps", type=int, default=10)
    run.add_argument("--warmup", type=int, default=3)
    run.add_argument("--modes", default="offline,online", help="comma list of offline, online")
    run.add_argument("--no-compile", action="store_true", help="eager drafter layers and loss")
    run.add_argument("--eager-loss", action="store_true", help="the eager loss (compiled layers)")
    run.add_argument("--selector-kernel", action="store_true",
                     help="DFlash2: the selector's pairwise term by train/selector_pair.py's kernels (selector_kernel)")
    run.add_argument("--conv-kernel", action="store_true",
                     help="DFlash2: the in-block convolutions by train/dynamic_conv.py's kernels (conv_kernel)")
    run.add_argument("--selector-unary-grad", action="store_true",
                     help="DFlash2: the selector's unary logits coupled to the drafter (selector_unary_grad)")
    run.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                     help="the step's optimizer (TrainConfig.optimizer; the testbed recipe's is muon)")
    run.add_argument("--muon-stack-bytes", type=int, default=None,
                     help="muon: fp32 bytes of same-shape matrices orthogonalised as one stack (train/muon.py "
                          "STACK_BYTES; 0: one matrix at a time, the step before the stacks)")
    run.add_argument("--muon-ns-dtype", choices=MUON_NS_DTYPES, default="float32",
                     help="muon: the dtype of Newton-Schulz (TrainConfig.muon_ns_dtype; the testbed recipe's is auto, "
                          "bfloat16 on a GPU)")
    run.add_argument("--layer-compile", choices=("dynamic", "automatic"), default="dynamic",
                     help="dynamic: layers compiled for symbolic shapes from the start, as the trainer does "
                          "(train/drafter_pass.compile_layers); automatic: torch.compile's default (specialised, then "
                          "recompiled dynamic at the next shape), the trainer's form before 2026-12-01")
    run.add_argument("--device", default=None, choices=("cpu",),
                     help="cpu: hide the GPUs (otherwise the device is the trainer's: accelerate's)")
    run.add_argument("--attention", default="auto",
                     help="block attention (TrainConfig.attention): auto, flex, dense, split; a comma list (one "
                          "process) measures each in turn, e.g. flex,split")
    run.add_argument("--out", required=True)
    run.add_argument("--layer-probe", default=None,
                     help="after the measurements (one process), time the first drafter layer alone (forward+backward, "
                          "flex kernels profiled) on the inputs it received in training and on others, against other "
                          "compiles of a layer; write the JSON to this file")
    run.add_argument("--profile", default=None, help="also profile 3 online steps (rank 0, one process) and write "
                     "the operators by device time (or CPU time on a CPU) to this text file")
    args = ap.parse_args(argv)
    if args.toy:
        for k, v in dict(min_len=24, max_len=96, micro_batch_tokens=256, num_anchors=16, block_size=8,
                         drafter_layers=2, pool=24, steps=3, warmup=1).items():
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, v)
    if args.qwen3_8b and args.micro_batch_tokens == ap.get_default("micro_batch_tokens"):
        args.micro_batch_tokens = 4096  # activations of ~3.5k blocks at hidden 4096 fit next to the 8B target
    if sum(map(bool, (args.target, args.qwen3_8b, args.toy, args.smollm2_shape))) != 1:
        ap.error("give exactly one of --target DIR, --qwen3-8b, --smollm2-shape, --toy")
    attentions = args.attention.split(",")
    if any(a not in ("auto", "flex", "dense", "split") for a in attentions):
        ap.error(f"--attention {args.attention}: each of auto, flex, dense, split")
    if len(attentions) > 1 and launch.ranks().world_size > 1:
        ap.error("--attention with several values runs in one process only")
    archs = args.drafter_architecture.split(",")
    if any(a not in ("dflash", "dflash2") for a in archs) or len(set(archs)) < len(archs):
        ap.error(f"--drafter-architecture {args.drafter_architecture}: dflash, dflash2 or both, each once")
    if len(archs) > 1 and (launch.ranks().world_size > 1 or args.modes != "offline" or len(attentions) > 1
                           or args.layer_probe):
        ap.error("--drafter-architecture with several values: one process, --modes offline, one --attention and "
                 "no --layer-probe")

    if args.optimizer != "muon" and (args.muon_stack_bytes is not None or args.muon_ns_dtype != "float32"):
        ap.error("--muon-stack-bytes and --muon-ns-dtype go with --optimizer muon")
    if args.muon_stack_bytes is not None:
        from dflashkit.train import muon

        muon.STACK_BYTES = args.muon_stack_bytes
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything asks CUDA (as recipe_study does for its runs)

    # --- the trainer's accelerator: processes, device (train/setup.make_accelerator)
    gpu = torch.cuda.is_available()
    cfg = train_config(args, attentions[0], compiled=gpu and not args.no_compile, gpu=gpu, architecture=archs[0])
    accelerator = make_accelerator(cfg)  # several processes: rank 0 measures alone first while the others wait
    rank, world = accelerator.process_index, accelerator.num_processes
    dev = accelerator.device
    dtype = launch.default_dtype(dev)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if gpu else nullcontext  # the layer probe's
    compiled = cfg.compile

    # --- target; drafter, optimizer and pass options as train/setup.py builds them
    if args.target:
        target = load_target(args.target, dtype=dtype, device=dev)
    else:
        kind = "qwen3-8b" if args.qwen3_8b else "smollm2" if args.smollm2_shape else "toy"
        target = random_target(target_config(kind, args.target_layers), dev, dtype, f"random:{kind}")
    target.model.requires_grad_(False)
    ids = args.layer_ids or default_target_layer_ids(target.num_layers, 5 if not args.toy else 3)
    vocab = target.vocab_size
    cfg = dataclasses.replace(cfg, target_layer_ids=ids, mask_token_id=vocab - 1)

    def drafter(architecture: str):  # (prepared model, the drafter itself, optimizer, its config, pass options)
        c = dataclasses.replace(cfg, drafter_architecture=architecture)
        torch.manual_seed(0)
        m, dc = build_model(c, {}, target)
        opt = build_optimizer(c, m, str(accelerator.distributed_type).split(".")[-1])
        m, opt = accelerator.prepare(m, opt)
        p = accelerator.unwrap_model(m)  # the drafter itself (DDP's module under several processes)
        conv_kernels(c, p, dev)
        if compiled:
            compile_layers(p, dynamic={"dynamic": True, "automatic": None}[args.layer_compile])
        o = drafter_pass_options(c, dc, dev)
        o = dataclasses.replace(o, loss=dataclasses.replace(o.loss, fused=o.loss.fused and not args.eager_loss))
        return m, p, opt, dc, o

    model, plain, optimizer, dcfg, options = drafter(archs[0])
    # rank 0 alone (the other ranks wait), and every rank together (DDP when several)
    single = Step(plain, optimizer, accelerator if world == 1 else OneProcess(accelerator), target, cfg, options)
    together = Step(model, optimizer, accelerator, target, cfg, options)
    others = {}  # the other architectures' steps (one process), timed in turn with the first's
    for a in archs[1:]:
        _, p, opt, dc, o = drafter(a)
        others[a] = Step(p, opt, accelerator, target, dataclasses.replace(cfg, drafter_architecture=a), o)
    opts = CollateOptions(dcfg.block_size, dcfg.mask_token_id, args.num_anchors, seed=0)

    # --- data: packs of this rank's pool; layouts on the host for the FLOP counts
    pool = make_pool(args.pool, args.min_len, args.max_len, vocab, seed=1000 + rank)
    packs = pack_order(list(range(len(pool))), [s["input_ids"].numel() for s in pool], args.micro_batch_tokens)
    G = args.grad_accum
    need = (args.warmup + args.steps) * G
    packs = [packs[i % len(packs)] for i in range(need)]
    per_pack = {}
    for p in {tuple(p) for p in packs}:
        samples = [pool[i] for i in p]
        layout = collate_blocks([{**s, "hidden": torch.zeros(s["input_ids"].numel(), 1)} for s in samples], opts,
                                check_finite=False)
        lens = [s["input_ids"].numel() for s in samples]
        per_pack[p] = dict(samples=samples, batch=padded_batch(samples, pin=gpu), tokens=layout.num_tokens,
                           d_flops=drafter_flops(dcfg, layout), t_flops=target_flops(target, ids, lens))
    micro_of_step = [[per_pack[tuple(packs[s * G + j])] for j in range(G)] for s in range(args.warmup + args.steps)]
    tokens = [sum(m["tokens"] for m in step) for step in micro_of_step][args.warmup:]
    d_flops = [sum(m["d_flops"] for m in step) for step in micro_of_step][args.warmup:]
    t_flops = [sum(m["t_flops"] for m in step) for step in micro_of_step][args.warmup:]
    rate = matmul_rate(dev)
    peak = PEAK_BF16 if gpu else None
    kh = dcfg.num_taps * dcfg.hidden_size

    def features(m):  # target forward on one micro-batch -> per-sample dicts with their features
        ids_b, attn_b, lens = m["batch"]
        hidden, _ = capture(ids_b.to(dev, non_blocking=True))  # right-padded: no mask, as train/online.py runs it
        hidden = hidden.to(dtype, copy=True)
        return [{**s, "hidden": hidden[b, :n]} for b, (s, n) in enumerate(zip(m["samples"], lens))]

    offline_cache = {}

    def offline_micro(m):  # collated once, features on the device (what prefetching workers deliver)
        key = id(m)
        if key not in offline_cache:
            g = torch.Generator(device=dev).manual_seed(len(offline_cache))
            samples = [{**s, "hidden": torch.randn(s["input_ids"].numel(), kh, generator=g, device=dev, dtype=dtype)}
                       for s in m["samples"]]
            offline_cache[key] = collate_blocks(samples, opts, check_finite=False).to(dev)
        return offline_cache[key]

    def measure(step: Step) -> dict:
        res = {}
        modes = args.modes.split(",")
        if "offline" in modes:
            for micros in micro_of_step:
                for m in micros:
                    offline_micro(m)
            t = timed(lambda i: step([offline_micro(m) for m in micro_of_step[i]]), args.steps, args.warmup, dev)
            res["offline"] = summarize(t, tokens, d_flops, peak)
        if "online" in modes:
            t = timed(lambda i: [features(m) for m in micro_of_step[i]], args.steps, args.warmup, dev)
            res["target"] = summarize(t, tokens, t_flops, peak)

            def online(i):
                step([collate_blocks(features(m), opts, check_finite=False).to(dev, non_blocking=True)
                      for m in micro_of_step[i]])

            t = timed(online, args.steps, args.warmup, dev)
            res["online"] = summarize(t, tokens, [a + b for a, b in zip(d_flops, t_flops)], peak)
            res["target_share"] = res["online"]["ctx_tokens_per_s"] / res["target"]["ctx_tokens_per_s"]
        return res

    def paired(steps: dict[str, Step]) -> dict:
        """Offline steps of each architecture in turn on the same micro-batches: step i of one, then step i of the
        other (the order alternating from step to step), so that both see the same host and GPU state and each
        pair the same tokens; per architecture the usual figures, and each other's against the first's."""
        for micros in micro_of_step:
            for m in micros:
                offline_micro(m)
        for step in steps.values():
            timed(lambda i: step([offline_micro(m) for m in micro_of_step[i]]), 0, args.warmup, dev)
        names, times = list(steps), {a: [] for a in steps}
        for i in range(args.warmup, args.warmup + args.steps):
            for a in names if (i - args.warmup) % 2 == 0 else names[::-1]:
                times[a] += timed(lambda _: steps[a]([offline_micro(m) for m in micro_of_step[i]]), 1, 0, dev)
        res = {a: summarize(times[a], tokens, d_flops, peak) for a in names}
        first = names[0]
        for a in names[1:]:  # throughput of a over the first's: the same tokens, so time of the first over a's
            res[f"{a}_vs_{first}"] = {
                "throughput_ratio": sum(times[first]) / sum(times[a]),
                "throughput_ratio_of_medians": res[first]["step_ms_median"] / res[a]["step_ms_median"],
                "step_ratios": [round(t0 / t1, 4) for t0, t1 in zip(times[first], times[a])],
                "step_ratio_median": statistics.median(t0 / t1 for t0, t1 in zip(times[first], times[a]))}
        return res

    results = {"gpu": torch.cuda.get_device_name(dev) if gpu else "cpu", "torch": torch.__version__,
               "target": target.path, "target_layers": target.num_layers, "layer_ids": ids,
               "drafter": {k: getattr(dcfg, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                         "num_attention_heads", "num_key_value_heads", "head_dim",
                                                         "block_size", "vocab_size")},
               "args": vars(args), "architectures": archs, "world_size": world, "compiled": compiled,
               "layer_compile": args.layer_compile,
               "fused_loss": options.loss.fused, "mask": options.backend,
               "train_config": {k: getattr(cfg, k) for k in STEP_FIELDS},
               "muon": muon_layout(optimizer),
               "matmul_tflops": rate / 1e12 if rate else None, "peak_tflops": PEAK_BF16 / 1e12,
               "tokens_per_step_mean": sum(tokens) / len(tokens),
               "sequences_per_micro_batch_mean": sum(len(p) for p in packs) / len(packs),
               # the target runs each micro-batch as one right-padded batch: real / computed token positions
               "target_real_token_share": sum(m["tokens"] for m in per_pack.values()) /
               sum(len(m["samples"]) * max(m["batch"][2]) for m in per_pack.values())}
    def every_kernel(events) -> str:
        """Every device kernel by name, none left out (the tables above stop at their top rows, which hid which
        kernels DFlash2's convolutions compile to): total ms, calls, ms a call, longest first. On the CPU, every
        operator the same way (nested ones counted in their callers too)."""
        kind = "CUDA" if gpu else "CPU"
        total: dict[str, list[float]] = {}
        for e in events:
            if e.device_type.name == kind:
                total.setdefault(e.name, []).append(e.time_range.elapsed_us() / 1e3)
        rows = sorted(total.items(), key=lambda kv: -sum(kv[1]))
        lines = [f"{sum(ms):10.3f} {len(ms):6d} {sum(ms) / len(ms):9.4f}  {name}" for name, ms in rows]
        what = "device kernel" if gpu else "operator"
        return f"every {what} (total ms, calls, ms a call, name):\n" + "\n".join(lines) + "\n"

    def profile(path: str, step: Step) -> None:  # where the online step's time goes, operator by operator
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
        with torch_profile(activities=acts, record_shapes=True) as prof:
            for i in range(3):
                step([collate_blocks(features(m), opts, check_finite=False).to(dev, non_blocking=True)
                      for m in micro_of_step[i]])
            if gpu:
                torch.cuda.synchronize()
        key = "self_cuda_time_total" if gpu else "self_cpu_time_total"
        text = prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=70)
        # the operators again, apart by their inputs' shapes (which bmm, which gather: lease 8 could not tell)
        text += "\nby input shapes:\n" + prof.key_averages(group_by_input_shape=True).table(
            sort_by=key, row_limit=30, max_name_column_width=40, max_shapes_column_width=90)
        if gpu:  # the table averages same-named kernels over every compiled graph of a layer: each call apart
            calls = {}
            for e in prof.events():
                if e.device_type.name == "CUDA" and "flex_attention" in e.name:
                    calls.setdefault(e.name, []).append((e.time_range.start, e.time_range.elapsed_us() / 1e3))
            text += "\nflex_attention kernels, each call in launch order (ms; 5 layers per micro-batch):\n"
            for name, c in calls.items():
                text += f"{name}: " + " ".join(f"{ms:.2f}" for _, ms in sorted(c)) + "\n"
        text += "\n" + every_kernel(prof.events())
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
        print(f"wrote the profile of 3 online steps to {path}")

    def layer_probe(path: str) -> None:  # is the flex kernel's time in training a matter of its inputs?
        first, seen = plain.layers[0], {}

        class Recorder(torch.nn.Module):
            def forward(self, *a, **kw):
                seen["args"] = a
                return first(*a, **kw)

        plain.layers[0] = Recorder()
        with autocast():
            forward_blocks(plain, target, offline_micro(micro_of_step[0][0]), options)
        plain.layers[0] = first
        block, context, cos, sin, mask = seen["args"][:5]
        g = torch.Generator(device=dev).manual_seed(5)
        rand = [torch.randn(t.shape, generator=g, device=dev, dtype=t.dtype) for t in (block, context)]
        big = torch.randn(16384 if gpu else 16, dcfg.hidden_size, device=dev, dtype=dtype)
        head_w = target.lm_head.weight.detach()

        def case(layer=first, b=block, c=context, rope=(cos, sin), mk=mask, grad_block=False, heavy=False):
            """One forward+backward of ``layer``; heavy: four LM-head-sized matmuls first (a hot GPU)."""
            def fn():
                if heavy:
                    for _ in range(4):
                        big @ head_w.t()
                b2, c2 = b.detach().requires_grad_(grad_block), c.detach().requires_grad_(True)
                with autocast():
                    out = layer(b2, c2, rope[0], rope[1], mk)
                out.float().square().mean().backward()
            return fn

        res = {"inputs": {k: {"shape": list(t.shape), "dtype": str(t.dtype), "requires_grad": t.requires_grad,
                              "abs_mean": float(t.detach().float().abs().mean())}
                          for k, t in (("block", block), ("context", context), ("cos", cos))}}
        from transformers import Qwen3Config

        from dflashkit.drafter.modeling_dflash import DFlashDecoderLayer
        from dflashkit.train.block_mask import flex_block_mask, split_block_mask

        m0 = offline_micro(micro_of_step[0][0])
        fresh_mask = flex_block_mask(m0.anchors.clone(), m0.ctx_len, dcfg.block_size, None, m0.context_start.clone())
        lay = train_pack(0, dcfg.block_size, args.num_anchors, toy=args.toy).to(dev) if not args.toy else m0
        bench_mask = flex_block_mask(lay.anchors, lay.ctx_len, dcfg.block_size, None, lay.context_start)
        angles = torch.rand(cos.shape, generator=g, device=dev) * 6.28
        random_rope = (angles.cos(), angles.sin())
        bench_in = dict(b=torch.randn(block.shape, generator=g, device=dev),
                        c=torch.randn(context.shape, generator=g, device=dev), rope=random_rope)

        def new_layer(config, dynamic: bool, weights: bool):  # the bench's (or the trainer's) layer, compiled anew
            layer = DFlashDecoderLayer(config, 0).to(dev).train()
            if weights:
                layer.load_state_dict(first.state_dict())
            if gpu:
                layer.compile(dynamic=dynamic)
            return layer

        hq, hkv, hd = dcfg.num_attention_heads, dcfg.num_key_value_heads, dcfg.head_dim
        bcfg = Qwen3Config(hidden_size=hq * hd, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=hd,
                           num_hidden_layers=1, intermediate_size=dcfg.intermediate_size)
        other = new_layer(bcfg, True, False)
        fresh = {"static": new_layer(plain.config, False, True), "dynamic": new_layer(plain.config, True, True)}

        def reinit():  # nn.Linear's own init (the bench layer's) instead of N(0, 0.02), in place: run last
            for mod in first.modules():
                if isinstance(mod, torch.nn.Linear):
                    mod.reset_parameters()

        with torch.no_grad(), autocast():  # the compiled layer with the flex mask against the split attention
            sm = split_block_mask(m0.anchors, m0.ctx_len, dcfg.block_size, None, m0.context_start)
            a, b = first(block, context, cos, sin, mask).float(), first(block, context, cos, sin, sm).float()
            res["flex_vs_split_max_abs_diff"], res["output_abs_max"] = float((a - b).abs().max()), float(b.abs().max())
            del a, b
        for name, fn in (("captured", case()), ("random", case(b=rand[0], c=rand[1])),
                         ("captured_after_matmuls", case(heavy=True)),
                         *((("captured_fresh_mask", case(mk=fresh_mask)),  # flex: no CPU backward
                            ("bench_layer_bench_mask", case(other, **bench_in, mk=bench_mask, grad_block=True)))
                           if gpu else ()),
                         ("bench_module_bench_inputs", case(other, **bench_in, grad_block=True)),  # training mask
                         ("bench_module_captured_inputs", case(other)),
                         ("train_module_bench_inputs", case(**bench_in, grad_block=True)),
                         ("train_module_bench_inputs_no_block_grad", case(**bench_in)),
                         ("fresh_train_layer_static", case(fresh["static"])),
                         ("fresh_train_layer_dynamic", case(fresh["dynamic"])),
                         ("captured_random_rope", case(rope=random_rope)),
                         ("captured_linear_init", case()),
                         ("captured_random_rope_linear_init", case(rope=random_rope))):
            if name == "captured_linear_init":
                reinit()
            for _ in range(3):
                fn()
            res[name] = {"ms": statistics.median(timed(lambda i: fn(), 10, 2, dev)) * 1e3,
                         "kernels": kernel_times(fn) if gpu else {}}
        write_json(path, res)
        print(json.dumps(res, indent=1))

    with LayerCapture(target, ids) as capture:
        if world == 1 and others:
            results["paired"] = paired({archs[0]: single, **others})
            if args.profile:  # each architecture's, FILE with its name before the suffix
                for a, step in {archs[0]: single, **others}.items():
                    profile(str(Path(args.profile).with_stem(f"{Path(args.profile).stem}_{a}")), step)
        elif world == 1:
            results["single"] = measure(single)
            if args.layer_probe:
                layer_probe(args.layer_probe)
            if args.profile:
                profile(args.profile, single)
            if len(attentions) > 1:  # the same steps again with each other block attention
                results["by_attention"] = {options.backend: results["single"]}
                for a in attentions[1:]:
                    single.options = dataclasses.replace(options, backend=mask_backend(a, dev))
                    results["by_attention"][single.options.backend] = measure(single)
                single.options = options
        else:
            if rank == 0:
                results["single"] = measure(single)
                if args.profile:
                    profile(args.profile, single)
            launch.barrier()
            mine = measure(together)
            results["ddp"] = {}
            for mode, r in mine.items():
                if not isinstance(r, dict):
                    continue
                t = accelerator.reduce(torch.tensor([r["ctx_tokens_per_s"]], dtype=torch.float64, device=dev),
                                       reduction="sum")
                results["ddp"][mode] = {**r, "ctx_tokens_per_s_all_ranks": float(t)}
                if rank == 0:
                    results["ddp"][mode]["scaling_vs_one"] = float(t) / results["single"][mode]["ctx_tokens_per_s"]
    if gpu:
        results["peak_mem_gib"] = torch.cuda.max_memory_allocated(dev) / 2 ** 30
    if rank == 0:
        write_json(args.out, results)
        print_table(results)
    launch.leave_process_group()


def print_table(r: dict) -> None:
    d = r["drafter"]
    print(f"{r['gpu']}, torch {r['torch']}, target {r['target']} ({r['target_layers']} layers, taps {r['layer_ids']}), "
          f"drafter {d['num_hidden_layers']} x {d['hidden_size']}, block {d['block_size']}, "
          f"{r['args']['num_anchors']} anchors, sequences {r['args']['min_len']}-{r['args']['max_len']}, "
          f"{r['args']['micro_batch_tokens']} tokens per micro-batch "
          f"({r['sequences_per_micro_batch_mean']:.1f} sequences), G={r['args']['grad_accum']}, "
          f"compiled={r['compiled']}, fused loss={r['fused_loss']}, mask={r['mask']}")
    print("| processes | mode | ctx tok/s | step ms | TFLOP/s | MFU | scaling |")
    print("|---|---|---|---|---|---|---|")
    rows = [("1", k, v) for k, v in r.get("single", {}).items() if isinstance(v, dict)]
    rows += [("1", f"offline ({k}, in turn)", v) for k, v in r.get("paired", {}).items() if "step_ms_median" in v]
    rows += [(str(r["world_size"]), k, v) for k, v in r.get("ddp", {}).items()]
    for attn, res in list(r.get("by_attention", {}).items())[1:]:
        rows += [("1", f"{k} ({attn})", v) for k, v in res.items() if isinstance(v, dict)]
    for procs, mode, v in rows:
        tok = v.get("ctx_tokens_per_s_all_ranks", v["ctx_tokens_per_s"])
        mfu = f"{v['mfu']:.1%}" if v.get("mfu") is not None else "-"
        scale = f"{v['scaling_vs_one']:.2f}x" if "scaling_vs_one" in v else "-"
        print(f"| {procs} | {mode} | {tok:,.0f} | {v['step_ms_median']:.1f} | {v['tflops_per_s']:.1f} | {mfu} "
              f"| {scale} |")
    if "target_share" in r.get("single", {}):
        print(f"target forward share of the online step: {r['single']['target_share']:.1%} (real tokens are "
              f"{r['target_real_token_share']:.0%} of the padded target batch)")
    for k, v in r.get("paired", {}).items():
        if "throughput_ratio" in v:
            print(f"{k}: throughput {v['throughput_ratio']:.3f}x (medians {v['throughput_ratio_of_medians']:.3f}x, "
                  f"median of the step pairs {v['step_ratio_median']:.3f}x)")
    if r.get("matmul_tflops"):
        print(f"measured bf16 matmul: {r['matmul_tflops']:.0f} TFLOP/s; MFU against {r['peak_tflops']:.0f}")


if __name__ == "__main__":
    main()
