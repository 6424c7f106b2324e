"""TEST DOUBLE for the `flash_attn` package (flash-attn 2.5 semantics) on plain torch, for CPU test processes only.

nanotron 0.4 imports flash-attn's CUDA kernels at module level; this package provides just the symbols it uses
(see tests/nanotron_cpu.py, which puts this folder on sys.path). nano_eval never imports it. Every function is
checked against a naive formula in tests/test_flash_attn_double.py.
"""

__version__ = "2.5.8+nano_eval_test_double"
