"""Feature shards: the file format and codec (``format``), the manifest (``manifest``), the memory-mapped reader
(``reader``), the crash-safe writer and its host staging buffers (``writer``, ``staging``), and the checker behind
``dflashkit verify`` (``verify``).

Extraction writes shards; offline training reads them. Imports nothing on its own.
"""
