"""Shared fixtures and tiny targets, all built in code (no downloads); test files import the builders with
``from conftest import ...``.

- tiny_target_config / VOCAB / prompts / one_thread: the 6-token Llama of the engine tests (eval).
- TINY_FAMILIES / save_tiny_target / tiny_tokenizer: one tiny random target per supported family (target).
- smollm2_tokenizer / save_tiny_chat_target / chat_records / write_jsonl / hf_model: a tiny Llama with the
  testbed's real tokenizer and chat data for it (extract, regenerate).
- make_tiny_target / make_shards / tiny_run / TINY_RECIPE: a tiny target and its feature shards (train).
- run_until_paused: holds a command at a test-only pause point (fault tests).
"""

import functools
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import transformers as tf

ROOT = Path(__file__).resolve().parents[1]
TINY_RECIPE = ROOT / "recipes" / "tiny.yaml"  # the training settings of the tiny target (tests, smoke runs)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------- eval: a 6-token Llama
VOCAB = 6  # so small that a random drafter is accepted often enough for rounds of every length


def tiny_target_config(**overrides):
    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3)
    return tf.LlamaConfig(**{**fields, **overrides})


def prompts(n=10, length=8):
    return [torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(s)).tolist()
            for s in range(n)]


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and lose a lot to them on a shared machine
    (``pytestmark = pytest.mark.usefixtures("one_thread")`` in a module that wants it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------- target: every family, tiny
_BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_QWEN_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14)
_QWEN_MM_IDS = dict(image_token_id=296, video_token_id=297, vision_start_token_id=298, vision_end_token_id=299)

TINY_FAMILIES = ["llama", "qwen2", "qwen3", "qwen3_moe", "gemma3_text", "gemma3", "qwen3_5_text", "qwen3_5",
                 "qwen3_5_moe", "qwen3_next", "gpt_oss"]


def tiny_family_config(family: str):
    """A tiny config of `family` (4 layers, hidden 64, vocab 300); multimodal ones with a 1-layer vision tower."""
    if family == "llama":
        return tf.LlamaConfig(**_BASE, tie_word_embeddings=True)  # tied, as SmolLM2
    if family == "qwen2":
        return tf.Qwen2Config(**{k: v for k, v in _BASE.items() if k != "head_dim"})
    if family == "qwen3":
        return tf.Qwen3Config(**_BASE)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**_BASE, **_MOE)
    if family == "gemma3_text":
        return tf.Gemma3TextConfig(**_BASE, sliding_window=4,
                                   layer_types=["sliding_attention"] * 3 + ["full_attention"])
    if family == "gemma3":
        vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, image_size=28, patch_size=14)
        return tf.Gemma3Config(text_config=dict(model_type="gemma3_text", **_BASE, sliding_window=4),
                               vision_config=vision, mm_tokens_per_image=4, image_token_index=299,
                               boi_token_index=297, eoi_token_index=298)
    if family == "qwen3_5_text":
        return tf.Qwen3_5TextConfig(**_BASE, **_LINEAR)
    if family == "qwen3_5":
        return tf.Qwen3_5Config(text_config=dict(**_BASE, **_LINEAR), vision_config=_QWEN_VISION, **_QWEN_MM_IDS)
    if family == "qwen3_5_moe":
        text = dict(**_BASE, **_LINEAR, **_MOE, shared_expert_intermediate_size=32)
        return tf.Qwen3_5MoeConfig(text_config=text, vision_config=_QWEN_VISION, **_QWEN_MM_IDS)
    if family == "qwen3_next":
        return tf.Qwen3NextConfig(**_BASE, **_LINEAR, **_MOE, shared_expert_intermediate_size=32)
    if family == "gpt_oss":
        return tf.GptOssConfig(**_BASE, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    raise KeyError(family)


def tiny_tokenizer(num_words: int = 240):
    """A word-level tokenizer of `num_words` + 4 special tokens (fewer than the tiny targets' 300 rows)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate(specials + [f"w{i}" for i in range(num_words)])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tf.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>",
                                      eos_token="<|im_end|>")


def noisy_norms(model):
    """Noise on every norm weight, so that a wrong norm formula (w vs 1 + w) cannot pass unnoticed."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


def save_tiny_target(family: str, out_dir: Path, seed: int = 0) -> Path:
    """Random tiny target of `family` saved like a downloaded checkpoint (config, safetensors, tokenizer).

    Norm weights get noise so that a wrong norm formula (w vs 1 + w) cannot pass unnoticed."""
    torch.manual_seed(seed)
    config = tiny_family_config(family)
    multimodal = family in ("gemma3", "qwen3_5", "qwen3_5_moe")
    auto = tf.AutoModelForImageTextToText if multimodal else tf.AutoModelForCausalLM
    model = noisy_norms(auto.from_config(config, dtype=torch.float32))
    model.save_pretrained(out_dir)
    tiny_tokenizer().save_pretrained(out_dir)
    return Path(out_dir)


# ----------------------------------------------------------------------------- extract: chat data, tiny chat target
@functools.lru_cache(maxsize=1)
def smollm2_tokenizer():
    """The testbed's tokenizer (ChatML template), from the cached conversion of the packaged GGUF."""
    from dflashkit.targets.loading import resolve_target_dir

    model_dir, _ = resolve_target_dir("testbed:smollm2")
    return tf.AutoTokenizer.from_pretrained(model_dir)


def save_tiny_chat_target(out_dir, seed=0, initializer_range=0.02):
    """A 4-layer Llama (hidden 32) over the full SmolLM2 vocabulary, saved with the testbed tokenizer."""
    torch.manual_seed(seed)
    config = tf.LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=2048,
                            tie_word_embeddings=True, initializer_range=initializer_range)
    tf.LlamaForCausalLM(config).save_pretrained(out_dir)
    smollm2_tokenizer().save_pretrained(out_dir)
    return str(out_dir)


