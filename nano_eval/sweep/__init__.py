"""Sweeps: evaluate every checkpoint of a training run directory (once each), tabulate, plot, and watch for more.

    nano_eval sweep RUN_DIR --tasks SPECS --output-dir OUT [--every K] [--last N] [--watch --until-step S]

discovery.py finds and selects checkpoints, runner.py evaluates them (launch.py + worker.py: as submitit jobs with
--launcher local|slurm), table.py and report.py summarise (plots.py draws), snr.py ranks one run's curves by trend /
noise and computes signal, noise and SNR across runs (Heineman et al. 2025), compare.py puts several runs' sweeps
side by side (`nano_eval compare`), metric_kinds.py knows which metrics are lower-is-better or bounded.
"""

from nano_eval.sweep.discovery import Checkpoint, discover, select

__all__ = ["Checkpoint", "discover", "select"]
