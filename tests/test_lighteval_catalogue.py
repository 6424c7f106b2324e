"""lighteval's own catalogue in nano_eval: files that name metrics nano_eval cannot compute still list and run their
other tasks; alias-list golds; few_shots_split lists; the library-backed metrics against their libraries on fixed
examples; the multilingual templates (exact prompt text) and a multilingual task file end to end on the toy model.
Task files: tests/lighteval_tasks/catalogue_tasks.py and multilingual_tasks.py (lighteval's style, imports changed)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from nano_eval.errors import UnsupportedTaskError
from nano_eval.evaluator import EvalConfig, Evaluator
from nano_eval.tasks import Registry, build_requests, load_tasks
from nano_eval.tasks.lighteval import (CFFormulation, Doc, HybridFormulation, Language, MCFFormulation, Metrics,
                                       ModelResponse, get_boolq_prompt_function, get_continuation_prompt_function,
                                       get_copa_prompt_function, get_hellaswag_prompt_function,
                                       get_mcq_prompt_function, get_nli_prompt_function, get_qa_prompt_function,
                                       get_translation_prompt_function, to_nano_metrics)

FILES = Path(__file__).parent / "lighteval_tasks"
CATALOGUE, MULTILINGUAL = FILES / "catalogue_tasks.py", FILES / "multilingual_tasks.py"


def write(root: Path, name: str, split: str, rows: list[dict]) -> None:
    path = root / "nano-eval-tests" / name / "default" / f"{split}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def metric(member, **params):
    """The nano_eval metric of a Metrics member (one name) or {name: metric} (grouped)."""
    out = to_nano_metrics(member(sample_params=params) if params else member)
    return out[0] if len(out) == 1 else {m.name: m for m in out}


@pytest.fixture(scope="module")
def mirror(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mirror")
    reviews = [("great film, loved it", 2), ("dull and far too long", 0), ("it was fine", 1), ("superb acting", 2),
               ("a waste of time", 0), ("neither good nor bad", 1), ("wonderful", 2), ("terrible plot", 0)]
    write(root, "sentiment", "train", [{"text": t, "label": y} for t, y in reviews[:3]])
    write(root, "sentiment", "validation", [{"text": t, "label": y} for t, y in reviews[3:]])
    write(root, "aliases", "validation", [{"question": f"{a} plus {b}?", "aliases": [str(a + b), f"{a + b}.0"]}
                                          for a, b in [(1, 2), (3, 4), (5, 1), (2, 2)]])
    write(root, "translation", "validation", [{"fr": "le chat dort", "en": "the cat sleeps"},
                                              {"fr": "il pleut", "en": "it is raining"}])
    write(root, "math", "validation", [{"problem": "1+1", "answer": "2"}, {"problem": "half of 1", "answer": "1/2"}])
    write(root, "truthfulqa", "validation", [{
        "question": "Can pigs fly?",
        "mc1_targets": {"choices": ["No.", "Yes."], "labels": [1, 0]},
        "mc2_targets": {"choices": ["No.", "Not by themselves.", "Yes."], "labels": [1, 1, 0]}}])
    quiz = [{"question": f"combien font {a} et {b}", "options": [str(a + b), str(a + b + 1), str(a * b + 7)],
             "answer": "A"} for a, b in [(1, 1), (2, 3), (4, 4), (5, 2), (3, 3)]]
    write(root, "quiz", "dev", quiz[:2])
    write(root, "quiz", "test", quiz[2:])
    write(root, "capitals", "validation", [{"context": "Paris est la capitale de la France.",
                                            "question": "quelle est la capitale de la France?",
                                            "answers": ["Paris", "paris", "la ville de Paris"]}])
    write(root, "yesno", "validation", [{"question": "is the sky blue", "answer": True, "passage": "The sky is blue."}])
    write(root, "copa", "validation", [{"premise": "The man fell.", "question": "cause",
                                        "choices": ["He slipped on ice.", "He was happy."], "label": 0}])
    write(root, "nli", "validation", [{"premise": "A dog runs.", "hypothesis": "An animal moves", "label": 0}])
    write(root, "story", "validation", [{"story": "She opened the door.", "endings": ["she went out.", "The sun set."],
                                         "label": 0}])
    write(root, "story_hs", "validation", [{"activity_label": "cooking", "ctx_a": "A man cuts onions.",
                                            "ctx_b": "then he", "endings": ["fries them.", "sings [title] loudly."],
                                            "label": 0}])
    return root


# ---------------------------------------------------------------- files with metrics nano_eval cannot compute


def test_file_with_an_unsupported_metric_lists_every_task_and_runs_the_others(toy_backend, mirror, capsys):
    registry = Registry(CATALOGUE)
    assert registry.list_tasks()["custom"] == ["aliases", "math", "sentiment", "sentiment:bertscore", "translation",
                                               "truthfulqa:mc"]
    registry.print_tasks(["custom"])
    listed = capsys.readouterr().out
    assert "  custom|sentiment:bertscore  (cannot run in nano_eval: metric `Metrics.bert_score`: it scores" in listed
    assert "  custom|sentiment\n" in listed
    with pytest.raises(UnsupportedTaskError, match=r"task 'custom\|sentiment:bertscore' cannot run in nano_eval: "
                                                   r"metric `Metrics.bert_score`: it scores with a neural model"):
        load_tasks("custom|sentiment:bertscore|0", custom_tasks=CATALOGUE, data_dir=mirror)
    # the training hook's way: the refused task is recorded and left out, the others load
    refused: dict[str, str] = {}
    tasks = load_tasks("custom|sentiment|2,custom|sentiment:bertscore|0,custom|aliases|0,custom|translation|0,"
                       "custom|math|0,custom|truthfulqa:mc|0", custom_tasks=CATALOGUE, data_dir=mirror,
                       bad_documents=refused)
    assert list(refused) == ["custom|sentiment:bertscore"] and len(tasks) == 5
    results = Evaluator(toy_backend, tasks, EvalConfig(progress=False)).evaluate()
    assert not results.failed
    got = {key: tr.metrics for key, tr in results.tasks.items()}
    assert {"acc", "mcc", "loglikelihood_f1", "mf1", "mrr", "recall"} <= set(got["custom|sentiment|2"])
    assert {"bleu", "chrf", "ter", "bleu_1", "rougeL", "f1"} <= set(got["custom|translation|0"])
    assert {"extractive_match", "pass@k:k=1&n=2", "avg@n:n=2"} <= set(got["custom|math|0"])
    assert {"truthfulqa_mc1", "truthfulqa_mc2"} <= set(got["custom|truthfulqa:mc|0"])
    assert all(not math.isnan(v) for m in got.values() for k, v in m.items() if not k.endswith("_stderr"))

    # corpus metrics recomputed by their libraries from the per-document details
    from sklearn.metrics import f1_score, matthews_corrcoef
    import sacrebleu

    details = results.tasks["custom|sentiment|2"].details
    golds = [d["gold_index"] for d in details]
    preds = [int(np.argmax(d["logprobs"])) for d in details]
    assert got["custom|sentiment|2"]["mcc"] == pytest.approx(matthews_corrcoef(golds, preds))
    assert got["custom|sentiment|2"]["loglikelihood_f1"] == pytest.approx(max(f1_score(golds, preds, average=None)))
    details = results.tasks["custom|translation|0"].details
    hyps, refs = [d["predictions"][0] for d in details], [d["choices"][0] for d in details]
    assert got["custom|translation|0"]["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score)
    assert got["custom|translation|0"]["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score)


def test_few_shots_split_list_draws_examples_from_those_splits_in_order(mirror):
    [(spec, task)] = load_tasks("custom|sentiment|4", custom_tasks=CATALOGUE, data_dir=mirror)
    assert task.get_first_possible_fewshot_splits() == ["train", "validation"]
    pool = [d.query for d in task.fewshot_docs()]
    assert [q.split("\n")[0] for q in pool] == [f"Review: {t}" for t in [
        "great film, loved it", "dull and far too long", "it was fine", "superb acting", "a waste of time",
        "neither good nor bad", "wonderful", "terrible plot"]]
    docs, requests = build_requests(task, 4, max_samples=1)
    assert requests[0].context.startswith("Review: great film, loved it\nSentiment: positive\n\n")


def test_alias_list_golds_are_flattened_and_scored(toy_backend, mirror):
    doc = Doc(query="q", choices=[["Paris", "paris, france"], "Lyon"], gold_index=0)
    assert doc.get_golds() == ["Paris", "paris, france"]
    assert metric(Metrics.exact_match).compute(doc, ModelResponse(text=["paris, france"])) == 1
    normalised = Doc(query="q", choices=[["paris", "paris france"]], gold_index=0)  # as triviaqa_prompt writes them
    assert metric(Metrics.quasi_exact_match_triviaqa).compute(normalised, ModelResponse(text=["Paris!"])) == 1
    assert metric(Metrics.exact_match).compute(doc, ModelResponse(text=["Lyon"])) == 0
    tasks = load_tasks("custom|aliases|0", custom_tasks=CATALOGUE, data_dir=mirror)
    result = Evaluator(toy_backend, tasks, EvalConfig(progress=False)).evaluate().tasks["custom|aliases|0"]
    for d in result.details:  # every alias of the document is a gold: the score is the best over them
        pred = d["predictions"][0].strip()
        assert d["metrics"]["em"] == int(pred in d["choices"][0])


# ---------------------------------------------------------------- metrics against their libraries


def test_matthews_and_f1_agree_with_scikit_learn():
    from sklearn.metrics import f1_score, matthews_corrcoef

    from nano_eval.metrics import lighteval_scores

    rng = np.random.default_rng(0)
    for _ in range(100):  # random label sets, including degenerate ones (one class, a class never predicted)
        n, k = int(rng.integers(1, 30)), int(rng.integers(1, 4))
        g, p = rng.integers(0, k, n).tolist(), rng.integers(0, k + 1, n).tolist()
        assert lighteval_scores.matthews_corrcoef(g, p) == pytest.approx(matthews_corrcoef(g, p), abs=1e-12)
        for average in (None, "macro", "micro", "weighted"):
            assert np.allclose(lighteval_scores.f1_scores(g, p, average), f1_score(g, p, average=average,
                                                                                    zero_division=0))

    golds, preds = [0, 1, 1, 0, 2, 2, 1, 0], [0, 1, 0, 0, 2, 1, 1, 2]
    logprobs = [[-1.0 if i == p else -3.0 for i in range(3)] for p in preds]
    docs = [Doc(query="q", choices=[" a", " b", " c"], gold_index=g) for g in golds]
    items = {name: [metric(member).compute(d, ModelResponse(logprobs=lp)) for d, lp in zip(docs, logprobs)]
             for name, member in [("mcc", Metrics.mcc), ("f1", Metrics.loglikelihood_f1),
                                  ("mf1", Metrics.multi_f1_numeric)]}
    assert metric(Metrics.mcc).aggregate(items["mcc"]) == pytest.approx(matthews_corrcoef(golds, preds))
    assert metric(Metrics.loglikelihood_f1).aggregate(items["f1"]) == pytest.approx(
        max(f1_score(golds, preds, average=None)))
    assert metric(Metrics.multi_f1_numeric).aggregate(items["mf1"]) == pytest.approx(np.mean(
        [f1_score([g == c for g in golds], [p == c for p in preds], average="micro") for c in range(3)]))
    words = ["yes", "no", "yes", "maybe"]
    said = ["yes", "yes", "yes", "maybe"]
    gen = [metric(Metrics.f1_score_macro).compute(Doc(query="q", choices=[w], gold_index=0), ModelResponse(text=[s]))
           for w, s in zip(words, said)]
    assert metric(Metrics.f1_score_macro).aggregate(gen) == pytest.approx(f1_score(words, said, average="macro"))
    assert metric(Metrics.f1_score_micro).aggregate(gen) == pytest.approx(f1_score(words, said, average="micro"))


def test_translation_metrics_agree_with_sacrebleu():
    import sacrebleu

    refs = ["the cat is on the mat", "there is a dog in the garden", "it rains a lot today"]
    hyps = ["the cat sat on the mat", "a dog is in the garden", "today it rains a lot"]
    for member, reference in [(Metrics.bleu, sacrebleu.BLEU()), (Metrics.chrf, sacrebleu.CHRF()),
                              (Metrics.chrf_plus, sacrebleu.CHRF(word_order=2)), (Metrics.ter, sacrebleu.TER())]:
        m = metric(member)
        items = [m.compute(Doc(query="q", choices=[r], gold_index=0), ModelResponse(text=[h]))
                 for r, h in zip(refs, hyps)]
        assert m.aggregate(items) == pytest.approx(reference.corpus_score(hyps, [refs]).score), member.name
    assert metric(Metrics.ter).higher_is_better is False


def test_rouge_and_sentence_bleu_agree_with_rouge_score_and_nltk():
    from nltk.tokenize import NLTKWordTokenizer
    from nltk.translate.bleu_score import sentence_bleu
    from rouge_score import rouge_scorer, scoring

    golds, pred = ["the quick brown fox jumps", "a fast brown fox leaps"], "the brown fox jumps high"
    doc, response = Doc(query="q", choices=golds, gold_index=[0, 1]), ModelResponse(text=[pred])
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"])
    for name in ["rouge1", "rouge2", "rougeL", "rougeLsum"]:
        expected = np.mean([scorer.score(g, pred)[name].fmeasure for g in golds])
        assert metric(getattr(Metrics, name)).compute(doc, response) == pytest.approx(expected)
    t5 = metric(Metrics.rouge_t5)
    aggregator = scoring.BootstrapAggregator()
    aggregator.add_scores(scorer.score(golds[0], pred))
    assert t5["rouge2"].compute(doc, response) == pytest.approx(aggregator.aggregate()["rouge2"].mid.fmeasure * 100)
    tokenize = NLTKWordTokenizer().tokenize  # what nltk's word_tokenize does on one sentence
    for n, member in [(1, Metrics.bleu_1), (4, Metrics.bleu_4)]:
        weights = [1 if i == n else 0 for i in range(1, 5)]
        expected = sentence_bleu([tokenize(g) for g in golds], tokenize(pred), weights=weights)
        assert metric(member).compute(doc, response) == pytest.approx(expected)


def test_truthfulqa_mc1_mc2_agree_with_lm_eval():
    from lm_eval.tasks.truthfulqa.utils import process_results_mc2

    from nano_eval.tasks.lighteval import truthful_qa_multiple_choice_prompt

    row = {"question": "Q?", "mc1_targets": {"choices": ["a", "b", "c"], "labels": [1, 0, 0]},
           "mc2_targets": {"choices": ["a", "a2", "b", "c"], "labels": [1, 1, 0, 0]}}
    doc = truthful_qa_multiple_choice_prompt(row)
    assert doc.gold_index == [0, 3, 4] and doc.specific == {"len_mc1": 3}
    logprobs = [-1.2, -0.7, -2.0, -1.5, -1.1, -0.9, -2.5]
    mc = metric(Metrics.truthfulqa_mc_metrics)
    response = ModelResponse(logprobs=logprobs)
    assert mc["truthfulqa_mc1"].compute(doc, response) == int(np.argmax(logprobs[:3]) == 0) == 0
    expected = process_results_mc2(row, [(lp, False) for lp in logprobs[3:]])["acc"]
    assert mc["truthfulqa_mc2"].compute(doc, response) == pytest.approx(expected)


def test_math_answers_agree_with_math_verify_and_pass_at_k_uses_them():
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    doc = Doc(query="q", choices=["1/2"], gold_index=0)
    preds = ["so the answer is $\\frac{1}{2}$", "The result is \\boxed{0.5}", "I think 3"]
    expr = metric(Metrics.expr_gold_metric)
    gold = parse("1/2", [ExprExtractionConfig()])
    for p in preds:
        expected = float(verify(gold, parse(p, [ExprExtractionConfig(), LatexExtractionConfig(boxed_match_priority=0)]),
                                float_rounding=5))
        assert expr.compute(doc, ModelResponse(text=[p])) == expected
    assert [expr.compute(doc, ModelResponse(text=[p])) for p in preds] == [1.0, 1.0, 0.0]
    k1 = metric(Metrics.pass_at_k_math, k=1, n=3)
    assert k1.num_samples == 3 and k1.compute(doc, ModelResponse(text=preds)) == pytest.approx(2 / 3)
    assert metric(Metrics.pass_at_k_math, k=2, n=3).compute(doc, ModelResponse(text=preds)) == 1.0
    assert metric(Metrics.avg_at_n_math, n=3).compute(doc, ModelResponse(text=preds)) == pytest.approx(2 / 3)


def test_ranking_metrics_and_refusals_by_name():
    doc = Doc(query="q", choices=[" a", " bb", " c"], gold_index=2)
    response = ModelResponse(logprobs=[-1.0, -3.0, -2.0])
    assert metric(Metrics.mrr).compute(doc, response) == 0.5
    assert metric(Metrics.recall_at_k).compute(doc, response) == 0
    assert metric(Metrics.recall_at_k, k=2).compute(doc, response) == 1
    from nano_eval.tasks.lighteval import LogProbPMINorm, NormalizedMultiChoiceProbMetric, ProbabilityMetric

    [prob] = to_nano_metrics(ProbabilityMetric())
    assert prob.compute(doc, response) == pytest.approx(math.exp(-2.0))
    [share] = to_nano_metrics(NormalizedMultiChoiceProbMetric())
    assert share.compute(doc, response) == pytest.approx(math.exp(-2) / (math.exp(-1) + math.exp(-3) + math.exp(-2)))
    [pmi] = to_nano_metrics(ProbabilityMetric(LogProbPMINorm()))
    assert pmi.name == "prob_norm_pmi" and pmi.needs_unconditioned
    for member, why in [(Metrics.simpleqa_judge, "LLM judge"), (Metrics.bleurt, "neural model"),
                        (Metrics.gpqa_instruct_metric, "letter answers"), (Metrics.g_pass_at_k, "not ported")]:
        with pytest.raises(ValueError, match=f"metric `Metrics.{member.name}`: .*{why}"):
            to_nano_metrics(member)


# ---------------------------------------------------------------- templates


ROW = {"question": "what is the capital of france?", "choices": ["paris", "lyon."], "gold_idx": 0,
       "context": "france is a country", "instruction": "Answer the question."}


def mcq(language, formulation, row=ROW):
    return get_mcq_prompt_function(language, lambda line: line, formulation)(row, "t")


def test_multiple_choice_formulations_give_lightevals_formats():
    d = mcq(Language.ENGLISH, MCFFormulation())
    assert d.query == ("Answer the question.\nFrance is a country\nQuestion: What is the capital of france?\n"
                       " A. Paris\n B. Lyon.\nAnswer:")
    assert (d.choices, d.gold_index, d.unconditioned_query) == ([" A", " B"], [0], "Answer:")
    d = mcq(Language.ENGLISH, HybridFormulation())  # the same options; the answers themselves are scored
    assert d.query.endswith("Question: What is the capital of france?\n A. Paris\n B. Lyon.\nAnswer:")
    assert d.choices == [" Paris", " Lyon."]
    d = mcq(Language.FRENCH, CFFormulation(), {**ROW, "instruction": ""})
    assert d.query == "France is a country\nQuestion: What is the capital of france?\nRéponse:"
    assert d.choices == [" Paris", " Lyon."]
    d = mcq(Language.CHINESE, MCFFormulation("Numbers"), {"question": "一加一?", "choices": ["二", "三"], "gold_idx": 1})
    assert d.query == "问题：一加一？\n1。二\n2。三\n答案：" and d.choices == ["1", "2"]
    refused = get_mcq_prompt_function(Language.YORUBA, lambda line: line)
    assert "no prompt words for that language" in refused.unsupported_reason


def test_qa_boolq_copa_nli_continuation_and_hellaswag_templates():
    qa = get_qa_prompt_function(Language.ENGLISH, {"question": "q", "choices": "a"})({"q": "who?", "a": ["x", "y", "x"]},
                                                                                      "t")
    assert (qa.query, qa.choices, qa.gold_index) == ("Question: Who?\nAnswer:", [" X", " Y"], [0, 1])
    yes = get_boolq_prompt_function(Language.ENGLISH, lambda r: r, CFFormulation())(
        {"question": "is it", "answer": False, "context": "It is not."}, "t")
    assert (yes.query, yes.choices, yes.gold_index) == ("It is not.\nQuestion: Is it\nAnswer:", [" Yes", " No"], [1])
    copa = get_copa_prompt_function(Language.ENGLISH, lambda r: r, CFFormulation())(
        {"context": "The man fell.", "cause_effect": "effect", "continuations": ["He cried.", "the sky."],
         "gold_idx": 0}, "t")
    assert (copa.query, copa.choices) == ("The man fell therefore", [" he cried.", " the sky."])
    nli = get_nli_prompt_function(Language.ENGLISH, lambda r: r, ["entailment", "neutral", "contradiction"],
                                  CFFormulation())({"premise": "A dog runs.", "hypothesis": "An animal moves.",
                                                    "gold_idx": 2}, "t")
    assert (nli.query, nli.choices, nli.gold_index) == (
        "A dog runs right?", [" Yes, an animal moves", " Also, an animal moves", " No, an animal moves"], 2)
    hybrid = get_nli_prompt_function(Language.ENGLISH, lambda r: r, ["entailment", "neutral", "contradiction"],
                                     HybridFormulation())({"premise": "a dog runs", "hypothesis": "An animal moves.",
                                                           "gold_idx": 0}, "t")
    assert hybrid.query == "A dog runs\nQuestion: An animal moves True, False or Neither?\nAnswer:"
    assert hybrid.choices == [" True", " Neither", " False"]
    story = get_continuation_prompt_function(Language.ENGLISH, lambda r: r, CFFormulation())(
        {"context": "she opened the door", "continuations": ["and left", "The end."], "gold_idx": 0}, "t")
    assert (story.query, story.choices) == ("She opened the door", [" and left", " the end."])
    hs = get_hellaswag_prompt_function(Language.ENGLISH, lambda r: r, MCFFormulation())(
        {"activity_label": "cooking", "ctx_a": "A man cuts onions.", "ctx_b": "then he",
         "continuations": ["fries them.", "sings [title] loudly."], "gold_idx": 0}, "t")
    # endings continue "...Then he": lower-case first letter; "[title]" becomes a full stop
    assert hs.query == "Cooking:\nA man cuts onions. Then he\n A. fries them.\n B. sings. loudly.\nAnswer:"
    # translation: only punctuation comes from the languages, so it works for languages without prompt words too
    fr_en = get_translation_prompt_function(Language.FRENCH, Language.ENGLISH, {"source_text": "fr", "target_text": "en"},
                                            CFFormulation())({"fr": "le chat dort.", "en": "the cat sleeps."}, "t")
    assert (fr_en.query, fr_en.choices, fr_en.gold_index) == ("FR: Le chat dort. EN:", [" The cat sleeps."], [0])
    yo_zh = get_translation_prompt_function(Language.YORUBA, Language.CHINESE, lambda r: r, CFFormulation())(
        {"source_text": "ologbo?", "target_text": ["猫.", "一只猫."]}, "t")
    assert (yo_zh.query, yo_zh.choices) == ("YO: Ologbo? ZH:", [" 猫。", " 一只猫。"])


def test_multilingual_template_file_loads_and_scores(toy_backend, mirror):
    registry = Registry(MULTILINGUAL)
    names = registry.list_tasks()["custom"]
    assert len(names) == 15 and "quiz_fra_mcf:general_knowledge" in names and "quiz_yor_cf:general_knowledge" in names
    with pytest.raises(UnsupportedTaskError, match="quiz_yor_mcf.*Language.YORUBA: no prompt words"):
        load_tasks("custom|quiz_yor_mcf:general_knowledge|0", custom_tasks=MULTILINGUAL, data_dir=mirror)
    specs = ",".join(f"custom|{n}|{1 if n.startswith('quiz_fra') else 0}" for n in names if "_yor_" not in n)
    tasks = load_tasks(specs, custom_tasks=MULTILINGUAL, data_dir=mirror)
    results = Evaluator(toy_backend, tasks, EvalConfig(progress=False)).evaluate()
    assert not results.failed and len(results.tasks) == 12
    mcf = results.tasks["custom|quiz_fra_mcf:general_knowledge|1"]
    assert set(mcf.metrics) == {"acc", "acc_stderr"}  # letters: plain accuracy only (get_metrics_for_formulation)
    assert mcf.details[0]["context"] == ("Question: Combien font 1 et 1\n A. 2\n B. 3\n C. 8\nRéponse: A\n\n"
                                         "Question: Combien font 4 et 4\n A. 8\n B. 9\n C. 23\nRéponse:")
    assert {"acc_norm_token", "acc_norm"} <= set(results.tasks["custom|quiz_fra_cf:general_knowledge|1"].metrics)
    qa = results.tasks["custom|capitals_fra|0"]
    assert {"exact_match_fra_prefix", "f1_fra"} <= set(qa.metrics)
    # distinct references (before capitalising, as lighteval), each a gold
    assert qa.details[0]["choices"] == [" Paris", " Paris", " La ville de Paris"] and qa.details[0]["gold_index"] == [
        0, 1, 2]
