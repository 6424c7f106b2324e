"""Mixture-of-Experts under expert, tensor, pipeline and context parallelism: megatron-core's real MoE GPTModel
(local spec, SequentialMLP, 4 experts top-2; tests/megatron_moe.py) on CPU/gloo.

The reference is the same weights at ep1 x tp1 x pp1 (dp4) routing dropless. The layouts under test are built with a
training capacity factor of 1.0 (token dropping; the alltoall dispatcher also pads to capacity) and scored on 7
documents in small batches, so data-parallel ranks get different numbers of batches and generation steps: without
lockstep a rank would wait in its extra forward's MoE all-to-all until the process group's timeout, and with the
capacity factor a row's log-probs move by up to 1.5 with the rest of its batch. The default suite's stages (tp2 x ep2
and cp2 x ep2 with the alltoall dispatcher, the restore checks, `--backend megatron` at ep1) run in the `megatron_world`
fixture's processes (tests/megatron_moe_worker.py: moe_checks; also lm-eval tasks at ep1 and ep2); the slow set's
run in `megatron_slow_world` (slow_moe_checks: every other layout x dispatcher, the rolling-window task,
`--backend megatron` at tp2 x ep2, training runs with the hook).
"""

import json
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")

from tests.megatron_moe_worker import DEFAULT, LAYOUTS  # noqa: E402
from tests.test_megatron import assert_same_scores  # noqa: E402


def _single(per_rank, what):
    assert all(r == per_rank[0] for r in per_rank), f"ranks disagree on the {what}"
    return per_rank[0]


def _stages(world: dict) -> dict:
    """{stage: [per-rank results]} of a world's MoE stages, and the world's root."""
    ranks = [r["moe"] for r in world["ranks"]]
    return {stage: [r[stage] for r in ranks] for stage in ranks[0]} | {"root": world["root"]}


@pytest.fixture(scope="module")
def moe(megatron_world):
    """tests/megatron_moe_worker.py: moe_checks, the default suite's stages."""
    return _stages(megatron_world)


@pytest.fixture(scope="module")
def moe_world(megatron_slow_world):
    """tests/megatron_moe_worker.py: slow_moe_checks, the slow set's stages."""
    return _stages(megatron_slow_world)


def stages_of(request, stage: str) -> dict:
    return request.getfixturevalue("moe" if tuple(stage.split("/")) in DEFAULT else "moe_world")


def _stage_params(names) -> list:
    """"layout/dispatcher" of `names` x both dispatchers; those outside DEFAULT run in the slow set's world."""
    return [pytest.param(f"{name}/{d}", marks=() if (name, d) in DEFAULT else pytest.mark.slow)
            for name in names for d in ("alltoall", "allgather")]


ALL_STAGES = _stage_params(LAYOUTS)
EP_STAGES = _stage_params(name for name, (_, _, ep, _) in LAYOUTS.items() if ep > 1)


