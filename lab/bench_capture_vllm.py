"""Feature capture by vLLM against capture by Hugging Face (issue 37 item 4): equal shards, features/s, GPU memory.

Here, once (the testbed packages are installed here, not on the GPU machine): 256 ShareGPT conversations that
have an answer, ~2 MB, carried to the GPU machine with the checkout (``.cache/`` is ignored by git: name it in
carry, or copy the file to /root in one command):
    .venv/bin/python -m lab.bench_capture_vllm --write-data .cache/capture/sharegpt256.jsonl --samples 256
One H200, after the slim vLLM (../shared/vllm/README.md, /tmp/vllm-site) and the testbed
(../shared/testbed/README.md, /root/testbed/smollm2-bf16) are installed; dflashkit from the checkout
(lab/import_path.sh), vLLM's environment from lab/vllm_env.sh. Three commands, each within 10 minutes:
    export PYTHONPATH=$(bash lab/import_path.sh /tmp/dflashkit-path):/tmp/site PYTHONSAFEPATH=1 \\
        TOKENIZERS_PARALLELISM=false
    bash lab/vllm_env.sh python3 -m lab.bench_capture_vllm --parts equality throughput --shapes target \\
        --target /root/testbed/smollm2-bf16 --data .cache/capture/sharegpt256.jsonl --out $OUT/capture_testbed.json
    bash lab/vllm_env.sh python3 -m lab.bench_capture_vllm --parts throughput --shapes qwen3-8b \\
        --target /root/testbed/smollm2-bf16 --data .cache/capture/sharegpt256.jsonl --out $OUT/capture_8b.json
    bash lab/vllm_env.sh python3 -m lab.bench_capture_vllm --parts memory --shapes qwen3-8b \\
        --target /root/testbed/smollm2-bf16 --data .cache/capture/sharegpt256.jsonl --out $OUT/capture_8b_mem.json
CPU toy (the capture twin tests/support/vllm_capture_standin.py, a tiny random Llama with the testbed's tokenizer, a
tiny Qwen3 for the 8B shape, synthetic chats; a check that the script runs, not a measurement; ~30 s):
    .venv/bin/python -m lab.bench_capture_vllm --standin --out /tmp/capture_toy.json

The samples: the first --samples records of --data rendered by --target's tokenizer and chat template, cut to
--max-length tokens, batched as `dflashkit extract` batches them (length-sorted, --batch-tokens padded tokens,
--max-batch-size samples). Parts (--parts, default all; each guarded: a failed part records its traceback under its
name and the others still run; the JSON at --out is rewritten after every part):
- equality: `dflashkit extract` of those samples (extract/run.py ``extract``, default taps) with --engine vllm,
  then --engine hf, into two directories; per tap, over every token of every sample (a: vLLM, b: HF, fp32):
    max_rel  = max over tokens t of ||a_t - b_t||_2 / ||b_t||_2         (the worst token)      goal <= 1e-2
    mean_rel = sum over elements |a - b| / sum over elements |b|       (normalised L1)        goal <= 2e-3
  and, not against a goal, mean_token_rel (the mean of the per-token ratio), max_element_rel = max over elements
  of |a - b| / max(|b|, 1e-3 * rms(b_t)) (one bf16 ulp of a large element next to a small one reads as a large
  ratio here) and max_abs; token ids and loss masks must be equal; `dflashkit verify` (verify_dataset) on the
  vLLM directory. The wall time of each extraction is reported too (target load or engine start included).
- throughput: features/s = context tokens whose tap features were captured, per second; median of --repeats
  passes over every batch after one warm-up pass, per shape of --shapes: ``target`` (--target, loaded in bf16)
  and ``qwen3-8b`` (random weights of Qwen3-8B's shape: HF builds it on the GPU in bf16, vLLM fills a
  config.json-only directory with load_format="dummy"; the samples' token ids are the testbed tokenizer's, all
  inside Qwen3's vocabulary). hf: the capture step of --engine hf (pad, hooks with early exit, gather to real
  tokens; features left on the GPU, then one sync: HF's best case); hf_to_host: the same, each batch's features
  copied to the host; vllm: the capture step of --engine vllm (one ``generate`` per batch through
  ``VllmCapture``, each request's file written under $TMPDIR by vLLM's connector, read back and deleted:
  features on the host; ``tmpdir`` in the JSON). The engine's start-up is reported apart. Ratios vllm ÷ hf and
  vllm ÷ hf_to_host; goal at the 8B shape: vllm ÷ hf >= 1.5.
- memory: per shape, two fresh processes standing in for the training process, each after the GPU settles: one
  loads an HF replica of the target and captures the largest batch; the other starts the target in a vLLM
  engine (--memory-gpu-utilization) and captures the same batch. Reported per process: torch's
  max_memory_allocated / max_memory_reserved of that process (the vLLM engine core is another process: this is
  the training process's own share), nvidia-smi's used memory of the whole GPU before and with the target
  (vLLM's share is what it reserves: weights, KV cache, activations, graphs), and nvidia-smi's per-process list.
- reference (the testbed): what bf16 itself costs. Hugging Face in float32 extracts the same samples; the vLLM
  and Hugging Face bf16 shards (the equality part's, in the same --work-dir, or extracted here) are measured
  against it with equality's formulas; ``passes`` when vLLM is no farther from float32 than Hugging Face's own
  bf16 on every tap (max_rel and mean_rel). The shards store bf16, so the reference is float32 rounded once.
--standin: everything on the CPU at toy size; memory then reports the processes' peak RSS instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from bench.common import QWEN3_8B, QWEN3_TOY, qwen3_8b_config, random_target, say, sync, timed, write_json

PARTS = ("equality", "throughput", "memory", "reference")
SHAPES = ("target", "qwen3-8b")
GOALS = {"max_rel": 1e-2, "mean_rel": 2e-3, "vllm_over_hf_8b": 1.5}
FLOOR = 1e-3  # max_element_rel's floor on |b|, as a share of the token's rms
TOY_WORDS = ["alpha", "beta", "gamma", "delta", "echo", "fox", "golf", "hotel", "india", "kilo", "lima", "mike"]


# ----------------------------------------------------------------------------- inputs: data, targets, engines
def write_sharegpt(path: Path, n: int) -> None:
    """The first ``n`` records of builtin:sharegpt that extraction keeps (a user turn, then an answer) as JSONL."""
    from dflashkit.extract.data.rendering import BadSample, normalize_record
    from dflashkit.extract.data.sources import iter_records

    kept = []
    for item in iter_records("builtin:sharegpt"):
        try:
            if item.record is not None and normalize_record(item.record)[0] == "chat":
                kept.append(item.record)
        except BadSample:
            continue
        if len(kept) == n:
            break
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept), encoding="utf-8")
    print(f"{path}: {len(kept)} conversations, {path.stat().st_size / 1e6:.1f} MB")


def toy_inputs(root: Path, n: int) -> tuple[str, str]:
    """--standin: a 6-layer random Llama (hidden 32) with the testbed's tokenizer, and ``n`` synthetic chats."""
    import transformers as tf

    from dflashkit.targets.loading import resolve_target_dir

    target = root / "toy-target"
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=2048,
                            tie_word_embeddings=True)
    tf.LlamaForCausalLM(config).save_pretrained(target)
    tf.AutoTokenizer.from_pretrained(resolve_target_dir("testbed:smollm2")[0]).save_pretrained(target)
    g = torch.Generator().manual_seed(1)

    def text() -> str:
        return " ".join(TOY_WORDS[int(i)] for i in torch.randint(0, len(TOY_WORDS), (int(torch.randint(
            2, 40, (1,), generator=g)),), generator=g))

    data = root / "toy-chats.jsonl"
    with open(data, "w") as f:
        for _ in range(n):
            turns = [m for _ in range(int(torch.randint(1, 3, (1,), generator=g)))
                     for m in ({"role": "user", "content": text()}, {"role": "assistant", "content": text()})]
            f.write(json.dumps({"messages": turns}) + "\n")
    return str(target), str(data)


