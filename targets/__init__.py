"""The target room: loading a target and capturing its layer features, shared by extraction, online training and
evaluation.

``loading`` loads a target (Hugging Face directory, GGUF file, ``testbed:smollm2``) and knows each family's layout
and quirks (final norm, embedding scale, decoder path, cache arguments, mask token). ``capture`` is the one
layer-capture implementation: forward hooks on ``target_layer_ids``, the rule for layer ``L - 1``, early exit
after the deepest layer needed. This package imports only ``dflashkit.drafter``; its modules are imported on demand.
"""
