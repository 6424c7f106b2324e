"""Checkpoint readers: detect a format and read it into a backend (see load.py)."""
