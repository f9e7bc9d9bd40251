"""Former name of :mod:`shardkit.checkpoint.offline`; kept only until its last importers move."""

from shardkit.checkpoint.offline import *  # noqa: F401,F403
from shardkit.checkpoint.offline import __all__  # noqa: F401
