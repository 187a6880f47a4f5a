"""hpcinfer: fast offline batch inference for transformer models."""

__version__ = "0.1.0"
