"""shardkit as the checkpoint engine of lightning."""
