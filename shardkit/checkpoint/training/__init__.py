"""Checkpoints inside a training job: ``save``/``load`` (collective), the background writer of
``async_save``, and ``CheckpointManager`` (numbered steps, retention, resume)."""
