"""A checkpoint written by nanotron's own `save_weights` at TP2 scores the same at TP1, TP2 and PP2, and through the
conversion to a transformers LlamaForCausalLM (nano_eval/checkpoints/nanotron.py).

nanotron's `load_weights` reshards TP shards on load (merge into the unsharded tensor, then cut this rank's slices).
Loading goes into a model built with a different seed, so a load that does nothing cannot pass; the reference is
the seed-0 model built directly at TP1, never saved.
"""

import pytest

pytest.importorskip("nanotron")

from tests.dist_utils import run_distributed  # noqa: E402
from tests.nanotron_worker import evaluate_checkpoint, save_and_evaluate_checkpoint  # noqa: E402

TASKS = "demo|arithmetic|0,demo|arithmetic_ppl|0"
MC, PPL = "demo|arithmetic|0", "demo|arithmetic_ppl|0"
EXACT = ("acc", "acc_norm", "acc_norm_token", "acc_norm_pmi")
LAYOUTS = {"tp2": (2, 1, 1), "tp1": (1, 1, 1), "pp2": (1, 2, 1)}


def _single(per_rank):
    assert all(r == per_rank[0] for r in per_rank), "ranks disagree on the results"
    return per_rank[0]


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("nanotron") / "checkpoint"


@pytest.fixture(scope="module")
def runs(toy_checkpoint, ckpt_dir):
    """Three spawned worlds: TP2 saves (seed 0) then loads into seed 1; TP1 and PP2 load into seed 1 (TP1 also
    scores the seed-0 reference and the seed-1 model before loading)."""
    tok, ckpt = str(toy_checkpoint), str(ckpt_dir)
    tp2 = _single(run_distributed(save_and_evaluate_checkpoint, 2, *LAYOUTS["tp2"], ckpt, tok, TASKS))
    out = {"tp2": tp2["loaded"]}
    tp1 = _single(run_distributed(evaluate_checkpoint, 1, *LAYOUTS["tp1"], ckpt, tok, TASKS, 1, 0))
    out["tp1"], out["reference"], out["unloaded"] = tp1["loaded"], tp1["reference"], tp1["unloaded"]
    out["pp2"] = _single(run_distributed(evaluate_checkpoint, 2, *LAYOUTS["pp2"], ckpt, tok, TASKS))["loaded"]
    out["transformers"] = _convert_and_evaluate(ckpt, tok)
    return out


def _convert_and_evaluate(ckpt: str, tokenizer_dir: str):
    """No process group, no nanotron model: read the shards into LlamaForCausalLM and score it."""
    from pathlib import Path

    import yaml
    from transformers import AutoTokenizer

    from nano_eval.backends.transformers import TransformersModel
    from nano_eval.checkpoints.nanotron import load_nanotron_llama_as_hf
    from tests.nanotron_worker import VOCAB, summarize
    from tests.toy_nanotron import ToyConfig

    model_config = ToyConfig(vocab_size=VOCAB).llama_config()
    (Path(ckpt) / "config.yaml").write_text(yaml.safe_dump({"model": {"model_config": model_config}}))  # as nanotron's
    hf = load_nanotron_llama_as_hf(ckpt)
    backend = TransformersModel(hf, AutoTokenizer.from_pretrained(tokenizer_dir))
    assert backend.max_length == model_config["max_position_embeddings"]
    return summarize(backend, TASKS, batch_tokens=4096, max_samples=12)


def test_checkpoint_is_nanotrons_layout(runs, ckpt_dir):
    """One safetensors file per TP shard (with its slice metadata), replicated weights written once, and the
    `checkpoint_metadata.json` nanotron's trainer writes."""
    from safetensors import safe_open

    assert (ckpt_dir / "checkpoint_metadata.json").is_file()
    qkv = ckpt_dir / "model" / "model" / "decoder" / "0" / "pp_block" / "attn" / "qkv_proj"
    shards = sorted(p.name for p in qkv.iterdir())
    assert shards == [f"model_weight_pp-rank-0-of-1_tp-rank-{r}-of-2.safetensors" for r in (0, 1)]
    with safe_open(qkv / shards[1], framework="pt") as f:
        assert f.get_tensor("data").shape == (64, 64)  # (q + k + v rows = 64 + 32 + 32) / tp
        # nanotron 0.4 under numpy 2 writes numpy scalar reprs; nano_eval.compat teaches load_weights to read them
        assert f.metadata()["unsharded_shape"].replace("np.int64(128)", "128") == "(128, 64)"
    norm = ckpt_dir / "model" / "model" / "decoder" / "0" / "pp_block" / "input_layernorm"
    assert sorted(p.name for p in norm.iterdir()) == ["model_weight.safetensors"]


@pytest.mark.parametrize("layout", [*LAYOUTS, "transformers"])
def test_loaded_checkpoint_matches_direct_model(runs, layout):
    ref, got = runs["reference"], runs[layout]
    assert set(got) == set(ref) == {MC, PPL}
    for key in ref:
        for name, value in ref[key]["metrics"].items():
            if name in EXACT:
                assert got[key]["metrics"][name] == value, (layout, key, name)
            else:
                assert got[key]["metrics"][name] == pytest.approx(value, rel=1e-6), (layout, key, name)
        for a, b in zip(ref[key]["logprobs"], got[key]["logprobs"], strict=True):
            if key == PPL:  # a document's total over hundreds of tokens
                assert b == pytest.approx(a, rel=1e-7), layout
            else:
                assert b == pytest.approx(a, abs=1e-5), layout


@pytest.mark.parametrize("key, tolerance", [(MC, 1e-2), (PPL, 1e-2)])
def test_model_before_loading_differs(runs, key, tolerance):
    """Without load_weights, the seed-1 model scores differently: the comparison above can fail."""
    ref, unloaded = runs["reference"][key]["logprobs"], runs["unloaded"][key]["logprobs"]
    pairs = [(x, y) for a, b in zip(ref, unloaded, strict=True) for x, y in zip(a, b, strict=True)]
    diff = max(abs(x - y) / max(1.0, abs(x)) for x, y in pairs)  # relative for the large perplexity totals
    assert diff > tolerance


def test_command_line_scores_the_nanotron_checkpoint(runs, ckpt_dir, toy_checkpoint, tmp_path):
    """`run.py --checkpoint <nanotron dir>` goes through the conversion and reports the reference model's scores."""
    import json

    from nano_eval.cli import main

    out = tmp_path / "out"
    assert main(["--checkpoint", str(ckpt_dir), "--tokenizer", str(toy_checkpoint), "--tasks", TASKS,
                 "--max-samples", "12", "--output-dir", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())["results"]
    assert results[MC]["acc"] == runs["reference"][MC]["metrics"]["acc"]
    assert results[PPL]["bits_per_byte"] == pytest.approx(runs["reference"][PPL]["metrics"]["bits_per_byte"], rel=1e-6)
