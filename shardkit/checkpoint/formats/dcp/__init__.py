"""torch.distributed.checkpoint directories: the pickled ``.metadata`` read by an allowlisting
unpickler (``metadata``), the torch.save payloads (``payload``), the reader (``reader``),
the writer (``writer``) and its handler (``handler``)."""