def chat_records(n, seed=0):
    """Conversations of varied length (1-3 exchanges, 1-40 words a turn)."""
    g = torch.Generator().manual_seed(seed)
    words = ["alpha", "beta", "gamma", "delta", "echo", "fox", "golf", "hotel", "india", "kilo", "lima", "mike"]

    def text():
        n_words = int(torch.randint(1, 40, (1,), generator=g))
        return " ".join(words[int(i)] for i in torch.randint(0, len(words), (n_words,), generator=g))

    out = []
    for _ in range(n):
        msgs = []
        for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
            msgs += [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
        out.append({"messages": msgs})
    return out


def write_jsonl(path, records, bad_lines=()):
    """records as JSON lines; bad_lines: {line number (1-based): raw text} inserted as they are."""
    lines, it = [], iter(records)
    total = len(records) + len(bad_lines)
    for k in range(1, total + 1):
        lines.append(dict(bad_lines)[k] if k in dict(bad_lines) else json.dumps(next(it)))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@functools.lru_cache(maxsize=2)
def hf_model(target_dir):
    """The saved target loaded back by plain Hugging Face (fp32, eval mode): the reference in tests."""
    return tf.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


def load_records(specs, split=None, limit=None) -> list:
    """The first ``limit`` records of data specs (all when None) as a list."""
    from dflashkit.extract.data.sources import iter_records

    out = []
    for item in iter_records(specs, split):
        if limit is not None and len(out) >= limit:
            break
        out.append(item)
    return out


def capture_features(target, input_ids, attention_mask, target_layer_ids, store_last_hidden: bool = False):
    """One batch through ``LayerCapture``: (hidden [b, T, K*H], last_hidden [b, T, H] or None)."""
    from dflashkit.targets.capture import LayerCapture

    with LayerCapture(target, target_layer_ids, store_last_hidden) as capture:
        return capture(input_ids, attention_mask)


# ----------------------------------------------------------------------------- train: tiny target + shards
SHARD_LAYER_IDS = [0, 2]  # the taps make_shards stores


def make_tiny_target(path: Path, vocab: int = 96, hidden: int = 32, layers: int = 4, seed: int = 0,
                     heads: int = 4) -> Path:
    """A random Llama target saved as safetensors (no tokenizer: tests pass mask_token_id)."""
    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    model = tf.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path, safe_serialization=True)
    return Path(path)


