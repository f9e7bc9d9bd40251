"""DeepSpeed ZeRO checkpoints, read (never written) without running their pickles."""
