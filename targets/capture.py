"""Capture the outputs of chosen target decoder layers (``target_layer_ids``) with forward hooks.

Design choices:

- Layer ``i``'s feature is that layer's output, Hugging Face ``hidden_states[i + 1]`` (docs/ARCHITECTURE.md). For the
  last layer, transformers replaces ``hidden_states[L]`` with the final-norm output, and the reference reads
  it from there, so layer ``L - 1`` is read from the final norm here too: every id gives exactly the tensor
  that ``output_hidden_states=True`` would, without keeping all ``L + 1`` states.
- The forward stops right after the deepest thing needed: a hook raises a private exception that
  ``LayerCapture`` catches. Later layers, the final norm (unless needed) and the lm_head never run.
  ``store_last_hidden=True`` adds the final-norm output (for distillation losses) and stops there.
  ``early_exit=False`` (decoding: the forward must reach the lm_head) keeps the hooks but never stops the
  forward; the same rule for layer ``L - 1`` applies, and ``features()`` returns the last forward's capture.
- Position ids come from the attention mask (``cumsum - 1``), so a left-padded row sees the same positions,
  and yields the same features, as the sample alone; right padding leaves them ``0..T-1`` as usual.
- Decoder layers return a tensor in transformers 5 and a tuple in older or remote code: the first element
  is the hidden state.
- Features are ``[b, T, K*H]`` in the given id order (the drafter's ``fc`` expects that order), padding
  included: callers drop it by the rows' known lengths.
"""

from __future__ import annotations

import torch
from torch import nn

from dflashkit.drafter import check_target_layer_ids as check_layer_ids  # the one range check (drafter/config.py)


class _StopForward(Exception):
    """Raised by a hook once everything asked for is captured; never leaves this module."""


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that count only real tokens (0 at each row's first real token; padding gets 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def _hidden_of(output) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


class LayerCapture:
    """Hooks on a target's decoder layers for repeated captures; use as a context manager.

        with LayerCapture(target, [1, 9, 17]) as capture:
            for batch in batches:
                hidden, last_hidden = capture(batch["input_ids"], batch["attention_mask"])
    """

    def __init__(self, target, target_layer_ids, store_last_hidden: bool = False, early_exit: bool = True):
        self.target = target
        self.layer_ids = check_layer_ids(target_layer_ids, target.num_layers)
        self.store_last_hidden = store_last_hidden  # also return the final-norm output
        self.early_exit = early_exit  # stop the forward after the deepest hook (False: hooks only, for decoding)
        last = target.num_layers - 1
        self._use_norm = store_last_hidden or last in self.layer_ids
        self._stop_at = None if self._use_norm or not early_exit else max(self.layer_ids)  # else the final norm
        self._outputs: dict[int | str, torch.Tensor] = {}
        self._handles = []

    def _layer_hook(self, layer_id: int):
        def hook(module: nn.Module, args, output):
            self._outputs[layer_id] = _hidden_of(output)
            if layer_id == self._stop_at:
                raise _StopForward

        return hook

    def _norm_hook(self, module: nn.Module, args, output):
        self._outputs["norm"] = _hidden_of(output)
        if self.early_exit:
            raise _StopForward

    def __enter__(self) -> "LayerCapture":
        last = self.target.num_layers - 1
        for i in self.layer_ids:
            if i != last:
                self._handles.append(self.target.layers[i].register_forward_hook(self._layer_hook(i)))
        if self._use_norm:
            self._handles.append(self.target.final_norm.register_forward_hook(self._norm_hook))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._outputs.clear()

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """(hidden [b, T, K*H], last_hidden [b, T, H] or None) for a batch; padded positions hold junk."""
        if not self._handles:
            raise RuntimeError("LayerCapture is used outside its `with` block")
        if not self.early_exit:
            raise RuntimeError("LayerCapture(early_exit=False) only records: run the model, then call features()")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        self._outputs.clear()
        try:
            self.target.model(input_ids=input_ids, attention_mask=attention_mask,
                              position_ids=positions_from_mask(attention_mask), use_cache=False)
        except _StopForward:
            pass
        else:
            raise RuntimeError("the target's forward finished without reaching the hooked modules; "
                               "its layers are not called as Target.layers / Target.final_norm")
        return self.features(input_ids.device)

    def features(self, device: torch.device | None = None):
        """(hidden [b, T, K*H], last_hidden [b, T, H] or None) recorded by the last forward; clears the record."""
        last = self.target.num_layers - 1
        missing = [i for i in self.layer_ids if ("norm" if i == last else i) not in self._outputs]
        if missing:
            raise RuntimeError(f"no capture of target layers {missing}: run the model inside the `with` block first")
        parts = [self._outputs["norm" if i == last else i] for i in self.layer_ids]
        hidden = torch.cat(parts, dim=-1) if device is None else torch.cat([p.to(device) for p in parts], dim=-1)
        last_hidden = self._outputs["norm"] if self.store_last_hidden else None
        if last_hidden is not None and device is not None:
            last_hidden = last_hidden.to(device)
        self._outputs.clear()
        return hidden, last_hidden
