"""Backends: the protocol (base.py) and one file per model framework: transformers, nanotron, megatron."""
