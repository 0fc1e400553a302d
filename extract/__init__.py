"""Extraction: turn chat data into token ids and loss masks, regenerate answers with the target, capture the
target's layer features (through ``dflashkit.targets``) and store them as verifiable shards.

Three parts: chat data (``extract.data``: sources, chat rendering and masks, batching), the generation front end
(``extract.generation``: answerers, the slot generator, its cache and decode attention; ``regenerate`` is its
command), and feature shards (``extract.shards``: format, manifest, reader, writer, verify). ``run`` is one
extraction run, joining them; ``__main__`` is its command.

The modules are imported on demand; this package imports nothing heavy on its own.
"""
