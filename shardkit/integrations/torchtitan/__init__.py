"""shardkit as the checkpoint engine of torchtitan."""
