"""The hot tier of :class:`~shardkit.checkpoint.training.manager.CheckpointManager`: node-local copies of
every rank's shards, replicas of them on other nodes, and recovery from whichever copies survive.

* :mod:`.layout`   -- which node a rank is on, where its copies and replicas live, the names in a node's directory
* :mod:`.copies`   -- one rank's shards as a small native checkpoint: write, stage, read back checked
* :mod:`.save`     -- a hot save: own copy, replication, the vote on completion, the per-node marker
* :mod:`.recover`  -- the collective choice of the newest step every rank can assemble from verified copies
* :mod:`.retention` -- what a node keeps, and the up-front check that its directory can hold it
* :mod:`.tier`     -- the manager's options, save naming, the space check, the host copy for background saves
* :mod:`.resume`   -- loading an agreed copy into the model, optimizer and input state; ``LastLoad``
"""