def _expected_layout(name: str) -> dict:
    tp, pp, ep, cp = LAYOUTS[name]
    layout = {"world_size": 4, "dp": 4 // (tp * pp), "tp": tp, "pp": pp} | ({"ep": ep} if ep > 1 else {})
    return layout | ({"cp_in_dp": cp} if cp > 1 else {}) | {"moe_routing": "dropless"}


def check_layout_scores(stages: dict, stage: str):
    """A layout's scores and generations = the ep1 dropless reference's, on every rank."""
    reference = _single([r["scores"] for r in stages["reference"]], "reference scores")
    per_rank, name = stages[stage], stage.split("/")[0]
    assert per_rank[0]["layout"] == _expected_layout(name)
    assert per_rank[0]["lockstep"] == (LAYOUTS[name][2] > 1)  # EP spans replicas; pp2 x cp2 has none
    assert_same_scores(reference, _single([r["scores"] for r in per_rank], "scores"), stage)
    ref = stages["reference"][0]
    counts = per_rank[0]["forwards"]
    print(f"{stage}: {counts['runs']} forwards per rank ({counts['scoring']} scoring), dummy scoring batches on "
          f"ranks {[r['forwards']['dummy'] for r in per_rank]}")
    for r in per_rank:
        assert r["generations"] == ref["generations"], stage  # KV cache, no stop sequence
        assert r["generations_stop"] == ref["generations_stop"], stage  # rows stop at different steps
        assert r["rerun_generations"] == ref["generations_stop"], stage  # the re-run path, in lockstep too
    assert len({len(tokens) for tokens, _ in ref["generations_stop"].values()}) > 2  # rows finish apart


@pytest.mark.parametrize("stage", ALL_STAGES)
def test_moe_layouts_score_like_ep1_dropless(request, stage):
    """Each layout x dispatcher (ep2, tp2 x ep2, pp2 x ep2, cp2 x ep2 with CP emulated, pp2 x cp2 without EP; the
    alltoall dispatcher padded to capacity), built with capacity factor 1.0: log-probs within 1e-5 of ep1 dropless,
    identical accuracies and generations (KV cache and re-run path), the same on every rank, and no hang. The slow
    set's stages add the rolling-window task."""
    check_layout_scores(stages_of(request, stage), stage)


@pytest.mark.parametrize("stage", ALL_STAGES)
def test_packed_rows_score_like_one_row_per_request_in_lockstep(request, stage):
    """Packed rows (tree mask, shared prefix, several documents per row: tests/packing_checks.py) in every MoE
    layout, in lockstep under EP (ranks run the same forwards, padded to one agreed shape): log-probs within 1e-5 of
    one row per request, the same greedy flags."""
    for r in stages_of(request, stage)[stage]:
        check = r["packing"]
        assert check["within_1e-5_plus_1e-6_relative"] and not check["greedy_mismatches"], (stage, check)
        assert check["packed"]["masked_rows"] > 0 and check["packed"]["positions"] < check["unpacked"]["positions"]


def test_reference_is_dense_path(moe):
    """ep1: the MoE layers' collectives stay inside a replica, so no lockstep; results.json's layout says dropless."""
    ref = moe["reference"][0]
    assert not ref["lockstep"] and ref["forwards"]["padded_tokens"] == ref["forwards"]["tokens"] == 0
    assert ref["layout"] == {"world_size": 4, "dp": 4, "tp": 1, "pp": 1, "moe_routing": "dropless"}


@pytest.mark.parametrize("stage", EP_STAGES)
def test_lockstep_runs_dummy_batches_on_uneven_shards(request, stage):
    """Every rank runs the same number of forwards (scoring, prefill, decoding steps); where a rank had fewer
    scoring batches than its data-parallel peers it ran dummy ones (every layout with EP), and no forward or KV cache
    of more than one row is over --batch-tokens. Prints the cost."""
    counts = [r["forwards"] for r in stages_of(request, stage)[stage]]
    assert len({c["runs"] for c in counts}) == 1 and len({c["scoring"] for c in counts}) == 1
    dummies = sum(c["dummy"] for c in counts)
    extra = sum(c["padded_tokens"] for c in counts) / max(1, sum(c["tokens"] for c in counts))
    seconds = max(c["dummy_s"] for c in counts) / max(c["scoring_s"] for c in counts)
    print(f"{stage}: {counts[0]['scoring']} scoring forwards per rank, {dummies} of them dummies over all ranks "
          f"({seconds:.1%} of the slowest rank's scoring time); lockstep padding +{extra:.1%} tokens; "
          f"{counts[0]['runs']} forwards in all per rank")
    if stage.startswith(("tp2xep2", "pp2xep2")):  # dp2 at 32 tokens: 3 batches on one rank, 2 on its peer
        assert 0 < dummies < len(counts)
    # --batch-tokens holds in lockstep: every forward and every KV cache within the budget (a lone row may exceed
    # it, as without lockstep)
    over = [shape for c in counts for shape in c["over"]]
    assert not over, f"lockstep forwards over the budget (rows, columns, budget): {over}"


def test_evaluation_leaves_training_state_exactly(moe):
    """ep2, alltoall with capacity factor, padding to capacity, aux loss and expert bias: a training forward after
    an evaluation equals one before bitwise; the routers' token counters, the aux-loss tracker and the capacity
    settings of configs and dispatchers are as training left them, also after a backend forward run with grad in
    training mode (which megatron-core counts and logs)."""
    for r in moe["restore"]:
        assert r["counted"]  # the training forward did count tokens and log the aux loss
        assert r["state_after_eval"] and r["state_after_grad_forward"] and r["training_forward_bitwise"]
        assert r["capacity"] == (1.0, True) and all(d == (True, 1.0) for d in r["dispatchers"])


def test_moe_torch_dist_checkpoint_saved(moe):
    """The ep2 MoE model saved by megatron-core's dist_checkpointing with Megatron-LM's MoE args (for
    `--backend megatron`): root / "moe_ep2" / iter_0000100."""
    from nano_eval.compat.megatron import release

    path = Path(moe["saved"][0]["path"])
    assert path == moe["root"] / "moe_ep2" / "iter_0000100"
    # the common state: common.pt up to megatron-core 0.18, inside the .distcp files from 0.19
    assert (path / ".metadata").is_file() and (path / "common.pt").is_file() == (release().common_state == "common.pt")
    assert (path.parent / "latest_checkpointed_iteration.txt").read_text() == "100"


def test_lm_eval_tasks_score_alike_at_ep2_in_lockstep_and_ep1(moe):
    """lm-eval's few-shot multiple choice, filtered greedy generation (KV cache) and rolling perplexity
    (tests/lm_eval_layouts.py) on the MoE model at ep2 (dp4; built with capacity factor 1.0, alltoall padded to
    capacity): scored dropless in lockstep over uneven shards, the same request strings
    (few-shot contexts: never the DP size's, lm-eval issue #1719), log-probs within 1e-5, the same generations,
    filtered answers and metrics as the ep1 dropless reference, on every rank."""
    from tests.lm_eval_layouts import assert_built_alone, assert_opinionated, assert_same_lm_eval, worst_logprob_gap

    ranks = moe["lm_eval"]
    if "skipped" in ranks[0]:
        pytest.skip(ranks[0]["skipped"])
    reference = _single([r["reference"] for r in ranks], "lm-eval reference scores")
    got = _single([r["ep2"] for r in ranks], "lm-eval ep2 scores")
    assert_opinionated(reference)
    assert_same_lm_eval(got, reference, "ep2")
    assert_built_alone(reference, ranks[0]["alone"])  # dp4's request strings are a world of one's
    assert ranks[0]["lockstep"] and ranks[0]["layout"] == _expected_layout("ep2")
    counts = [r["forwards"] for r in ranks]
    # 7 prompts over dp4 (2, 2, 2, 1): ranks decode different numbers of rows and steps, yet every rank runs the
    # same forwards (prefills, decoding steps, scoring batches), or one would wait alone in an MoE all-to-all
    assert len({row["doc_index"] for row in reference["lm_eval|nano_toy_gen|1"]["rows"]}) % 4
    assert len({c["runs"] for c in counts}) == 1 and len({c["scoring"] for c in counts}) == 1
    print(f"ep2 lm-eval: log-probs within {worst_logprob_gap(got, reference):.1e} of ep1 dropless; "
          f"{counts[0]['runs']} forwards per rank; stage {max(r['lm_eval'] for r in moe['seconds']):.0f} s")


# ---- the slow set: training with the hook ----------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", ["ep2", "pp2xep2"])
def test_moe_training_losses_are_bitwise_identical_with_the_hook(moe_world, name):
    """megatron-core DDP + distributed optimizer, dropout, aux loss, aux-loss-free expert bias, capacity factor with
    padding: every rank's training and validation losses are the same floats with and without the hook (which
    scores 7 documents in small batches: uneven shards, lockstep, dropless) at iterations 2 and 4; the trained
    model is saved as torch_dist with the hook's live scores next to it."""
    for rank in moe_world[f"training/{name}"]:
        assert rank["with"]["train"] == rank["without"]["train"] and rank["with"]["valid"] == rank["without"]["valid"]
        assert rank["evaluated_steps"] == [2, 4]
    last = [r for r in moe_world[f"training/{name}"] if r["without"]["train"][0]]
    assert last and all(len(r["without"]["train"]) == 4 for r in last)
    first = moe_world[f"training/{name}"][0]
    assert Path(first["saved"], ".metadata").is_file() and first["live_scores"]
    written = json.loads(Path(first["saved"]).parent.joinpath("live_scores.json").read_text())
    assert written["iteration"] == 4 and written["scores"].keys() == first["live_scores"].keys()
    written = json.loads((moe_world["root"] / f"hook_{name}" / "step_4" / "results.json").read_text())
    assert written["layout"] == _expected_layout(name)  # results.json says EP and dropless routing


@pytest.mark.parametrize("name", ["ep1", pytest.param("tp2xep2", marks=pytest.mark.slow)])
def test_native_backend_scores_the_ep2_checkpoint_like_the_live_model(request, name):
    """`--backend megatron`: the MoE model saved at ep2 (with a training capacity factor in its args), built by
    nano_eval from its args and resharded by megatron-core to ep1 (dp4) or tp2 x ep2, scores like the ep1 dropless
    reference (generations too, at tp2 x ep2 in lockstep)."""
    moe = request.getfixturevalue("moe" if name == "ep1" else "moe_world")
    reference = _single([r["scores"] for r in moe["reference"]], "reference scores")
    per_rank = moe[f"native/{name}"]
    assert_same_scores(reference, _single([r["scores"] for r in per_rank], "scores"), name)
    if name == "tp2xep2":
        assert per_rank[0]["layout"] == _expected_layout("tp2xep2")
        for r in per_rank:
            assert r["generations_stop"] == moe["reference"][0]["generations_stop"]
