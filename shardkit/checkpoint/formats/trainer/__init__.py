"""Hugging Face Trainer and Accelerate checkpoint folders: their parts read as one checkpoint."""
