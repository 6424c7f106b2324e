"""How many bootstrap resamples lm_eval|... stderrs get (lm-eval's `bootstrap_iters`): lm-eval's 100000 from the
command line unless --lm-eval-bootstrap-iters says otherwise, 100 in the training hook unless
EvalHookConfig.lm_eval_bootstrap_iters says otherwise, 0 = no stderrs as in lm-eval (compared with lm-eval's own
simple_evaluate at 0). lm-eval's bootstrap itself is replaced by a recorder in the tests that only count resamples
(100000 real resamples of an mcc take minutes); its aggregation code around it is lm-eval's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from nano_eval.cli import main  # noqa: E402
from nano_eval.evaluator import EvalConfig, Evaluator  # noqa: E402
from nano_eval.tasks import lm_eval_examples as examples  # noqa: E402
from nano_eval.tasks import load_tasks  # noqa: E402
from nano_eval.tasks import lm_eval_tasks as lmt  # noqa: E402

TASK = examples.multiple_choice("nano_boot_mcc", "{{a}} plus {{b}} =", metrics=("acc", "mcc"),
                               few_shot=False)
SPEC = "lm_eval|nano_boot_mcc|0"


@pytest.fixture(scope="module")
def include_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lm_eval_bootstrap")
    examples.write_include_dir(root, TASK)
    return root


@pytest.fixture
def resamples(monkeypatch) -> list[int]:
    """The `iters` of every bootstrap lm-eval starts (its stderr_for_metric calls this module attribute)."""
    import lm_eval.api.metrics as metrics

    calls: list[int] = []

    def record(f, xs, iters):
        calls.append(iters)
        return 0.125

    monkeypatch.setattr(metrics, "bootstrap_stderr", record)
    return calls


def _evaluate(backend, include_dir, **config) -> dict[str, float]:
    tasks = load_tasks(SPEC, lm_eval_include_path=include_dir)
    results = Evaluator(backend, tasks, EvalConfig(max_samples=6, progress=False, **config)).evaluate()
    return results.tasks[SPEC].metrics


def test_lm_evals_default_unless_told(include_dir, toy_backend, resamples):
    metrics = _evaluate(toy_backend, include_dir)
    assert resamples == [100000] and metrics["mcc_stderr,none"] == 0.125
    assert math.isfinite(metrics["acc_stderr,none"])  # the mean's stderr is analytic: no bootstrap
    _evaluate(toy_backend, include_dir, lm_eval_bootstrap_iters=250)
    assert resamples == [100000, 250]


def test_zero_means_no_stderrs_as_in_lm_eval(include_dir, toy_backend, resamples):
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    ours = _evaluate(toy_backend, include_dir, lm_eval_bootstrap_iters=0)
    assert resamples == []
    lm = HFLM(pretrained=toy_backend.module, tokenizer=toy_backend.tokenizer, batch_size=4,
              max_length=toy_backend.max_length, device="cpu")
    reference = lm_eval.simple_evaluate(model=lm, tasks=["nano_boot_mcc"], limit=6, bootstrap_iters=0,
                                        task_manager=lmt.task_manager(include_dir))["results"]["nano_boot_mcc"]
    expected = {k: v for k, v in reference.items() if "," in k}
    assert set(ours) == set(expected)
    for key, value in expected.items():
        if value == "N/A":
            assert math.isnan(ours[key]), key
        else:
            assert math.isclose(ours[key], value, rel_tol=1e-6), key
    assert all(math.isnan(ours[k]) for k in ours if "_stderr" in k)  # the mean's analytic one too, as lm-eval


def test_the_training_hook_bootstraps_100_times_unless_told(include_dir, toy_backend, resamples, tmp_path):
    from nano_eval.training.config import EvalHookConfig
    from nano_eval.training.hook import EvalHook

    def hook_metrics(**config) -> dict:
        hook = EvalHook(EvalHookConfig(tasks=SPEC, max_samples=6, lm_eval_include_path=str(include_dir),
                                       output_dir=tmp_path / str(len(resamples)), **config), toy_backend)
        return hook(1).tasks[SPEC].metrics

    assert EvalHookConfig(tasks=SPEC).lm_eval_bootstrap_iters == 100
    hook_metrics()
    hook_metrics(lm_eval_bootstrap_iters=None)  # lm-eval's own
    assert resamples == [100, 100000]
    assert math.isnan(hook_metrics(lm_eval_bootstrap_iters=0)["mcc_stderr,none"]) and len(resamples) == 2
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="lm_eval_bootstrap_iters must be an integer >= 0"):
            EvalHookConfig(tasks=SPEC, lm_eval_bootstrap_iters=bad)


def test_the_command_line_option(include_dir, toy_checkpoint, resamples, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["--checkpoint", str(toy_checkpoint), "--tasks", SPEC, "--device", "cpu", "--max-samples", "4",
            "--lm-eval-include-path", str(include_dir), "--output-dir", str(out)]
    assert main(args + ["--lm-eval-bootstrap-iters", "300"]) == 0
    assert resamples == [300]
    document = json.loads((out / "results.json").read_text())
    assert document["config"]["lm_eval_bootstrap_iters"] == 300
    assert main(args + ["--lm-eval-bootstrap-iters", "-1"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("nano_eval: error")]
    assert len(err) == 1 and "--lm-eval-bootstrap-iters: must be 0 or more" in err[0], err


def test_a_sweep_with_other_bootstrap_iterations_has_another_identity():
    from nano_eval.job import EvalJob
    from nano_eval.sweep.identity import evaluation_identity

    def identity(iters, task=SPEC):
        job = EvalJob(tasks=task, eval=EvalConfig(lm_eval_bootstrap_iters=iters))
        return evaluation_identity(job, [task], {task: 1}, "fp")

    assert identity(None) == identity(100000) != identity(1000) != identity(0)
    assert identity(1000, "demo|arithmetic|0") == identity(None, "demo|arithmetic|0")  # no lm_eval task: no effect
