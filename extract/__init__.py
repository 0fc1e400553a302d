"""Extraction: turn chat data into token ids and loss masks, regenerate answers with the target, capture the
target's layer features (through ``dflashkit.targets``) and store them as verifiable shards.

The modules are imported on demand; this package imports nothing heavy on its own.
"""
