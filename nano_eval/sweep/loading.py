"""Load one discovered checkpoint as a backend: the single place where a checkpoint kind meets its loader."""

from __future__ import annotations

import argparse

from nano_eval.sweep.discovery import Checkpoint


def load_backend(ckpt: Checkpoint, args: argparse.Namespace):
    """A backend holding `ckpt`'s weights; `args` carries run.py's model options (device, dtype, tokenizer, ...)."""
    from nano_eval.run import build_backend

    return build_backend(argparse.Namespace(**{**vars(args), "checkpoint": str(ckpt.path)}))
