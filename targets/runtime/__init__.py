"""The one runtime for running a target, shared by regeneration (extract/generation/generator.py), online
training (train/online.py) and eval (eval/): what each of them would otherwise carry its own copy of.

Modules, one concept each: parts (a target's decoder, embedding, final norm and lm_head found once; the
attention-only rule), static_cache (per-layer K/V buffers written in place; plugging our attention functions into
a Hugging Face model), graphs (a static step captured as a CUDA graph, eager on the CPU; staged host inputs),
sampling (the filtered distribution, a draw, speculative sampling's rejection rule), kernels (where the Triton
kernels can run).
"""
