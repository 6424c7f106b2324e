"""Metrics: `Metric` records, the `METRICS` registry and `get_metric` (which also builds pass@K / maj@K)."""

from nano_eval.metrics.metric import Metric
from nano_eval.metrics.registry import METRICS, get_metric

__all__ = ["Metric", "METRICS", "get_metric"]
