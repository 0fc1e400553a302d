"""The parts of a target that DFlash runs, resolved once per target, and the rule for which targets are
attention-only.

Design choices:
- ``TargetParts`` holds the Hugging Face model and where its decoder layers, input embedding, final norm and
  lm_head are. ``load_target`` builds one (a ``Target`` is a ``TargetParts`` with its tokenizer and identity);
  ``target_parts(model)`` (targets/loading.py, which knows the families' embedding scales) builds one for a bare
  Hugging Face model. Layer capture, the verifiers, their fp32 head, the slot generator and online training take
  it instead of each looking the decoder up again.
- The decoder is found the same way for every family: ``model.model``, or ``model.model.language_model`` /
  ``model.language_model.model`` in multimodal wrappers; multimodal wrappers are used through their text config.
- One attention-only rule (``attention_only``): every decoder layer is full or sliding-window attention, so the
  target's whole state is a K/V cache that a static cache can hold and crop. Other layer types (linear
  attention, Mamba, short convolutions, chunked attention) keep the model's own cache: Hugging Face ``generate``
  in regeneration, the hybrid chain verifier in eval.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflashkit.errors import UserError

ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
# where the text decoder (the module owning layers, embed_tokens, norm) sits inside a *ForCausalLM
DECODER_PATHS = ("model.language_model", "model", "language_model.model")


def text_config(config):
    """The text part of a (possibly multimodal) config; a text config as it is."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def layer_types(config) -> list[str]:
    """Each decoder layer's type as the config names it (``full_attention`` for every layer when it names none)."""
    text = text_config(config)
    return list(getattr(text, "layer_types", None) or ["full_attention"] * int(text.num_hidden_layers))


def attention_only(target) -> bool:
    """True when every decoder layer of ``target`` (a model, a TargetParts or a config) is full or sliding-window
    attention, i.e. its state is a K/V cache."""
    config = target.config if hasattr(target, "config") else target
    return set(layer_types(config)) <= ATTENTION_LAYER_TYPES


def find_decoder(model: nn.Module) -> nn.Module:
    """The module that owns `layers`, `embed_tokens` and `norm` inside a *ForCausalLM or multimodal wrapper."""
    for dotted in DECODER_PATHS:
        module = model
        for name in dotted.split("."):
            module = getattr(module, name, None)
        if module is not None and all(hasattr(module, a) for a in ("layers", "embed_tokens", "norm")):
            return module
    raise UserError(f"{type(model).__name__}: found no text decoder with `layers`, `embed_tokens` and `norm` at "
                    f"{' or '.join('model.' + p for p in DECODER_PATHS)}; this architecture needs its own "
                    "FAMILIES entry and layout in targets/loading.py")


def scaled_embedding(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Embedding rows times ``scale``, the scale cast to their dtype first, as Gemma's own embedding module does."""
    return x if scale == 1.0 else x * torch.tensor(scale, dtype=x.dtype, device=x.device)


@dataclass(eq=False)
class TargetParts:
    """A Hugging Face causal LM and its parts, found once (``target_parts`` or ``load_target``)."""

    model: nn.Module  # the HF *ForCausalLM (or multimodal wrapper)
    config: Any  # its text config (num_hidden_layers, hidden_size, vocab_size, layer_types, ...)
    decoder: nn.Module  # the text decoder stack (owns layers, embed_tokens, norm)
    layers: nn.ModuleList  # decoder layers; layer i's output is HF hidden_states[i + 1]
    embed_tokens: nn.Embedding  # input embedding module as HF has it (Gemma's one scales inside); use embed()
    embedding_scale: float  # factor on raw embedding rows: sqrt(hidden_size) for Gemma 3, else 1.0
    final_norm: nn.Module  # norm applied after the last layer
    lm_head: nn.Module  # hidden -> vocab logits (may share its weight with embed_tokens)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """What the first decoder layer sees: embedding rows times embedding_scale."""
        return scaled_embedding(F.embedding(input_ids, self.embed_tokens.weight), self.embedding_scale)


def parts_of(model: nn.Module, embedding_scale: float = 1.0) -> dict:
    """The fields of a TargetParts for ``model`` (a Target adds its own to them)."""
    decoder = find_decoder(model)
    return {"model": model, "config": text_config(model.config), "decoder": decoder, "layers": decoder.layers,
            "embed_tokens": decoder.embed_tokens, "embedding_scale": float(embedding_scale),
            "final_norm": decoder.norm, "lm_head": model.get_output_embeddings()}
