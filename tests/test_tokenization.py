"""Tokenisation like lm-evaluation-harness 0.4.13 (hf model) for tokenizers that add special tokens, both
`add_bos_token` settings (nano_eval.tokenization; checkpoints from tests/special_tokenizers.py).

lm-eval runs in-process on the same checkpoint folders: its own HFLM for token ids (loglikelihood splits, empty
contexts, rolling windows, generation prompts), and simple_evaluate on the demo arithmetic task + rolling
perplexity (scripts/parity_lm_eval.py) for request strings, log-probs and accuracies.
"""

from pathlib import Path

import pytest
import transformers

from nano_eval.checkpoints.hf import load_transformers
from nano_eval.cli import options
from nano_eval.engine import Engine
from nano_eval.errors import NanoEvalError
from nano_eval.tasks.requests import GreedyUntilRequest
from nano_eval.tokenization import Tokenization
from nano_eval.training.config import EvalHookConfig
from tests.script_loader import load_script
from tests.special_tokenizers import build_special_checkpoints

MAX_LENGTH = 16  # short, so that the rolling texts below span several windows
# (context, continuation): plain, trailing space moved to the continuation, empty context, text opening with "<s>"
PAIRS = [("Question: 3 plus 4\nAnswer:", " 7"), ("The dog runs ", "to the house."), ("", " blue"),
         ("", "<s> red"), ("<s>Question: 1 plus 1\nAnswer:", " 2")]
TEXTS = ["Question: 9 plus 8\nAnswer: 17\n\nQuestion: 2 plus 5\nAnswer: 7\n\nQuestion: 9 plus 7", "The cat",
         "<s>The dog eats food because the sun is red."]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return build_special_checkpoints(tmp_path_factory.mktemp("special_tok"))


def _lm_eval_tokens(folder: Path, add_bos_token: bool | None) -> dict:
    """What lm-eval's HFLM feeds its model, captured where it calls `_loglikelihood_tokens`."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=str(folder), add_bos_token=add_bos_token, max_length=MAX_LENGTH, device="cpu", batch_size=1)
    seen = []
    lm._loglikelihood_tokens = lambda requests, **kw: seen.extend(requests) or [(0.0, False)] * len(requests)
    lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS)], disable_tqdm=True)
    pairs = [(list(ctx), list(cont)) for _, ctx, cont in seen]
    rolling = []
    for i, text in enumerate(TEXTS):
        seen.clear()
        lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), i)], disable_tqdm=True)
        rolling.append([(list(ctx), list(cont)) for _, ctx, cont in seen])
    prompts = [lm.tok_batch_encode([text])[0][0].tolist() for text in TEXTS]
    return {"pairs": pairs, "rolling": rolling, "prompts": prompts}


def _nano_eval_tokens(folder: Path, add_bos_token: bool | None) -> dict:
    from nano_eval.engine import rolling_windows

    backend = load_transformers(str(folder), max_length=MAX_LENGTH)
    tokens = Engine(backend, progress=False, add_bos_token=add_bos_token).tokens
    rolling = [list(rolling_windows(tokens.context(t), tokens.prefix_id, MAX_LENGTH)) for t in TEXTS]
    return {"pairs": [tokens.pair(c, x) for c, x in PAIRS], "rolling": rolling,
            "prompts": [tokens.prompt(t) for t in TEXTS]}


@pytest.mark.parametrize("kind, add_bos_token", [("bos", None), ("bos", False), ("plain", True), ("plain", None),
                                                 ("bos_eos", True)])
def test_token_ids_match_lm_eval(checkpoints, kind, add_bos_token):
    if add_bos_token and int(transformers.__version__.split(".")[0]) < 5:
        # lm-eval forces BOS by loading the tokenizer with add_bos_token=True; transformers 4.x fast tokenizers then
        # also put BOS inside rolling windows' continuations (seen on 4.56), 5.x do not. The reference moves, not us.
        pytest.skip("lm-eval's forced-BOS token ids depend on transformers' major version; checked on transformers 5")
    nano = _nano_eval_tokens(checkpoints[kind], add_bos_token)
    lm = _lm_eval_tokens(checkpoints[kind], add_bos_token)
    assert nano == lm
    bos = 537  # "<s>": the first id after the toy vocabulary (checked below)
    assert load_transformers(str(checkpoints[kind])).tokenizer.bos_token_id == bos
    adds_bos = add_bos_token if add_bos_token is not None else kind != "plain"
    assert (nano["pairs"][0][0][0] == bos) == adds_bos
    assert all(bos not in cont for _, cont in nano["pairs"][:3])  # a continuation never holds a special token


def test_appended_eos_never_misaligns_continuations(checkpoints):
    """A tokenizer that appends EOS gets the same tokens as one that does not (lm-eval 0.4.13 by default keeps the
    EOS inside the context and drops the continuation's first token: shown here so the difference is deliberate)."""
    assert _nano_eval_tokens(checkpoints["bos_eos"], None) == _nano_eval_tokens(checkpoints["bos"], None)
    eos = 538
    ctx, cont = _lm_eval_tokens(checkpoints["bos_eos"], None)["pairs"][0]
    assert ctx[-1] == eos and cont[-1] == eos


def _parity_script():
    pytest.importorskip("lm_eval")
    return load_script("scripts/parity_lm_eval.py", "nano_eval_parity_lm_eval")


@pytest.mark.parametrize("add_bos_token", [None, False])
def test_scores_match_lm_eval_with_a_bos_tokenizer(checkpoints, tmp_path, add_bos_token):
    """Identical request strings, log-probs within 1e-4, identical acc / acc_norm, rolling perplexity."""
    parity = _parity_script()
    report = parity.run_parity(checkpoints["bos"], tasks=("arith", "ppl"), add_bos_token=add_bos_token,
                               arith_limit=40, ppl_limit=6, ppl_max_length=32, workdir=tmp_path, float64_check=False)
    assert report.ok, "\n" + report.table() + "\n" + "\n".join(report.notes)
    nano, _ = report.runs["arith"]
    first_context = nano.docs[0]["tokens"][0][0]
    assert (first_context[0] == 537) == (add_bos_token is None)
    assert {r.metric for r in report.rows} >= {"acc", "acc_norm", "per-choice loglikelihood", "bits_per_byte",
                                              "request strings (context, continuation)"}


@pytest.mark.slow
@pytest.mark.parametrize("kind, add_bos_token", [("plain", True), ("bos_eos", True), ("bos", True)])
def test_scores_match_lm_eval_forced_bos(checkpoints, tmp_path, kind, add_bos_token):
    parity = _parity_script()
    report = parity.run_parity(checkpoints[kind], tasks=("arith", "ppl"), add_bos_token=add_bos_token,
                               workdir=tmp_path, float64_check=False)
    assert report.ok, "\n" + report.table() + "\n" + "\n".join(report.notes)


def test_every_generation_config_eos_id_stops_generation(checkpoints):
    backend = load_transformers(str(checkpoints["bos"]))
    request = GreedyUntilRequest("t", 0, 0, "The dog", generation_size=6)
    engine = Engine(backend, progress=False)
    tokens = engine.run_greedy(engine.prepare_greedy([request]))[request.key].tokens
    assert tokens, "the model must generate something for this test"
    stop_at = tokens.index(tokens[-1])  # make the last generated token an EOS id: generation ends at its first use
    backend.model.generation_config.eos_token_id = [backend.tokenizer.eos_token_id, tokens[stop_at]]
    engine = Engine(backend, progress=False)
    assert engine.tokens.eos_ids == {backend.tokenizer.eos_token_id, tokens[stop_at]}
    result = engine.run_greedy(engine.prepare_greedy([request]))[request.key]
    assert result.tokens == tokens[:stop_at]
    import torch

    ids = torch.tensor([result.input_tokens])
    out = backend.model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=backend.tokenizer.pad_token_id)
    assert out[0, ids.shape[1]:].tolist()[:stop_at] == tokens[:stop_at]  # transformers stops there too


