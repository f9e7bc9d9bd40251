"""torch_checkpointing step folders (``metadata.pkl`` + ``<item>_<rank>.pt``), read (never written) without
running their pickles."""
