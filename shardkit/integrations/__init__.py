"""shardkit as the checkpoint engine inside the frameworks users already train with.

One folder per framework (``lightning/``, ``accelerate/``, ``torchtitan/``).
Nothing here is imported by ``import shardkit``: each folder imports its
framework when it is itself imported, and says which extra to install
(``shardkit[lightning]``, ``shardkit[accelerate]``, ``shardkit[torchtitan]``)
when the framework is missing.  The integrations sit on top of the public
API (``shardkit.checkpoint``, ``shardkit.fully_shard``, ``shardkit.data``);
nothing below them imports them.
"""