def test_add_bos_token_needs_a_bos_token():
    from nano_eval.toy import build_tokenizer

    tokenizer = build_tokenizer()  # EOS only
    assert tokenizer.bos_token_id is None
    assert Tokenization.of(tokenizer, None).prefix == Tokenization.of(tokenizer, False).prefix == ()
    assert Tokenization.of(tokenizer, None).prefix_id == tokenizer.eos_token_id
    with pytest.raises(NanoEvalError, match="no BOS token"):
        Tokenization.of(tokenizer, True)


def test_option_reaches_every_config():
    parser = options.Parser(command="t")
    options.add_model_options(parser)
    options.add_task_options(parser)
    options.add_run_options(parser)
    jobs = {flag: options.eval_job(parser.parse_args([flag] if flag else []), "demo|arithmetic|0")
            for flag in ("", "--add-bos-token", "--no-add-bos-token")}
    assert [j.eval.add_bos_token for j in jobs.values()] == [None, True, False]
    assert [j.config_section()["add_bos_token"] for j in jobs.values()] == [None, True, False]  # results.json
    from nano_eval.training.nanotron import parse_eval_section

    section = parse_eval_section({"tasks": "demo|arithmetic|0", "add_bos_token": False})  # nanotron YAML section
    assert section.hook.add_bos_token is False
    with pytest.raises(ValueError, match="add_bos_token"):
        EvalHookConfig(tasks="demo|arithmetic|0", add_bos_token="yes")


def test_training_hook_tokenises_with_its_setting(checkpoints, tmp_path):
    from nano_eval.training.hook import EvalHook

    backend = load_transformers(str(checkpoints["bos"]))
    prefixes = {}
    for setting in (None, False):
        config = EvalHookConfig(tasks="demo|arithmetic|0", max_samples=2, add_bos_token=setting,
                                output_dir=str(tmp_path / str(setting)))
        hook = EvalHook.for_transformers(config, backend.model, backend.tokenizer)
        prefixes[setting] = [e.engine.tokens.prefix for e in hook._evaluators]
        hook.close()
    assert prefixes == {None: [(537,)], False: [()]}