def make_shards(path: Path, target_dir: Path, num_samples: int = 12, lengths=(24, 40), seed: int = 0,
                last_hidden: bool = True, repeat_first: bool = False, shard_size: int = 1 << 14) -> Path:
    """Features of random token sequences through the tiny target, written with the real shard writer.

    loss_mask: a short "prompt" (False) then the "answer" (True). repeat_first: every sample = sample 0.
    """
    from dflashkit.extract.shards.manifest import SCHEMA_VERSION, update_totals, write_manifest
    from dflashkit.extract.shards.writer import ShardWriter
    from dflashkit.targets.loading import identity_of

    target = tf.AutoModelForCausalLM.from_pretrained(target_dir).eval()
    cfg = target.config
    manifest = {"schema_version": SCHEMA_VERSION, "format": "dflashkit-shards", "complete": False,
                "target": identity_of(Path(target_dir), str(target_dir)), "target_layer_ids": SHARD_LAYER_IDS,
                "num_target_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
                "vocab_size": cfg.vocab_size, "feature_dim": len(SHARD_LAYER_IDS) * cfg.hidden_size, "codec": "bf16",
                "store_last_hidden": last_hidden, "skipped": {}, "notes": {}, "shards": []}
    writer = ShardWriter(path, manifest, shard_bytes=shard_size)
    g = torch.Generator().manual_seed(seed)
    first = None
    for i in range(num_samples):
        n = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=g))
        ids = torch.randint(0, cfg.vocab_size - 1, (n,), generator=g)  # the last id stays free for MASK
        mask = torch.zeros(n, dtype=torch.bool)
        mask[int(torch.randint(2, 6, (1,), generator=g)):] = True
        if repeat_first:
            first = first or (ids, mask)
            ids, mask = first
        with torch.no_grad():
            hs = target(ids[None], output_hidden_states=True).hidden_states
        hidden = torch.cat([hs[i + 1][0] for i in SHARD_LAYER_IDS], dim=-1)
        writer.add_batch([i], [len(ids)], ids.tolist(), mask.tolist(), hidden, hs[-1][0] if last_hidden else None)
    manifest = writer.close()
    manifest["complete"] = True
    update_totals(manifest)
    write_manifest(Path(path) / "manifest.json", manifest)
    return Path(path)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """(target dir, shard dir) shared by the trainer tests."""
    root = tmp_path_factory.mktemp("tiny")
    target = make_tiny_target(root / "target")
    return target, make_shards(root / "shards", target)


# ----------------------------------------------------------------------------- fault tests
def run_until_paused(cmd, pause_at: str, pause_file, timeout: float = 300.0) -> subprocess.Popen:
    """Start ``cmd`` with the test-only pause hook armed at ``pause_at`` and return once the process sits there
    (it has written ``pause_file``). Fails if the process ends first: then the pause point was never reached."""
    pause_file.unlink(missing_ok=True)
    env = dict(os.environ, DFLASHKIT_TEST_PAUSE_AT=pause_at, DFLASHKIT_TEST_PAUSE_FILE=str(pause_file))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout  # a hang guard only: the outcome never depends on how long this takes
    while not pause_file.exists():
        if proc.poll() is not None:
            raise AssertionError(f"ended before reaching {pause_at}: {proc.stderr.read().decode()[-2000:]}")
        assert time.monotonic() < deadline, f"{pause_at} not reached within {timeout} s"
        time.sleep(0.01)
    return proc


