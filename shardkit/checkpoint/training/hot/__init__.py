"""The hot tier of :class:`~shardkit.checkpoint.training.manager.CheckpointManager`: node-local copies of
every rank's shards, replicas of them on other nodes, and recovery from whichever copies survive.

* :mod:`.nodes`      -- which node a rank is on, where its copies and replicas live, the names in a node's
  directory (``CopyName``)
* :mod:`.copies`     -- one rank's shards as a copy: the state taken, written, read back and checked
* :mod:`.flat`       -- a copy on disk: one data file and a checksummed manifest, published atomically
* :mod:`.replicate`  -- a hot save: own copy, replication, the vote on completion, the per-node marker
* :mod:`.recover`    -- the collective choice of the newest step every rank can assemble from verified copies
* :mod:`.local_keep` -- what a node keeps, and the up-front check that its directory can hold it
* :mod:`.roots`      -- whose copies a ``local=`` directory holds
* :mod:`.tier`       -- ``HotTier``, the manager's node-local tier: options, save naming, the space check, the
  host copy for background saves
* :mod:`.restore`    -- loading an agreed copy into the model, optimizer and input state; ``LastLoad``
"""
