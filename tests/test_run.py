"""The command line end to end: results files, layout invariance under torchrun, and clear errors on bad input."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nano_eval.cli import main
from tests.dist_utils import free_port

REPO = Path(__file__).resolve().parents[1]
TASKS = "demo|arithmetic|0,demo|arithmetic|2,demo|arithmetic_gen|2,demo|arithmetic_ppl|0"


def _run_cli(tmp_path, ckpt, out, *extra):
    return main(["--checkpoint", str(ckpt), "--tasks", TASKS, "--output-dir", str(out), "--max-samples", "24", *extra])


def _details(out: Path) -> dict:
    rows = {}
    for f in sorted((out / "details").glob("*.jsonl")):
        rows[f.name] = [json.loads(line) for line in f.read_text().splitlines()]
    return rows


def _assert_same_scores(a: Path, b: Path, atol=1e-5):
    ra, rb = (json.loads((p / "results.json").read_text())["results"] for p in (a, b))
    assert ra.keys() == rb.keys()
    for task in ra:
        for metric, value in ra[task].items():
            if metric.startswith(("acc", "exact", "quasi")):  # accuracies and their stderr: identical
                assert value == rb[task][metric], (task, metric)
            else:
                assert value == pytest.approx(rb[task][metric], rel=1e-5), (task, metric)
    da, db = _details(a), _details(b)
    assert da.keys() == db.keys()
    for name in da:
        for x, y in zip(da[name], db[name], strict=True):
            # rolling perplexity logs a document's summed log-prob (hundreds of nats): fp32 sums agree to ~1e-8 relative
            assert x["logprobs"] == pytest.approx(y["logprobs"], rel=1e-7, abs=atol)
            assert x.get("predictions") == y.get("predictions")


def test_results_file_schema_and_table(tmp_path, toy_checkpoint, capsys):
    out = tmp_path / "out"
    assert _run_cli(tmp_path, toy_checkpoint, out) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["schema_version"] == 1
    assert set(doc["results"]) == {"demo|arithmetic|0", "demo|arithmetic|2", "demo|arithmetic_gen|2", "demo|arithmetic_ppl|0"}
    assert {"acc", "acc_stderr", "acc_norm", "acc_norm_pmi"} <= set(doc["results"]["demo|arithmetic|0"])
    assert doc["num_docs"]["demo|arithmetic|0"] == 24 and doc["num_docs"]["demo|arithmetic_ppl|0"] == 20
    assert doc["task_versions"] == {k: 0 for k in doc["results"]}
    assert doc["layout"] == {"world_size": 1, "dp": 1, "tp": 1, "pp": 1}
    assert doc["checkpoint"]["fingerprint"]
    assert len(_details(out)["demo_arithmetic_0.jsonl"]) == 24
    printed = capsys.readouterr().out
    assert "demo|arithmetic|2" in printed and "acc_norm" in printed
    work = doc["positions"]  # scoring work per request type: token positions run, padding, output-layer positions
    assert set(work) == {"loglikelihood", "loglikelihood_rolling"}
    for counts in work.values():
        assert set(counts) == {"forwards", "positions", "padding", "output_positions"}
        assert 0 <= counts["padding"] <= 0.25 * counts["positions"] and 0 < counts["output_positions"]


def test_batch_budget_does_not_change_scores(tmp_path, toy_checkpoint):
    _run_cli(tmp_path, toy_checkpoint, tmp_path / "a", "--batch-tokens", "32")
    _run_cli(tmp_path, toy_checkpoint, tmp_path / "b", "--batch-tokens", "100000")
    _assert_same_scores(tmp_path / "a", tmp_path / "b")


def test_two_data_parallel_processes_match_one(tmp_path, toy_checkpoint):
    _run_cli(tmp_path, toy_checkpoint, tmp_path / "one")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           str(REPO / "nano_eval" / "run.py"), "--checkpoint", str(toy_checkpoint), "--tasks", TASKS,
           "--output-dir", str(tmp_path / "two"), "--max-samples", "24", "--batch-tokens", "64"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "two" / "results.json").read_text())
    assert doc["layout"]["dp"] == 2
    _assert_same_scores(tmp_path / "one", tmp_path / "two")
    one = json.loads((tmp_path / "one" / "results.json").read_text())["positions"]
    for rtype, counts in doc["positions"].items():  # summed over both ranks: at least one rank's share of the work
        assert counts["output_positions"] >= one[rtype]["output_positions"] and counts["forwards"] >= 2, rtype


@pytest.mark.parametrize(
    "tasks, message",
    [
        ("demo|arithmetc|0", "arithmetic"),  # unknown task: names the close match
        ("demo|arithmetic", "suite|task|num_fewshot"),  # malformed spec: shows the expected form
        ("demo|arithmetic|-1", "demo|arithmetic|-1"),
    ],
)
def test_bad_task_specs_give_one_clear_message(tmp_path, toy_checkpoint, capsys, tasks, message):
    out = tmp_path / "out"
    assert main(["--checkpoint", str(toy_checkpoint), "--tasks", tasks, "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nano_eval: error:") and message in err and "Traceback" not in err
    assert not out.exists()


def test_missing_weights_and_missing_data_are_clear(tmp_path, toy_checkpoint, capsys):
    empty = tmp_path / "empty_ckpt"
    empty.mkdir()
    (empty / "config.json").write_text((toy_checkpoint / "config.json").read_text())
    assert main(["--checkpoint", str(empty), "--tasks", "demo|arithmetic|0", "--output-dir", str(tmp_path / "o")]) == 2
    assert "has no weights" in capsys.readouterr().err

    task_file = tmp_path / "my_tasks.py"
    task_file.write_text(
        "from nano_eval.tasks import TaskConfig\n"
        "from nano_eval.tasks.demo_tasks import arithmetic_choice\n"
        f"TASKS_TABLE = [TaskConfig(name='gone', prompt_function=arithmetic_choice, hf_repo={str(tmp_path / 'nope.jsonl')!r},"
        " metrics=['acc'])]\n"
    )
    code = main(["--checkpoint", str(toy_checkpoint), "--tasks", "custom|gone|0", "--custom-tasks", str(task_file),
                 "--output-dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "nope.jsonl" in err and "gone" in err
    assert not (tmp_path / "o").exists()


def test_prompt_longer_than_model_is_cut_counted_and_reported(tmp_path, toy_checkpoint, capsys):
    out = tmp_path / "out"
    code = main(["--checkpoint", str(toy_checkpoint), "--tasks", "demo|arithmetic|3", "--output-dir", str(out),
                 "--max-samples", "4", "--max-length", "24"])
    assert code == 0
    err = capsys.readouterr().err
    assert "demo|arithmetic|3: 4 of 4 documents had their context cut" in err and "--max-length" in err
    assert json.loads((out / "results.json").read_text())["truncated_requests"]["demo|arithmetic|3"] == 4


FAILING_RANK_TASKS = """
import os
from nano_eval.backends.transformers import TransformersModel
from nano_eval.tasks.demo_tasks import DEMO_TASKS

