"""scripts/benchmark_live.py: the live backends (nanotron 0.4, megatron-core) against the transformers path and
lm-eval's hf on the same weights and requests. Its weight maps and table are checked fast; one run on the toy model
(every path in its own process, HellaSwag 0-shot on 4 documents) is slow."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.script_loader import REPO, load_script

bench = load_script("scripts/benchmark_live.py", "nano_eval_benchmark_live")


def test_half_rotation_rows_become_interleaved_pairs_and_back():
    """The q / k rows the benchmark gives nanotron 0.4 (interleaved rotary) are the inverse of the map nano_eval's
    checkpoint reader applies to nanotron's rows (nano_eval.checkpoints.llama.interleaved_to_half_rotary)."""
    from nano_eval.checkpoints.llama import interleaved_to_half_rotary

    w = torch.arange(2 * 8 * 3, dtype=torch.float32).view(16, 3)  # 2 heads of dim 8
    assert torch.equal(interleaved_to_half_rotary(bench.half_to_interleaved(w, 2), 2), w)
    assert bench.half_to_interleaved(w, 2)[:4, 0].tolist() == [0, 12, 3, 15]  # rows 0, 4, 1, 5 of head 0


def test_table_reports_ratios_and_flags_differing_accuracies():
    def run(positions, output, seconds, docs):
        return {"cases": {"c": {"positions": positions, "output_positions": output, "seconds": seconds,
                                "scoring_s": seconds, "docs": docs}}}

    args = type("A", (), {"cases": "c", "reps": 1, "train_seq": 8, "interval": 10})
    same, other = [{"acc": 1.0}], [{"acc": 0.0}]
    table, agree = bench.summarize({"transformers": [run(100, 10, 2.0, same)], "megatron": [run(120, 10, 2.4, same)],
                                    "lm-eval": [run(300, 300, 9.6, same)]}, args)
    assert agree and "120 / 10 (1.20x / 1.00x)" in table and "| 1.20 | 4.00x |" in table
    _, agree = bench.summarize({"transformers": [run(100, 10, 2.0, same)], "megatron": [run(100, 10, 2.0, other)]},
                               args)
    assert not agree


@pytest.mark.slow
def test_quick_run_on_the_toy_model(toy_checkpoint):
    """Every path on the toy model: the same token and output-layer positions on nanotron and megatron-core, at most
    1.2x the transformers packed path's, identical accuracies everywhere (exit 0)."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("megatron.core")
    pytest.importorskip("nanotron")
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "benchmark_live.py"), "--checkpoint",
                           str(toy_checkpoint), "--cases", "hellaswag 0-shot", "--limit", "4", "--reps", "1",
                           "--train-steps", "1", "--train-seq", "32", "--lm-batch-sizes", "8"],
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    row = next(line for line in done.stdout.splitlines() if line.startswith("| hellaswag 0-shot (4 docs)"))
    cells = [c.strip() for c in row.split("|")[2:-1]]
    transformers, nanotron, megatron = cells[0], cells[2], cells[3]
    assert nanotron.split(" (")[0] == megatron.split(" (")[0], row  # the two live paths: the same rows
    # against the packed transformers path: at most the 1.2x positions and output-layer positions (on the toy
    # model the live paths ran 635 / 384 where transformers ran 761 / 387, 2026-12-06: not yet explained; on
    # SmolLM2-135M all three are equal, BENCHMARKS.md)
    for cell in (nanotron, megatron):
        ratios = cell.split(" (")[1].rstrip(")").split(" / ")
        assert all(float(r.rstrip("x")) <= 1.2 for r in ratios), row
    assert "ACCURACIES IDENTICAL ON EVERY PATH" in done.stdout
