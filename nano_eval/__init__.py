"""nano_eval: score the live training model (or a checkpoint) on benchmarks in its own TP/PP/DP layout."""

__version__ = "0.1.0"