TASKS_TABLE = []
if os.environ.get("RANK") == "1":  # test-only fault injection: rank 1's forward breaks mid-evaluation
    original = TransformersModel.forward
    calls = []
    def broken_forward(self, batch):
        calls.append(1)
        if len(calls) > 2:
            raise RuntimeError("injected failure on the third batch")
        return original(self, batch)
    TransformersModel.forward = broken_forward
"""


def test_a_rank_that_raises_stops_every_rank_promptly(tmp_path, toy_checkpoint):
    task_file = tmp_path / "failing.py"
    task_file.write_text(FAILING_RANK_TASKS)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           str(REPO / "nano_eval" / "run.py"), "--checkpoint", str(toy_checkpoint), "--tasks", TASKS,
           "--custom-tasks", str(task_file), "--output-dir", str(tmp_path / "out"), "--batch-tokens", "64"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    assert "nano_eval: error: [rank 1] evaluation failed: RuntimeError: injected failure on the third batch" in proc.stderr
    assert not (tmp_path / "out" / "results.json").exists()


def test_nanotron_checkpoint_without_tokenizer_says_how_to_name_one(tmp_path, capsys):
    ckpt = tmp_path / "nanotron_ckpt"
    (ckpt / "model").mkdir(parents=True)
    (ckpt / "config.yaml").write_text("model: {model_config: {}}\n")
    assert main(["--checkpoint", str(ckpt), "--tasks", "demo|arithmetic|0", "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "names no tokenizer" in err and "--tokenizer" in err and "Traceback" not in err


def test_native_nanotron_backend_without_gpu_says_what_is_missing(tmp_path, capsys):
    ckpt = tmp_path / "nanotron_ckpt"
    (ckpt / "model").mkdir(parents=True)
    (ckpt / "config.yaml").write_text("model: {model_config: {}}\n")
    code = main(["--checkpoint", str(ckpt), "--backend", "nanotron", "--tp", "2", "--tasks", "demo|arithmetic|0",
                 "--output-dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    import torch

    if not torch.cuda.is_available():  # CPU machines (flash-attn's Python package may be installed, not its kernels)
        assert code == 2 and "lacks" in err
    if code == 2 and "lacks" in err:
        assert "flash-attn" in err and "--backend transformers" in err and "Traceback" not in err
    else:  # a GPU node with flash-attn: the (empty) checkpoint itself is the problem, still not a hang
        assert code != 0
