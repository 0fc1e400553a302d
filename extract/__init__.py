"""Extraction: load a target, turn chat data into token ids and loss masks, capture the target's layer
features and store them as verifiable shards.

The modules are imported on demand (``from dflashkit.extract.target import load_target``); this package
imports nothing heavy on its own. ``target`` loads a target (HF directory, GGUF file, ``testbed:smollm2``)
and knows each family's layout; ``capture`` hooks ``target_layer_ids`` and stops the forward after the
deepest layer needed.
"""
