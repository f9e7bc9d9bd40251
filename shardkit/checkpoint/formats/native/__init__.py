"""The native format: ``manifest.json`` (``manifest``) + safetensors data files written by
``writer`` and read by byte ranges by ``reader``; ``ownership`` says which files of a directory
shardkit wrote.  The spec is docs/format.md."""
