"""Hugging Face safetensors files and folders: the reader (``reader``), the writer (``writer``), an HF
folder's names (``layout``) and the format's handler (``handler``)."""
