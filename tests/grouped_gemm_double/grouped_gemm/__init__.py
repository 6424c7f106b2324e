"""TEST DOUBLE of the `grouped_gemm` package (CUDA/CUTLASS only); see ops.py."""
