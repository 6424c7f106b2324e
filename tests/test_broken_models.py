"""No number from a broken model (issue 35, item 3).

A checkpoint whose config or weights make the model output NaN or inf (`rope_theta: 0`, a NaN weight) must not be
reported as a score (a NaN log-prob compares false and reads as accuracy 0.0): the task fails with one line naming
the task and the document, exit code 2 from the command line, a failed task in a sweep (the sweep goes on) and in the
training hook (training goes on). Configs that are broken by a field's value are refused at load, naming the field.
A nanotron checkpoint whose shard slices leave part of a tensor unwritten (torch.empty memory) is refused, and so is
one whose slice metadata lists more pairs than the tensor has elements (it used to hang the loader).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import time
from pathlib import Path

import pytest
import torch

from nano_eval.checkpoints.load import LoadOptions
from tests.test_hostile_files import copy_of, refused

pytestmark = pytest.mark.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parents[1]


# ---- nanotron shards: every element written exactly once ----------------------------------------------------------

def _rewrite_shard(ckpt: Path, pattern: str, edit) -> Path:
    """Rewrite the first shard file matching `pattern` under model/: edit(data, metadata) -> (data, metadata)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shard = next((ckpt / "model").rglob(pattern))
    with safe_open(str(shard), framework="pt") as f:
        data, meta = f.get_tensor("data"), dict(f.metadata())
    data, meta = edit(data, meta)
    save_file({"data": data.contiguous()}, str(shard), metadata=meta)
    return shard


def _rows(meta: dict) -> int:
    return int(meta["unsharded_shape"].strip("()").split(",")[0])


def test_nanotron_slices_that_leave_rows_unwritten_are_refused(genuine_checkpoints, tmp_path):
    """The shard keeps all its bytes, but its one slice pair now writes only the first 8 rows: the other rows of the
    merged embedding would be torch.empty memory (scores that change from one load to the next)."""
    ckpt = copy_of(genuine_checkpoints, "nanotron", tmp_path)

    def first_rows(data, meta):
        assert meta["local_global_slices_pairs"].count(";") == 0, meta  # the genuine tp=1 shard: one pair
        meta["local_global_slices_pairs"] = "0,8,None|None,None,None#0,8,None|None,None,None"
        return data, meta

    _rewrite_shard(ckpt, "*token_embedding*/*.safetensors", first_rows)
    text = refused(ckpt, LoadOptions())
    assert "token_embedding" in text and "uninitialised" in text, text
    assert re.search(r"do not cover its unsharded shape \(\d+, \d+\) exactly once \(its pieces hold", text), text


def test_nanotron_overlapping_slices_are_refused(genuine_checkpoints, tmp_path):
    """Two pairs write the same rows (and none writes the last ones): refused, not merged in file order."""
    ckpt = copy_of(genuine_checkpoints, "nanotron", tmp_path)

    def overlap(data, meta):
        rows = _rows(meta)
        meta["local_global_slices_pairs"] = (f"0,{rows - 1},None|None,None,None#0,{rows - 1},None|None,None,None;"
                                             f"0,1,None|None,None,None#0,1,None|None,None,None")
        return data, meta

    _rewrite_shard(ckpt, "*token_embedding*/*.safetensors", overlap)
    text = refused(ckpt, LoadOptions())
    assert re.search(r"its pieces at \[0, 0\] and \[0, 0\] overlap", text), text


@pytest.mark.parametrize("pairs, says", [(100_000, "100,000 slice pairs"), (1_500_000, "JSON values")])
def test_nanotron_millions_of_slice_pairs_are_refused_at_once(genuine_checkpoints, tmp_path, pairs, says):
    """More one-row pairs than the tensor has elements: refused before any pair is parsed (1.5 million used to keep
    the loader copying them one by one for minutes); that many already trips the header's JSON value bound."""
    ckpt = copy_of(genuine_checkpoints, "nanotron", tmp_path)

    def many(data, meta):
        meta["local_global_slices_pairs"] = ";".join(["0,1,None|None,None,None#0,1,None|None,None,None"] * pairs)
        return data, meta

    shard = _rewrite_shard(ckpt, "*token_embedding*/*.safetensors", many)
    start = time.perf_counter()
    text = refused(ckpt, LoadOptions(), within_s=30)
    assert says in text and shard.name in text, text
    assert time.perf_counter() - start < 10


