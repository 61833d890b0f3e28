"""Adapters that bring the library's runtimes to model libraries (Hugging Face ``transformers``)."""