def encode_samples(args, tokenizer) -> list:
    """The first --samples records of --data as extraction encodes them (batching.Sample, bad records dropped)."""
    from dflashkit.extract.data.batching import encoded_windows
    from dflashkit.extract.data.rendering import ChatConfig

    windows = encoded_windows([args.data], None, args.samples, args.samples, 0, tokenizer,
                              ChatConfig(max_length=args.max_length), 0, 1)
    return [s for w in windows for s in w.samples]


def qwen3_dir(root: Path, standin: bool, tokenizer_dir: Path) -> Path:
    """The 8B-shaped target for vLLM: config.json alone (load_format="dummy"); --standin: a tiny Qwen3 with weights
    and a tokenizer, which the capture twin loads."""
    out = root / ("qwen3-toy" if standin else "qwen3-8b")
    out.mkdir(parents=True, exist_ok=True)
    if not standin:
        (out / "config.json").write_text(json.dumps(QWEN3_8B, indent=2) + "\n")
        return out
    import transformers as tf

    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(qwen3_8b_config(toy=True)).save_pretrained(out)
    tf.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


def capture_api(standin: bool, dummy_weights: bool):
    """The vLLM calls of VllmCapture: the CPU twin, the installed vLLM, or the installed vLLM with random weights
    and no tokenizer (prompts are token ids; nothing is detokenized)."""
    from dflashkit.targets.vllm.api import VllmApi, load_api

    if standin:
        from tests.support import vllm_capture_standin as twin  # a test double, from the checkout's root

        return twin.standin_api()
    api = load_api(settle=False)
    if not dummy_weights:
        return api
    return VllmApi(functools.partial(api.llm_factory, load_format="dummy", skip_tokenizer_init=True),
                   functools.partial(api.sampling_params, detokenize=False), api.clock, api.release, api.version)