@pytest.fixture
def fresh_accelerate_state():
    """For tests that run several trainings in one process: accelerate keeps its state in class attributes."""
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def tiny_overrides(shards, out, **kw) -> dict:
    """TrainConfig fields of a seconds-long CPU training on the shards of ``make_shards``."""
    base = dict(shards=str(shards), output_dir=str(out), mask_token_id=95, num_hidden_layers=2, block_size=4,
                num_anchors=8, eval_samples=2, eval_anchors=4, epochs=2, grad_accum=2, mixed_precision="no",
                wandb=False, save_every=2, keep_last=2, log_every=1, eval_every=0, num_workers=0, progress=False,
                drafter={"intermediate_size": 64}, micro_batch_tokens=0)  # one sequence per micro-batch
    base.update(kw)
    return base


# --------------------------------------------------------------------------- training commands in subprocesses
ACCELERATE_LAUNCH = [sys.executable, "-m", "accelerate.commands.launch"]  # works without the console script


def as_argv(fields: dict) -> list[str]:
    """TrainConfig fields as the ``key=value`` arguments of ``python -m dflashkit.train``."""
    return [f"{k}={json.dumps(v) if isinstance(v, (dict, list, bool)) or v is None else v}" for k, v in fields.items()]


def run_checked(cmd, timeout: float = 900) -> str:
    """Run a command from the repository root on one thread; fail with its output unless it exits 0."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout + p.stderr


# ----------------------------------------------------------------------------- Triton interpreter scripts
# The start of a script run as `python -c SCRIPT TESTS_DIR` with TRITON_INTERPRET=1: it makes the interpreter work
# with numpy >= 2.4 and puts the tests folder (and the repository) on sys.path.
INTERPRETER_PREAMBLE = textwrap.dedent("""
    import json, os, sys, torch
    import numpy
    if tuple(int(x) for x in numpy.__version__.split(".")[:2]) >= (2, 4):
        # the interpreter turns 1-element arrays into loop bounds with int(), which numpy >= 2.4 refuses
        import triton.runtime.interpreter as interp
        original = interp._patch_lang_tensor
        def patched(tensor, scope):
            original(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
        interp._patch_lang_tensor = patched
    sys.path[:0] = [sys.argv[1], os.path.dirname(sys.argv[1])]
""")


def run_in_interpreter(script: str, *args: str):
    """Run ``script`` (INTERPRETER_PREAMBLE + the test's own lines) under TRITON_INTERPRET=1 in a fresh process
    and return the JSON its last line prints; skip where Triton is not installed."""
    pytest.importorskip("triton", reason="triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", script, str(Path(__file__).parent), *args], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def forward_without_dflashkit(export_dir: Path, inputs: dict, work: Path, class_name: str) -> torch.Tensor:
    """The exported drafter's forward on ``inputs`` in a child interpreter where importing dflashkit or dflash
    fails, as on a machine without them: loaded with transformers' AutoModel and the modeling file the export
    ships (``trust_remote_code``); ``class_name`` is the class it must be."""
    from safetensors.torch import load_file, save_file

    save_file({k: v.contiguous() for k, v in inputs.items()}, str(work / "x.safetensors"))
    code = textwrap.dedent(f"""
        import sys, importlib.abc
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('dflashkit', 'dflash'):
                    raise ImportError('blocked: ' + name)
        sys.meta_path.insert(0, Block())
        import torch
        from safetensors.torch import load_file, save_file
        from transformers import AutoModel
        m = AutoModel.from_pretrained({str(export_dir)!r}, trust_remote_code=True, dtype=torch.float32).eval()
        assert type(m).__name__ == {class_name!r}, type(m)
        x = load_file({str(work / 'x.safetensors')!r})
        with torch.no_grad():
            save_file({{'y': m(**x).contiguous()}}, {str(work / 'y.safetensors')!r})
    """)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=work)
    return load_file(str(work / "y.safetensors"))["y"]
