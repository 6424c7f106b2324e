"""The nanotron integration: the `nano_eval:` YAML section and the trainer mixin, run in a real TP2 job.

nanotron's own DistributedTrainer imports flash-attn and builds CUDA models, so it cannot exist on our machines;
these tests put the real mixin on `ToyNanotronTrainer`, a CPU stand-in with nanotron's attribute names and hook
order that trains a model built from nanotron's parallel modules (see tests/toy_nanotron_trainer.py). The
GPU-only test in tests/test_gpu.py runs hooks/nanotron_eval.py with the real DistributedTrainer.
"""

from pathlib import Path

import pytest
import yaml

pytest.importorskip("nanotron")
wandb = pytest.importorskip("wandb")

from nano_eval.errors import NanoEvalError  # noqa: E402
from nano_eval.tracking.jsonl import read_jsonl  # noqa: E402
from nano_eval.training.nanotron import load_config, parse_eval_section  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402
from tests.nanotron_trainer_worker import train  # noqa: E402
from tests.test_wandb import read_run  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "nanotron_eval.yaml"
TASKS = "demo|arithmetic|0,demo|arithmetic_ppl|0"


def test_example_yaml_parses_with_nanotrons_parser():
    config = load_config(EXAMPLE)
    options = parse_eval_section(config.nano_eval, source=str(EXAMPLE))
    assert options.hook.every_n_steps == 40 and options.hook.also_at_steps == (1,) and options.hook.max_samples == 100
    assert options.hook.tasks == "demo|arithmetic|0,demo|arithmetic_gen|3,demo|arithmetic_ppl|0"
    assert (options.hook.step_key, options.hook.tokens_key) == ("iteration_step", "consumed_tokens")  # nanotron's keys
    assert config.parallelism.tp == 2 and config.tokens.sequence_length == 64


def test_plain_nanotron_config_rejects_the_section(tmp_path):
    """Why `load_config` / `config_class()` exist: nanotron's parser is strict about top-level keys."""
    from nano_eval.compat.nanotron import import_nanotron

    import_nanotron()
    from nanotron.config import get_config_from_file

    with pytest.raises(Exception, match="nano_eval"):
        get_config_from_file(str(EXAMPLE))


@pytest.mark.parametrize("section, message", [
    ({"tasks": "demo|arithmetic|0", "intreval": 5}, r"intreval \(did you mean interval\?\)"),
    ({"interval": 5}, "needs `tasks:`"),
    ({"tasks": "demo|arithmetic|0", "interval": -1}, "every_n_steps must be a positive integer"),
    ("tasks: x", "must be a mapping"),
])
def test_bad_sections_fail_with_the_key_and_the_fix(section, message):
    with pytest.raises(NanoEvalError, match=message):
        parse_eval_section(section, source="train.yaml")


def test_section_switches():
    assert parse_eval_section(None) is None
    assert parse_eval_section({"enabled": False, "tasks": "demo|arithmetic|0"}) is None
    options = parse_eval_section({"tasks": ["demo|arithmetic|0", "demo|arithmetic_ppl|0"], "samples": 3,
                                  "on_save": True, "step_key": "train/step"})
    assert options.on_save and options.hook.max_samples == 3 and options.hook.tasks == TASKS
    assert options.hook.step_key == "train/step"  # the user's choice wins over nanotron's default


def _write_config(tmp_path: Path, tokenizer_dir: Path, name: str, with_eval: bool) -> Path:
    config = yaml.safe_load(EXAMPLE.read_text())
    config["tokenizer"]["tokenizer_name_or_path"] = str(tokenizer_dir)
    config["checkpoints"].update(checkpoints_path=str(tmp_path / name / "checkpoints"), checkpoint_interval=6)
    config["tokens"].update(train_steps=12, micro_batch_size=4, sequence_length=32)
    if with_eval:
        config["nano_eval"] = {"tasks": TASKS, "interval": 4, "on_save": True, "max_samples": 8, "batch_tokens": 512,
                               "output_dir": str(tmp_path / name / "eval")}
    else:
        del config["nano_eval"]
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def tp2_runs(tmp_path_factory):
    """The same TP2 training run with and without the evaluation section."""
    from nano_eval.toy import build_tokenizer

    tmp = tmp_path_factory.mktemp("nanotron_trainer")
    tokenizer_dir = tmp / "tokenizer"
    build_tokenizer().save_pretrained(tokenizer_dir)
    runs = {}
    for name, with_eval in (("with_eval", True), ("without_eval", False)):
        path = _write_config(tmp, tokenizer_dir, name, with_eval)
        runs[name] = run_distributed(train, 2, str(path), str(tmp / name), timeout=300)
    return tmp, runs


def test_training_is_bitwise_identical_with_and_without_evaluation(tp2_runs):
    _, runs = tp2_runs
    with_eval, without = runs["with_eval"], runs["without_eval"]
    assert with_eval[0]["losses"] == without[0]["losses"]  # exact float equality, every step
    assert with_eval[0]["losses"][-1] < with_eval[0]["losses"][0]  # it did train
    assert without[0]["evaluated"] is None


def test_evaluates_at_interval_and_on_save_on_every_rank(tp2_runs):
    tmp, runs = tp2_runs
    # interval 4 -> 4, 8, 12; on_save (checkpoint_interval 6) -> 6; 12 is both and runs once
    assert [r["evaluated"] for r in runs["with_eval"]] == [[4, 6, 8, 12]] * 2
    assert [r["publisher"] for r in runs["with_eval"]] == [True, False]  # nanotron's logger rank (last PP stage)
    rows = read_jsonl(tmp / "with_eval" / "eval" / "eval_results.jsonl")
    assert [r["step"] for r in rows] == [4, 6, 8, 12]
    assert [r["consumed_tokens"] for r in rows] == [s * 4 * 32 for s in (4, 6, 8, 12)]  # step x batch x seq


def test_wandb_rows_share_nanotrons_step_axis(tp2_runs):
    tmp, _ = tp2_runs
    rows, step_metrics = read_run(tmp / "with_eval" / "checkpoints")
    assert step_metrics["eval/*"] == "iteration_step"
    assert [r["iteration_step"] for r in rows if "lm_loss" in r] == list(range(1, 13))
    eval_rows = [r for r in rows if "eval/demo|arithmetic|0/acc" in r]
    assert [r["iteration_step"] for r in eval_rows] == [4, 6, 8, 12]
    assert [r["consumed_tokens"] for r in eval_rows] == [s * 4 * 32 for s in (4, 6, 8, 12)]


def test_on_save_scores_equal_scoring_the_saved_checkpoint(tp2_runs):
    """The live TP2 model at step 6 and its nanotron checkpoint, read back by run.py on one process, agree."""
    from nano_eval.cli import main

    tmp, _ = tp2_runs
    live = {r["step"]: r["results"] for r in read_jsonl(tmp / "with_eval" / "eval" / "eval_results.jsonl")}[6]
    out = tmp / "from_checkpoint"
    assert main(["--checkpoint", str(tmp / "with_eval" / "checkpoints" / "6"), "--tasks", TASKS,
                 "--max-samples", "8", "--output-dir", str(out), "--no-details"]) == 0
    import json

    saved = json.loads((out / "results.json").read_text())["results"]
    for task, metrics in live.items():
        for name, value in metrics.items():
            assert saved[task][name] == pytest.approx(value, rel=1e-5, abs=1e-6), (task, name)