def hf_replica(shape: str, spec: str, dev, dtype, toy: bool):
    """The target in this process: --target loaded, or random weights of Qwen3-8B's shape (``toy``: QWEN3_TOY)."""
    if shape == "target":
        from dflashkit.targets.loading import load_target

        return load_target(spec, dtype=dtype, device=dev)
    return random_target(qwen3_8b_config(toy=toy), dev, dtype, "random:qwen3-toy" if toy else "random:qwen3-8b",
                         family="qwen3")


def shape_inputs(shape: str, args, info, samples: list, work: Path) -> tuple[str, Path, int, list]:
    """(HF spec, vLLM model dir, layer count, samples with ids inside the shape's vocabulary) of a shape; ``info``:
    --target's description (targets/vllm/capture.py describe_target)."""
    if shape == "target":
        return args.target, info.model_dir, info.num_layers, samples
    fields = QWEN3_TOY if args.standin else QWEN3_8B
    vocab = fields["vocab_size"]  # the toy's is 300: its ids wrap (the real one holds every testbed id)
    wrapped = [dataclasses.replace(s, input_ids=[t % vocab for t in s.input_ids]) for s in samples]
    return "random", qwen3_dir(work, args.standin, info.model_dir), fields["num_hidden_layers"], wrapped


def free_memory(dev) -> None:
    """Drop what this process holds on the GPU and wait until the GPU's memory stops falling (the next engine's
    start-up profiling refuses to run while memory is being freed)."""
    gc.collect()
    if dev.type == "cuda":
        from dflashkit.targets.vllm.runtime import wait_for_gpu_memory_to_settle

        torch.cuda.empty_cache()
        wait_for_gpu_memory_to_settle()


