"""torch.distributed.checkpoint directories: the pickled ``.metadata`` read by an allowlisting
unpickler (``metadata``), the torch.save payloads (``payload``), and the reader and writer
(``reader``)."""
