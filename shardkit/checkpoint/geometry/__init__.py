"""Pure arithmetic on boxes of global tensors: which box a DTensor placement gives a rank
(``boxes``), and which stored bytes a wanted box needs (``plan``).  No I/O, no formats."""
