"""The generation front end of ``dflashkit regenerate`` (the command is ``extract/regenerate.py``): who answers a
turn (``answerers``: the local target or an OpenAI-compatible server), the slot generator (``generator``: static
cache, continuous batching, CUDA-graph decode steps), its K/V cache and attention function (``slot_cache``), and
the decode attention over that cache (``decode_attention``: the PyTorch twin and the dispatch;
``decode_attention_triton``: the flash-decoding kernel, imported only where Triton is installed).

Imports nothing on its own.
"""
