"""The ``shardkit`` command: parsing and rendering only; the work is in ``shardkit.checkpoint``."""