def test_nanotron_shards_split_in_row_chunks_merge_exactly(genuine_checkpoints, tmp_path):
    """The same embedding saved as two chunk pairs, in reverse order (as nanotron's contiguous_chunks write): the
    check accepts an exact cover, and the model scores as the genuine one does."""
    from nano_eval.checkpoints.nanotron import read_nanotron_weights

    ckpt = copy_of(genuine_checkpoints, "nanotron", tmp_path)

    def two_chunks(data, meta):
        half = _rows(meta) // 2
        meta["local_global_slices_pairs"] = (f"{half},None,None|None,None,None#{half},None,None|None,None,None;"
                                             f"0,{half},None|None,None,None#0,{half},None|None,None,None")
        return data, meta

    _rewrite_shard(ckpt, "*token_embedding*/*.safetensors", two_chunks)
    name = "model.token_position_embeddings.pp_block.token_embedding.weight"
    assert torch.equal(read_nanotron_weights(ckpt)[name], read_nanotron_weights(genuine_checkpoints["nanotron"])[name])


# ---- configs refused by name at load ---------------------------------------------------------------------------------

def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("nano_eval: error:")]


def _edited_copy(toy_checkpoint, dest: Path, *, config=None, nan_weight: str | None = None) -> Path:
    """A copy of the toy checkpoint: config.json edited by config(dict), and/or the first entry of weight
    `nan_weight` set to NaN in model.safetensors."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(toy_checkpoint, dest)
    if config is not None:
        path = dest / "config.json"
        doc = json.loads(path.read_text())
        config(doc)
        path.write_text(json.dumps(doc))
    if nan_weight is not None:
        weights = load_file(str(dest / "model.safetensors"))
        weights[nan_weight].view(-1)[0] = math.nan
        save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def _set_rope_theta(value):
    def edit(doc):
        doc.setdefault("rope_parameters", {"rope_type": "default"})["rope_theta"] = value
        doc.pop("rope_theta", None)
    return edit


@pytest.mark.parametrize("field, edit", [
    ("rope_theta", _set_rope_theta(0.0)),
    ("rope_theta", _set_rope_theta(math.inf)),
    ("rms_norm_eps", lambda doc: doc.__setitem__("rms_norm_eps", -1e-5)),
])
def test_broken_config_value_is_refused_by_name(toy_checkpoint, tmp_path, capsys, field, edit):
    from nano_eval.cli import main as run_main

    ckpt = _edited_copy(toy_checkpoint, tmp_path / "ckpt", config=edit)
    code = run_main(["--checkpoint", str(ckpt), "--tasks", "demo|arithmetic|0", "--max-samples", "2",
                     "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2, err
    [line] = _error_lines(err)
    assert f"configuration's {field} is" in line and "Fix:" in line and "Traceback" not in err, line
    assert not (tmp_path / "out" / "results.json").exists()


# ---- NaN / inf scores: the task fails, never a score ----------------------------------------------------------------

TASKS = "demo|arithmetic|0,demo|arithmetic_gen|3,demo|arithmetic_ppl|0"  # loglikelihood, generation, rolling


def test_nan_weight_ends_the_task_with_one_line_naming_task_and_document(toy_checkpoint, tmp_path, capsys):
    """One NaN in the final norm's weight: every log-prob is NaN. Exit 2, one line naming the task and the
    document; results.json holds no score, only the failed tasks."""
    from nano_eval.cli import main as run_main

    ckpt = _edited_copy(toy_checkpoint, tmp_path / "ckpt", nan_weight="model.norm.weight")
    out = tmp_path / "out"
    code = run_main(["--checkpoint", str(ckpt), "--tasks", TASKS, "--max-samples", "2", "--output-dir", str(out)])
    err = capsys.readouterr().err
    assert code == 2, err
    [line] = _error_lines(err)
    assert "task demo|arithmetic|0, document 0: the log-probability of choice 0 is nan" in line, line
    assert "non-finite logits" in line and "Fix:" in line and "Traceback" not in err, line
    assert "2 more task(s): demo|arithmetic_gen|3, demo|arithmetic_ppl|0" in line, line
    doc = json.loads((out / "results.json").read_text())
    assert doc["results"] == {} and sorted(doc["failed_tasks"]) == sorted(TASKS.split(",")), doc


def _rope_theta_zero_backend(toy_checkpoint):
    """The toy model as transformers builds it from a config with rope_theta 0 (what the config check refuses at
    load; a library user can still build it): its rotary frequencies are infinite, its logits NaN."""
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    from nano_eval.backends.transformers import TransformersModel

    config = AutoConfig.from_pretrained(toy_checkpoint)
    config.rope_parameters["rope_theta"] = 0.0
    model = LlamaForCausalLM(config)
    model.load_state_dict(LlamaForCausalLM.from_pretrained(toy_checkpoint).state_dict())
    return TransformersModel(model.eval(), AutoTokenizer.from_pretrained(toy_checkpoint))


def test_rope_theta_zero_fails_loglikelihood_generation_and_rolling(toy_checkpoint, capsys):
    """Every request type: no task is scored, each names its first document; nothing is printed by the
    Evaluator (its caller reports the one line)."""
    from nano_eval.evaluator import EvalConfig, Evaluator
    from nano_eval.tasks import load_tasks

    backend = _rope_theta_zero_backend(toy_checkpoint)
    results = Evaluator(backend, load_tasks(TASKS), EvalConfig(max_samples=2, progress=False)).evaluate()
    assert results.tasks == {} and results.non_finite == TASKS.split(","), results.failed
    assert "document 0: the log-probability of choice 0 is nan" in results.failed["demo|arithmetic|0"]
    assert "document 0: the logits were NaN or infinite at generated token 0" in results.failed["demo|arithmetic_gen|3"]
    assert "document 0: the text's log-probability is nan" in results.failed["demo|arithmetic_ppl|0"]
    assert "nano_eval: error" not in capsys.readouterr().err


def test_argmax_of_non_finite_logits_is_the_non_finite_marker():
    from nano_eval.scoring import NON_FINITE, VocabShard, argmax_tokens

    inf, nan = math.inf, math.nan
    logits = torch.tensor([[0.0, 2.0, 1.0], [0.0, nan, 1.0], [inf, 0.0, 1.0], [-inf, 3.0, -inf], [-inf, -inf, -inf]])
    assert argmax_tokens(logits, VocabShard.of(3, 0, None, 1)).tolist() == [1, NON_FINITE, NON_FINITE, 1, NON_FINITE]


def test_sweep_fails_the_broken_checkpoints_tasks_and_scores_the_other(toy_checkpoint, tmp_path, capsys):
    from nano_eval.cli import main as run_main
    from nano_eval.sweep.table import read_table

    run, out = tmp_path / "run", tmp_path / "out"
    shutil.copytree(toy_checkpoint, run / "checkpoint-1")
    _edited_copy(toy_checkpoint, run / "checkpoint-2", nan_weight="model.norm.weight")
    code = run_main(["sweep", str(run), "--tasks", "demo|arithmetic|0", "--output-dir", str(out), "--max-samples",
                     "2", "--settle-s", "0", "--no-report"])
    err = capsys.readouterr().err
    assert code == 1, err  # the sweep's exit code for "checkpoints failed and were skipped"
    assert "checkpoint-2" in _error_lines(err)[-1] and "failed and were skipped" in _error_lines(err)[-1], err
    rows = read_table(out)
    scored = [r for r in rows if not r["error"]]
    assert {r["step"] for r in scored} == {1} and all(r["value"] not in ("", "nan") for r in scored), rows
    [failed] = [r for r in rows if r["error"]]
    assert failed["step"] == 2 and "task demo|arithmetic|0, document 0" in failed["error"], failed
    assert json.loads((out / "checkpoint-2" / "results.json").read_text())["results"] == {}


@pytest.mark.parametrize("fail_soft", [True, False])
def test_hook_records_the_failed_tasks_and_training_goes_on(toy_checkpoint, tmp_path, capsys, fail_soft):
    """In training, NaN scores are failed tasks (as a metric's error is): no score logged for them, the failure
    in the JSONL row and the results, one warning line; the hook never raises for them."""
    from nano_eval.tracking.jsonl import read_jsonl
    from nano_eval.training.config import EvalHookConfig
    from nano_eval.training.hook import EvalHook

    tasks = "demo|arithmetic|0,demo|arithmetic_ppl|0"
    config = EvalHookConfig(tasks=tasks, every_n_steps=1, max_samples=2, output_dir=tmp_path, wandb=False,
                            fail_soft=fail_soft, progress=False)
    with EvalHook(config, _rope_theta_zero_backend(toy_checkpoint)) as hook:
        results = hook.maybe_evaluate(1)
    assert results is not None and results.tasks == {} and sorted(results.failed) == sorted(tasks.split(","))
    [row] = read_jsonl(tmp_path / "eval_results.jsonl")
    assert row["results"] == {} and "document 0" in row["failed_tasks"]["demo|arithmetic|0"], row
    err = capsys.readouterr().err
    assert err.count("nano_eval: warning: step 1: task demo|") == 2 and "Traceback" not in err, err


# ---- Megatron torch_dist: every element of a loaded tensor saved exactly once ----------------------------------------

def test_torch_dist_chunks_that_leave_rows_unsaved_are_refused(genuine_checkpoints, toy_checkpoint, tmp_path):
    """The embedding's one chunk now declares only its first 8 rows: DCP would read those and leave the other rows
    as the freshly built model's random values."""
    from tests.test_hostile_files import _metadata, _save_metadata, options

    iter_dir = copy_of(genuine_checkpoints, "torch_dist", tmp_path)
    md = _metadata(iter_dir)
    key = "embedding.word_embeddings.weight"
    [chunk] = md.state_dict_metadata[key].chunks
    chunk.sizes = torch.Size([8, *chunk.sizes[1:]])
    _save_metadata(iter_dir, md)
    text = refused(iter_dir, options("torch_dist", toy_checkpoint))
    assert f"the chunks of {key} do not cover it exactly once: its pieces hold" in text, text


@pytest.mark.parametrize("name, value", [("rotary_base", 0), ("norm_epsilon", -1e-5)])
def test_megatron_args_that_give_nan_are_refused_by_name(genuine_checkpoints, name, value):
    """megatron-core would take rotary_base 0 for its default 10000 (`or 10000`), the converter would build a
    Llama with rope_theta 0: both refused, naming the argument."""
    from nano_eval.checkpoints.megatron_dist import read_dist_checkpoint
    from nano_eval.errors import NanoEvalError

    with pytest.raises(NanoEvalError, match=f"args set {name}={value}, but it must be a finite number"):
        read_dist_checkpoint(genuine_checkpoints["torch_dist"], overrides={name: value})


def test_cover_problem_accepts_exact_covers_only():
    from nano_eval.checkpoints.cover import cover_problem

    tp2_rows = [((0, 0), (4, 6)), ((4, 0), (4, 6))]
    tp2_cols = [((0, 3), (8, 3)), ((0, 0), (8, 3))]
    assert cover_problem((8, 6), tp2_rows) is None and cover_problem((8, 6), tp2_cols) is None
    assert cover_problem((), [((), ())]) is None  # a scalar
    assert "hold 24 elements" in cover_problem((8, 6), tp2_rows[:1])
    assert "overlap" in cover_problem((8, 6), [((0, 0), (4, 6)), ((3, 0), (1, 6)), ((5, 0), (3, 6))])
    assert "outside" in cover_problem((8, 6), [((0, 0), (9, 6))])
