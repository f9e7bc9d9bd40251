"""Hugging Face safetensors files and folders: the reader and writer (``reader``) and an HF folder's names
(``layout``)."""
