"""The library version (one place; the package and the P/D compatibility record read it)."""

__version__ = "0.1.0"
