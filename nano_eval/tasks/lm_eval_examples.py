"""lm-evaluation-harness task YAMLs over nano_eval's bundled arithmetic data: a starting point for your own
`--lm-eval-include-path` folder, and the offline tasks the lm-eval benchmarks, profiler and tests run.

Each function returns one task config (a dict as lm-eval reads it from YAML); `write_include_dir` writes them as
`<task>.yaml` files. The data are `nano_eval/tasks/data/arithmetic.jsonl` (fields a, b, choices, label) and
`arithmetic_text.jsonl` (field text), read by lm-eval's `json` dataset builder, so nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import yaml

DATA = Path(__file__).resolve().parent / "data"
ARITHMETIC = DATA / "arithmetic.jsonl"
ARITHMETIC_TEXT = DATA / "arithmetic_text.jsonl"
QUESTION = "Question: {{a}} plus {{b}}\nAnswer:"

_AGGREGATION = {"acc": "mean", "acc_norm": "mean", "exact_match": "mean", "mcc": "matthews_corrcoef"}


def _metric(name: str) -> dict:
    return {"metric": name, "aggregation": _AGGREGATION[name], "higher_is_better": True}


def multiple_choice(name: str, prompt: str = QUESTION, metrics: tuple[str, ...] = ("acc", "acc_norm"),
                    few_shot: bool = True, **extra) -> dict:
    """A cloze multiple-choice task: `prompt` then each of the document's choices; few-shot examples from the same
    rows (the train split) when `few_shot`. `extra`: more config keys (e.g. fewshot_config)."""
    files = {"train": str(ARITHMETIC), "validation": str(ARITHMETIC)} if few_shot else {"validation": str(ARITHMETIC)}
    config = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": files},
              "output_type": "multiple_choice", "validation_split": "validation",
              "doc_to_text": prompt, "doc_to_choice": "{{choices}}", "doc_to_target": "label",
              "metric_list": [_metric(m) for m in metrics], "metadata": {"version": 1.0}}
    if few_shot:
        config["training_split"] = "train"
    return {**config, **extra}


def generation(name: str, max_gen_toks: int = 8, **generation_kwargs) -> dict:
    """A greedy generation task (stop at a newline) scored by exact match after two regex filters, as lm-eval's
    GSM8K: `strict-match` (the whole answer is a number) and `flexible-extract` (the last number in it).
    `generation_kwargs` override (e.g. do_sample=True, temperature=0.7: a task nano_eval refuses)."""
    return {"task": name, "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"train": str(ARITHMETIC), "test": str(ARITHMETIC)}},
            "output_type": "generate_until", "training_split": "train", "test_split": "test",
            "doc_to_text": QUESTION, "doc_to_target": "{{choices[label]}}",
            "generation_kwargs": {"until": ["\n"], "max_gen_toks": max_gen_toks, "do_sample": False,
                                  "temperature": 0.0, **generation_kwargs},
            "filter_list": [
                {"name": "strict-match", "filter": [{"function": "regex", "regex_pattern": r"^ ?(\d+)$"},
                                                    {"function": "take_first"}]},
                {"name": "flexible-extract", "filter": [{"function": "regex", "group_select": -1,
                                                         "regex_pattern": r"(\d+)"},
                                                        {"function": "take_first"}]}],
            "metric_list": [{**_metric("exact_match"), "ignore_case": True}], "metadata": {"version": 2.0}}


def rolling_perplexity(name: str) -> dict:
    """Whole-text log-likelihood over the model's windows (lm-eval's loglikelihood_rolling): word and byte
    perplexity, bits per byte."""
    return {"task": name, "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(ARITHMETIC_TEXT)}},
            "output_type": "loglikelihood_rolling", "test_split": "test", "doc_to_text": "",
            "doc_to_target": "{{text}}",
            "metric_list": [{"metric": "word_perplexity"}, {"metric": "byte_perplexity"},
                            {"metric": "bits_per_byte"}],
            "metadata": {"version": 1.0}}


def group(name: str, tasks: list[str], metric: str = "acc") -> dict:
    """A group of `tasks` whose `metric` is their mean weighted by size (lm-eval's aggregate_metric_list)."""
    return {"group": name, "task": list(tasks),
            "aggregate_metric_list": [{"metric": metric, "aggregation": "mean", "weight_by_size": True}],
            "metadata": {"version": 3.0}}


def write_include_dir(folder: Path, *configs: dict) -> Path:
    """Each config as `folder/<task or group>.yaml` (folder created); returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for config in configs:
        name = config.get("task", config.get("group"))
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return folder
