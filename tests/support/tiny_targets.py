"""Random tiny targets, all built in code (no downloads).

- VOCAB / tiny_target_config / prompts: the 6-token Llama of the engine tests (eval).
- TINY_FAMILIES / tiny_family_config / save_tiny_target / tiny_tokenizer: one tiny random target per supported
  family (targets).
- make_tiny_target: the random Llama the training tests extract shards from (recipes/tiny.yaml).
- hf_model / capture_features: the references a saved target is checked against.
"""

import functools
from pathlib import Path

import torch
import transformers as tf

# ----------------------------------------------------------------------------- eval: a 6-token Llama
VOCAB = 6  # so small that a random drafter is accepted often enough for rounds of every length


def tiny_target_config(**overrides):
    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3)
    return tf.LlamaConfig(**{**fields, **overrides})


def prompts(n=10, length=8):
    return [torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(s)).tolist()
            for s in range(n)]


# ----------------------------------------------------------------------------- targets: every family, tiny
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


# ----------------------------------------------------------------------------- train: the tiny training target
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


# ----------------------------------------------------------------------------- references
@functools.lru_cache(maxsize=2)
def hf_model(target_dir):
    """The saved target loaded back by plain Hugging Face (fp32, eval mode): the reference in tests."""
    return tf.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


def capture_features(target, input_ids, attention_mask, target_layer_ids, store_last_hidden: bool = False):
    """One batch through ``LayerCapture``: (hidden [b, T, K*H], last_hidden [b, T, H] or None)."""
    from dflashkit.targets.capture import LayerCapture

    with LayerCapture(target, target_layer_ids, store_last_hidden) as capture:
        return capture(input_ids, attention_mask)


SMALL_TARGET_DIMS = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=100)


def small_drafter(seed: int = 0):
    """A random two-layer drafter (block 4, mask id 99) for a small Llama shape, seeded."""
    from transformers import LlamaConfig

    from dflashkit.drafter import DrafterConfig, build_drafter

    torch.manual_seed(seed)
    return build_drafter(DrafterConfig.for_target(LlamaConfig(**SMALL_TARGET_DIMS), num_hidden_layers=2,
                                                  block_size=4, mask_token_id=99))


def small_export(path: Path, seed: int = 0) -> Path:
    """``small_drafter(seed)`` exported to ``path``."""
    from dflashkit.drafter import save_drafter

    return save_drafter(small_drafter(seed), path)
