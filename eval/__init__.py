"""Acceptance evaluation: live speculative decoding (chain and tree), tree attention, reports, serving sweeps.

`python -m dflashkit.eval --help` (or `dflashkit eval`) is the command; the modules are:
acceptance (the acceptance rule), tree (draft trees), tree_attention (kernel and twin), verifier (the target with
its own KV cache), engine (the round loop), report, serving, prompts.
"""
