"""What the bench scripts share: the Qwen3-8B shape (and its CPU-sized twin), random-weight targets built from a
config in code, the bf16 matmul rate measured on the GPU against the datasheet peak, timing on a device, a
result's JSON file, and a stage of a study run under a time limit.

The scripts run as modules from the checkout's root (``python -m bench.bench_vllm``) and import this one as
``bench.common``; the lab's scripts (lab/) import it the same way: lab/ may import bench/, never the reverse.

Design choices:
- One Qwen3-8B: ``QWEN3_8B`` holds the fields of its config.json (vLLM reads them from a directory;
  ``qwen3_8b_config`` makes the transformers config the in-process benchmarks build a random target from).
- One matmul rate: 10 back-to-back 8192^3 bf16 matmuls after 10 warm-up ones, timed together (a sync per call
  would add the launch latency to each); None off the GPU, where no rate is comparable with the datasheet.
- ``run_stage`` is the Python form of lab/run_lib.sh's ``stage``: a command with its output in a log, SIGINT at
  the time limit (training checkpoints and stops, eval writes a partial report), killed 5 minutes later.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import torch

# Qwen3-8B's config.json fields (the public checkpoint's shape; weights are never needed: random or vLLM's dummy)
QWEN3_8B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                hidden_act="silu", torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151645)
# the same architecture at CPU size: the toy modes' stand-in for Qwen3-8B
QWEN3_TOY = dict(QWEN3_8B, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=300, max_position_embeddings=512, bos_token_id=0,
                 eos_token_id=1)
PEAK_BF16 = 989e12  # FLOP/s: H100/H200 SXM dense bf16, the datasheet figure MFU divides by


def qwen3_8b_config(toy: bool = False, **changes):
    """The transformers ``Qwen3Config`` of ``QWEN3_8B`` (``QWEN3_TOY`` when ``toy``), with ``changes`` (e.g.
    ``num_hidden_layers=8`` to cut it for memory)."""
    from transformers import Qwen3Config

    return Qwen3Config(**{**(QWEN3_TOY if toy else QWEN3_8B), **changes})


def random_target(config, device, dtype, label: str, family: str = ""):
    """A ``targets.loading.Target`` of random weights from a transformers config (no tokenizer, no files): seed 0,
    in eval mode, on ``device`` in ``dtype``; ``label`` is its path in the results (e.g. ``random:qwen3-8b``)."""
    from transformers import AutoModelForCausalLM

    from dflashkit.targets.loading import Target
    from dflashkit.targets.runtime.parts import parts_of

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    return Target(**parts_of(model), tokenizer=None, path=label, model_dir=Path("."), family=family)


def sync(device) -> None:
    """Wait for the device's queued work (a no-op off the GPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, repeats: int, warmup: int, device) -> list[float]:
    """Seconds of each of ``repeats`` calls ``fn(i)`` after ``warmup`` untimed ones (i counts all calls from 0),
    each ended by a device sync."""
    for i in range(warmup):
        fn(i)
    sync(device)
    out = []
    for i in range(warmup, warmup + repeats):
        t = time.perf_counter()
        fn(i)
        sync(device)
        out.append(time.perf_counter() - t)
    return out


def seconds_per_call(fn, calls: int, warmup: int, device) -> float:
    """Mean seconds of ``calls`` back-to-back calls ``fn()`` (one sync at the end) after ``warmup`` untimed ones:
    the rate of a kernel that is queued faster than it runs."""
    for _ in range(warmup):
        fn()
    return timed(lambda i: [fn() for _ in range(calls)], 1, 0, device)[0] / calls


def matmul_rate(device) -> float | None:
    """FLOP/s of an 8192^3 bf16 matmul on ``device`` (module docstring); None off the GPU."""
    if torch.device(device).type != "cuda":
        return None
    a, b = (torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) for _ in range(2))
    return 2 * 8192 ** 3 / seconds_per_call(lambda: a @ b, 10, 10, device)


def write_json(path, data: dict) -> None:
    """``data`` as indented JSON at ``path`` (its folder made when missing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def say(message: str) -> None:
    """A progress line with the time of day, as run_lib.sh's stages.txt has."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def run_stage(cmd: list[str], log: Path, env: dict, time_limit: float | None) -> tuple[int, float, bool]:
    """Run ``cmd`` from ``log``'s folder with its output in ``log`` (the command line first); at ``time_limit``
    seconds send SIGINT, then kill it 5 minutes later. Returns (exit status, wall seconds, stopped by the limit)."""
    start = time.perf_counter()
    with open(log, "w") as out:
        out.write(" ".join(cmd) + "\n\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=log.parent, env=env, stdout=out, stderr=subprocess.STDOUT)
        stopped = False
        try:
            proc.wait(timeout=time_limit)
        except subprocess.TimeoutExpired:
            stopped = True
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return proc.returncode, time.perf_counter() - start, stopped
