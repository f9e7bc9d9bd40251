"""torch.save files: read through torch's own ``weights_only`` unpickler (``reader``), named into
shardkit's keys (``state``), checked record by record against the zip CRC-32s (``zip_records``),
and written in bounded memory (``writer``)."""
