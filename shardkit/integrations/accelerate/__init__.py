"""shardkit as the checkpoint engine of accelerate."""
