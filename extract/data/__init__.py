"""Chat data: records from files, datasets and built-in sources (``sources``), rendered with the target's chat
template into token ids and assistant loss masks (``chat``), bucketed by length into batches (``batching``).

Used by extraction, regeneration, online training and eval's prompt lists. Imports nothing heavy on its own.
"""
