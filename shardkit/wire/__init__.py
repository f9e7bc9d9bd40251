"""The wire: what every part of shardkit sends or spells the same way, below both ``data/`` and ``checkpoint/``.

One definition each of the JSON collectives and the any-failed agreement (:mod:`.collectives`), the
JSON spelling of plain values (:mod:`.json_values`), the FQN rules for wrapped modules (:mod:`.fqn`)
and the names of each generator in an RNG state (:mod:`.rng_keys`).  It imports only the standard
library, torch and :mod:`shardkit.errors`, so that any layer may use it.
"""
