"""Model backends. Each returns ModelResponse-ready results through the shared scoring core."""