def vllm_dtype(dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------- equality
def extract_flags(args, dev) -> dict:
    """The ``ExtractOptions`` fields (extract/options.py) every extraction of this bench shares."""
    return dict(target=args.target, data=[args.data], limit=args.samples, max_length=args.max_length,
                batch_tokens=args.batch_tokens, max_batch_size=args.max_batch_size, num_taps=args.num_taps,
                device=str(dev), progress=False, overwrite=True)


def extract_engine(args, out: Path, engine: str, **flags) -> dict:
    """One extraction by ``engine`` into ``out`` (extract/run.py ``extract``); vLLM through this bench's calls."""
    from dflashkit.extract.options import ExtractOptions
    from dflashkit.extract.run import extract

    vllm = engine == "vllm"
    if vllm:
        flags["gpu_memory_utilization"] = args.gpu_memory_utilization
    return extract(ExtractOptions(out=out, engine=engine, **flags),
                   vllm_api=capture_api(args.standin, False) if vllm else None)


def part_equality(args, work: Path, dev, dtype) -> dict:
    from dflashkit.extract.shards.verify import verify_dataset

    flags = dict(extract_flags(args, dev), dtype=vllm_dtype(dtype))
    walls = {}
    for engine in ("vllm", "hf"):  # vLLM first: its start-up profiling needs a GPU that nothing else is freeing
        started = time.perf_counter()
        manifest = extract_engine(args, work / f"shards-{engine}", engine, **flags)
        walls[engine] = time.perf_counter() - started
        free_memory(dev)
    errors, notes = verify_dataset(work / "shards-vllm")
    result = tap_errors(work / "shards-vllm", work / "shards-hf")
    result.update(target=args.target, data=args.data, dtype=str(dtype), extract_wall_s=walls,
                  tokens=manifest["totals"]["tokens"], verify_vllm={"errors": errors, "notes": notes})
    result["passes"] = (all(t["max_rel"] <= GOALS["max_rel"] and t["mean_rel"] <= GOALS["mean_rel"]
                            for t in result["per_tap"]) and result["ids_equal"] and not errors)
    return result


def part_reference(args, work: Path, dev, dtype) -> dict:
    """What bf16 itself costs: the testbed's taps from Hugging Face in float32 as the reference, against which the
    vLLM shards and the Hugging Face bf16 shards of the equality part (extracted here if absent) are measured with
    the same formulas. If vLLM's error is of the size of Hugging Face bf16's, the two engines differ by bf16
    rounding, not by what they compute."""
    flags = extract_flags(args, dev)
    for engine in ("vllm", "hf"):
        if not (work / f"shards-{engine}" / "manifest.json").exists():
            extract_engine(args, work / f"shards-{engine}", engine, dtype=vllm_dtype(dtype), **flags)
            free_memory(dev)
    extract_engine(args, work / "shards-hf32", "hf", dtype="float32", **flags)
    free_memory(dev)
    out = {"reference": "hf float32", "dtype": str(dtype)}
    for engine in ("vllm", "hf"):
        out[f"{engine}_vs_fp32"] = tap_errors(work / f"shards-{engine}", work / "shards-hf32")
    out["hf_vs_vllm"] = tap_errors(work / "shards-hf", work / "shards-vllm")
    # per tap: is vLLM's bf16 no farther from the float32 reference than Hugging Face's own bf16?
    out["vllm_within_hf_bf16"] = [
        {"layer_id": v["layer_id"], **{k: v[k] <= h[k] for k in ("max_rel", "mean_rel")}}
        for v, h in zip(out["vllm_vs_fp32"]["per_tap"], out["hf_vs_fp32"]["per_tap"])]
    out["passes"] = all(t["max_rel"] and t["mean_rel"] for t in out["vllm_within_hf_bf16"])
    return out


def tap_errors(vllm_dir: Path, hf_dir: Path) -> dict:
    """Per tap, the relative errors of the vLLM shards against the HF shards (module docstring)."""
    from dflashkit.extract.shards.reader import ShardDataset

    got, want = ShardDataset(vllm_dir), ShardDataset(hf_dir)
    if got.sample_indices != want.sample_indices or not len(want):
        raise RuntimeError(f"the two extractions hold different samples: {len(got)} vs {len(want)}")
    layer_ids = want.manifest["target_layer_ids"]
    taps = [dict(diff=0.0, ref=0.0, token_sum=0.0, tokens=0, max_rel=0.0, max_element_rel=0.0, max_abs=0.0)
            for _ in layer_ids]
    ids_equal = True
    for k in range(len(want)):
        a, b = got[k], want[k]
        ids_equal &= torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        for tap, x, y in zip(taps, a["hidden"].float().chunk(len(layer_ids), -1),
                             b["hidden"].float().chunk(len(layer_ids), -1)):
            diff = (x - y).abs()
            token_rel = diff.norm(dim=-1) / y.norm(dim=-1).clamp_min(1e-30)
            floor = (FLOOR * y.pow(2).mean(-1, keepdim=True).sqrt()).clamp_min(1e-30)
            tap["diff"] += float(diff.sum())
            tap["ref"] += float(y.abs().sum())
            tap["token_sum"] += float(token_rel.sum())
            tap["tokens"] += len(token_rel)
            tap["max_rel"] = max(tap["max_rel"], float(token_rel.max()))
            tap["max_element_rel"] = max(tap["max_element_rel"], float((diff / torch.maximum(y.abs(), floor)).max()))
            tap["max_abs"] = max(tap["max_abs"], float(diff.max()))
    per_tap = [{"layer_id": i, "max_rel": t["max_rel"], "mean_rel": t["diff"] / max(t["ref"], 1e-30),
                "mean_token_rel": t["token_sum"] / t["tokens"], "max_element_rel": t["max_element_rel"],
                "max_abs": t["max_abs"], "tokens": t["tokens"]} for i, t in zip(layer_ids, taps)]
    return {"samples": len(want), "layer_ids": layer_ids, "per_tap": per_tap, "ids_equal": ids_equal, "goals": {
        k: GOALS[k] for k in ("max_rel", "mean_rel")}, "formulas": {
        "max_rel": "max over tokens t of ||a_t - b_t||_2 / ||b_t||_2 (a: vLLM, b: HF, one tap's [H] vector)",
        "mean_rel": "sum over elements |a - b| / sum over elements |b|",
        "mean_token_rel": "mean over tokens t of ||a_t - b_t||_2 / ||b_t||_2",
        "max_element_rel": f"max over elements |a - b| / max(|b|, {FLOOR} * rms(b_t))",
        "max_abs": "max over elements |a - b|"}}


# ----------------------------------------------------------------------------- throughput
def hf_capture_pass(capture, batches: list, dev, to_host: bool) -> None:
    """Every batch through the capture step of --engine hf: padded, hooked forward, gathered to real tokens."""
    from dflashkit.extract.data.batching import pad_batch, real_token_index

    for batch in batches:
        ids, _ = pad_batch(batch, dev)
        hidden, _ = capture(ids)
        keep = real_token_index([len(s.input_ids) for s in batch], ids.shape[1], hidden.device)
        features = hidden.flatten(0, 1).index_select(0, keep)
        if to_host:
            features.cpu()


def vllm_capture_pass(capture, batches: list) -> None:
    """Every batch as one ``generate`` of --engine vllm; each sample's taps concatenated on the feature axis."""
    for batch in batches:
        per_sample = capture([s.input_ids for s in batch])
        torch.cat([torch.cat(taps, dim=-1) for taps in per_sample])


def vllm_throughput(model_dir: Path, layer_ids: list[int], batches: list, api, args, dtype) -> dict:
    from dflashkit.targets.vllm.capture import VllmCapture, VllmCaptureConfig

    longest = max(len(s.input_ids) for b in batches for s in b)
    config = VllmCaptureConfig(gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=longest + 1,
                               dtype=vllm_dtype(dtype), max_num_seqs=args.max_batch_size)
    started = time.perf_counter()
    with VllmCapture(model_dir, layer_ids, config, api) as capture:
        start_s = time.perf_counter() - started
        seconds = timed(lambda i: vllm_capture_pass(capture, batches), args.repeats, 1, "cpu")
    return {"seconds": seconds, "engine_start_s": start_s, "gpu_memory_utilization": args.gpu_memory_utilization,
            "version": api.version}


def hf_throughput(shape: str, spec: str, layer_ids: list[int], batches: list, args, dev, dtype) -> dict:
    from dflashkit.targets.capture import LayerCapture

    started = time.perf_counter()
    target = hf_replica(shape, spec, dev, dtype, args.standin)
    out = {"load_s": time.perf_counter() - started}
    with LayerCapture(target, layer_ids) as capture:  # the target is dropped on return
        for name, to_host in (("hf", False), ("hf_to_host", True)):
            one_pass = functools.partial(hf_capture_pass, capture, batches, dev, to_host)
            out[name] = timed(lambda i: one_pass(), args.repeats, 1, dev)
    return out


def part_throughput(args, work: Path, dev, dtype) -> dict:
    from dflashkit.drafter import default_target_layer_ids
    from dflashkit.extract.data.batching import plan_batches
    from dflashkit.targets.vllm.capture import describe_target

    info = describe_target(args.target)
    samples = encode_samples(args, info.tokenizer)
    result = {"samples": len(samples), "measured": "features/s = context tokens captured per second, median of "
              "--repeats passes over every batch after one warm-up pass", "tmpdir": tempfile.gettempdir()}
    for shape in args.shapes:
        spec, model_dir, num_layers, shaped = shape_inputs(shape, args, info, samples, work)
        batches = plan_batches(shaped, args.batch_tokens, args.max_batch_size)
        layer_ids = default_target_layer_ids(num_layers, args.num_taps)
        tokens = sum(len(s.input_ids) for s in shaped)
        api = capture_api(args.standin, dummy_weights=shape == "qwen3-8b")
        row = {"layer_ids": layer_ids, "tokens_per_pass": tokens, "batches": len(batches),
               "vllm": vllm_throughput(model_dir, layer_ids, batches, api, args, dtype)}
        free_memory(dev)
        hf = hf_throughput(shape, spec, layer_ids, batches, args, dev, dtype)
        free_memory(dev)
        row["hf"] = {"seconds": hf["hf"], "load_s": hf["load_s"]}
        row["hf_to_host"] = {"seconds": hf["hf_to_host"]}
        for name in ("vllm", "hf", "hf_to_host"):
            row[name]["features_per_s"] = tokens / statistics.median(row[name]["seconds"])
        row["vllm_over_hf"] = row["vllm"]["features_per_s"] / row["hf"]["features_per_s"]
        row["vllm_over_hf_to_host"] = row["vllm"]["features_per_s"] / row["hf_to_host"]["features_per_s"]
        result[shape] = row
        say(f"throughput {shape}: vllm {row['vllm']['features_per_s']:,.0f}, hf {row['hf']['features_per_s']:,.0f} "
            f"features/s")
    if "qwen3-8b" in result:
        result["goal_vllm_over_hf_8b"] = GOALS["vllm_over_hf_8b"]
        result["passes_8b"] = result["qwen3-8b"]["vllm_over_hf"] >= GOALS["vllm_over_hf_8b"]
    return result


# ----------------------------------------------------------------------------- memory
def gpu_memory() -> dict | None:
    """nvidia-smi's used and total memory of the first GPU and its per-process list (MiB); None without it."""
    if shutil.which("nvidia-smi") is None:
        return None

    def query(what: str) -> list[list[str]]:
        text = subprocess.run(["nvidia-smi", f"--query-{what}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True).stdout
        return [[f.strip() for f in line.split(",")] for line in text.splitlines() if line.strip()]

    used, total = query("gpu=memory.used,memory.total")[0]
    return {"used_mib": int(used), "total_mib": int(total), "processes": [
        {"pid": int(p), "used_mib": int(m) if m.isdigit() else m} for p, m in query("compute-apps=pid,used_memory")]}


def part_memory(args, work: Path, dev, dtype) -> dict:
    from dflashkit.drafter import default_target_layer_ids
    from dflashkit.extract.data.batching import plan_batches
    from dflashkit.targets.vllm.capture import describe_target

    info = describe_target(args.target)
    samples = encode_samples(args, info.tokenizer)
    result = {"measured": "per fresh process standing in for the training process: torch max_memory_allocated / "
              "max_memory_reserved of that process; nvidia-smi used memory of the whole GPU before the target and "
              "with it (vLLM: the engine core is another process holding gpu_memory_utilization of the GPU); "
              "nvidia-smi's per-process list; on the CPU (--standin) the process's peak RSS",
              "gpu_memory_utilization": args.memory_gpu_utilization}
    for shape in args.shapes:
        spec, model_dir, num_layers, shaped = shape_inputs(shape, args, info, samples, work)
        batch = plan_batches(shaped, args.batch_tokens, args.max_batch_size)[0]  # the longest samples
        row = {"batch_samples": len(batch), "batch_tokens": sum(len(s.input_ids) for s in batch)}
        for kind in ("vllm", "hf"):
            free_memory(dev)
            spec_file = work / f"memory-{shape}-{kind}.json"
            write_json(spec_file, {"kind": kind, "shape": shape, "target": spec, "model_dir": str(model_dir),
                                   "layer_ids": default_target_layer_ids(num_layers, args.num_taps),
                                   "batch": [s.input_ids for s in batch], "standin": args.standin,
                                   "device": str(dev), "dtype": vllm_dtype(dtype), "max_num_seqs": args.max_batch_size,
                                   "gpu_memory_utilization": args.memory_gpu_utilization})
            # the child inherits this process's folder and PYTHONPATH, through which lab/ was importable here
            proc = subprocess.run([sys.executable, "-m", "lab.bench_capture_vllm", "--memory-child", str(spec_file)],
                                  capture_output=True, text=True)
            result_file = spec_file.with_suffix(".result.json")
            if proc.returncode != 0 or not result_file.exists():
                raise RuntimeError(f"memory child {shape}/{kind} exited {proc.returncode}: {proc.stderr[-3000:]}")
            row[kind] = json.loads(result_file.read_text())
        hf_gpu, vllm_gpu = row["hf"].get("gpu_used_delta_mib"), row["vllm"].get("gpu_used_delta_mib")
        row["vllm_over_hf_gpu_used"] = vllm_gpu / hf_gpu if hf_gpu and vllm_gpu is not None else None
        result[shape] = row
    return result


def memory_child(spec_file: Path) -> int:
    """One process of the memory part: the target as an HF replica or in a vLLM engine, one batch captured."""
    import resource

    from dflashkit.extract.data.batching import Sample

    spec = json.loads(spec_file.read_text())
    dev = torch.device(spec["device"])
    cuda = dev.type == "cuda"
    if cuda:
        torch.zeros(1, device=dev)  # the training process has its CUDA context before the target comes
    out = {"pid": os.getpid(), "gpu_before": gpu_memory()}
    batch = [Sample(k, "", ids, [True] * len(ids)) for k, ids in enumerate(spec["batch"])]
    if spec["kind"] == "hf":
        from dflashkit.targets.capture import LayerCapture

        target = hf_replica(spec["shape"], spec["target"], dev, getattr(torch, spec["dtype"]), spec["standin"])
        out["weights_bytes"] = sum(p.numel() * p.element_size() for p in target.model.parameters())
        with LayerCapture(target, spec["layer_ids"]) as capture:
            hf_capture_pass(capture, [batch], dev, to_host=False)
        sync(dev)
    else:
        from dflashkit.targets.vllm.capture import VllmCapture, VllmCaptureConfig

        config = VllmCaptureConfig(gpu_memory_utilization=spec["gpu_memory_utilization"], dtype=spec["dtype"],
                                   max_model_len=max(len(ids) for ids in spec["batch"]) + 1,
                                   max_num_seqs=spec["max_num_seqs"])
        api = capture_api(spec["standin"], dummy_weights=spec["shape"] == "qwen3-8b")
        with VllmCapture(spec["model_dir"], spec["layer_ids"], config, api) as capture:
            vllm_capture_pass(capture, [batch])
            out["gpu_with_target"] = gpu_memory()
        if out["gpu_before"]:  # what the engine may take: weights, KV cache, activations, graphs
            out["vllm_share_mib"] = spec["gpu_memory_utilization"] * out["gpu_before"]["total_mib"]
    if cuda:
        out.update(max_memory_allocated=torch.cuda.max_memory_allocated(dev),
                   max_memory_reserved=torch.cuda.max_memory_reserved(dev))
    out.setdefault("gpu_with_target", gpu_memory())
    if out["gpu_before"] and out["gpu_with_target"]:
        out["gpu_used_delta_mib"] = out["gpu_with_target"]["used_mib"] - out["gpu_before"]["used_mib"]
    out["cpu_max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    write_json(spec_file.with_suffix(".result.json"), out)
    return 0


# ----------------------------------------------------------------------------- report
def print_tables(results: dict) -> None:
    eq = results.get("equality", {})
    for tap in eq.get("per_tap", []):
        print(f"equality layer {tap['layer_id']}: max_rel {tap['max_rel']:.2e} mean_rel {tap['mean_rel']:.2e} "
              f"mean_token_rel {tap['mean_token_rel']:.2e} max_element_rel {tap['max_element_rel']:.2e}")
    if "per_tap" in eq:
        print(f"equality: ids equal {eq['ids_equal']}, verify errors {len(eq['verify_vllm']['errors'])}, "
              f"passes {eq['passes']}")
    ref = results.get("reference", {})
    for engine in ("vllm", "hf"):
        for tap in ref.get(f"{engine}_vs_fp32", {}).get("per_tap", []):
            print(f"reference {engine} bf16 vs hf fp32, layer {tap['layer_id']}: max_rel {tap['max_rel']:.2e} "
                  f"mean_rel {tap['mean_rel']:.2e} mean_token_rel {tap['mean_token_rel']:.2e}")
    if "passes" in ref:
        print(f"reference: vLLM no farther from fp32 than HF bf16 on every tap: {ref['passes']}")
    for shape in SHAPES:
        row = results.get("throughput", {}).get(shape)
        if row:
            rate = {k: f"{row[k]['features_per_s']:,.0f}" for k in ("vllm", "hf", "hf_to_host")}
            print(f"throughput {shape}: features/s vllm {rate['vllm']} | hf {rate['hf']} | hf_to_host "
                  f"{rate['hf_to_host']} | vllm/hf {row['vllm_over_hf']:.2f} | vLLM engine start "
                  f"{row['vllm']['engine_start_s']:.1f} s")
        mem = results.get("memory", {}).get(shape)
        if mem:
            for kind in ("hf", "vllm"):
                m = mem[kind]
                gpu = (f"max_memory_allocated {m['max_memory_allocated'] / 2**30:.2f} GiB, GPU used "
                       f"+{m.get('gpu_used_delta_mib')} MiB, " if "max_memory_allocated" in m else "")
                print(f"memory {shape} {kind}: {gpu}peak RSS {m['cpu_max_rss_mib']:.0f} MiB")
    for name, part in results.items():
        if isinstance(part, dict) and "error" in part:
            print(f"{name}: FAILED {part['error']}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", help="the testbed's directory, e.g. /root/testbed/smollm2-bf16 (--standin: a toy)")
    p.add_argument("--data", help="chat JSONL with answers (--write-data makes one; --standin: synthetic)")
    p.add_argument("--out", default="bench_capture_vllm.json", help="the JSON results")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES),
                   help="throughput and memory: --target and/or a random-weight Qwen3-8B-shaped target")
    p.add_argument("--samples", type=int, default=None, help="records of --data (default 256; toy 12)")
    p.add_argument("--max-length", type=int, default=None, help="tokens per sample (default 2048; toy 256)")
    p.add_argument("--batch-tokens", type=int, default=None, help="as `dflashkit extract` (default 16384; toy 1024)")
    p.add_argument("--max-batch-size", type=int, default=64, help="as `dflashkit extract`; vLLM's max_num_seqs")
    p.add_argument("--num-taps", type=int, default=5, help="taps, default ids (as `dflashkit extract`)")
    p.add_argument("--repeats", type=int, default=None, help="timed passes (default 3; toy 2)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="equality and throughput engines")
    p.add_argument("--memory-gpu-utilization", type=float, default=0.3, help="the memory part's engine")
    p.add_argument("--work-dir", help="shards, target dirs, memory specs (default: a temporary dir, removed)")
    p.add_argument("--standin", "--toy", dest="standin", action="store_true",
                   help="CPU toy: the capture twin, tiny random targets, synthetic chats")
    p.add_argument("--write-data", metavar="PATH", help="only write --samples ShareGPT chats with answers to PATH")
    p.add_argument("--memory-child", metavar="SPEC", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.memory_child:
        return memory_child(Path(args.memory_child))
    toy = args.standin
    args.samples = args.samples or (12 if toy else 256)
    if args.write_data:
        write_sharegpt(Path(args.write_data), args.samples)
        return 0
    args.max_length = args.max_length or (256 if toy else 2048)
    args.batch_tokens = args.batch_tokens or (1024 if toy else 16384)
    args.repeats = args.repeats or (2 if toy else 3)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-capture-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    if toy and not args.target:
        args.target, args.data = toy_inputs(work, args.samples)
    if not (args.target and args.data):
        build_parser().error("--target and --data are needed (or --standin)")
    from dflashkit import launch

    dev = torch.device("cpu") if toy else launch.local_device(None)
    dtype = launch.default_dtype(dev)
    results = {"args": vars(args), "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
               "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    ok = True
    for name in args.parts:
        say(f"{name}: start")
        try:
            results[name] = globals()[f"part_{name}"](args, work, dev, dtype)
        except Exception as error:  # one failed part must not lose the others
            ok = False
            results[name] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
            free_memory(dev)
        write_json(args.out, results)
        say(f"{name}: {'failed' if 'error' in results[name] else 'done'}")
    print_tables(results)
    print(f"wrote {args.out}")
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
