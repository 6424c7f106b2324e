"""`--backend megatron` on torch_dist checkpoints as Megatron-LM's training writes them
(tests/megatron_native_worker.py): with the distributed optimizer's sharded state (Megatron-LM's default save of a
`--use-distributed-optimizer` run), with the `singleton_local_shards` content-metadata flag, and MoE experts saved
from grouped GEMM (GroupedMLP, megatron-core <= 0.16) or in another expert-parallel size. One world of 2 ranks
saves each and loads it back on both ranks; the loaded model's logits equal the live model's. The slow set adds a
world of 4 (ep4)."""

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")

from tests.dist_utils import run_distributed  # noqa: E402

CASES = ("distributed optimizer (dp_reshardable)", "singleton_local_shards")


@pytest.fixture(scope="module")
def ranks(toy_checkpoint, tmp_path_factory):
    from tests import megatron_native_worker as worker

    return run_distributed(worker.all_paths, 2, str(toy_checkpoint), str(tmp_path_factory.mktemp("native")),
                           timeout=900)


@pytest.mark.parametrize("case", CASES)
def test_checkpoint_scores_like_the_live_model(ranks, case):
    for rank in ranks:
        got = rank[case]
        assert "error" not in got, got
        assert got["max_diff"] <= 1e-5, got
    if case.startswith("distributed optimizer"):  # the optimizer's state is there; the step moved the weights
        got = ranks[0][case]
        assert got["optimizer_entries"] > 0 and got["common_optimizer"] and got["moved"] > 1e-3, got


def _moe_case_names() -> list[str]:
    from tests.megatron_native_worker import moe_cases

    return [case[0] for case in moe_cases()]


@pytest.mark.parametrize("case", _moe_case_names())
def test_moe_experts_load_across_expert_layouts(ranks, case):
    """Grouped-GEMM experts (megatron-core <= 0.16's GroupedMLP: stacked weights, saved as megatron-core maps them to
    per-expert tensors; later releases' grouped experts need Transformer Engine, so there SequentialMLP experts
    saved at ep2) load into nano_eval's SequentialMLP, and an ep1 save with singleton_local_shards loads at ep2;
    both also at the other expert-parallel size: the same logits as the live model on every rank."""
    for rank in ranks:
        for ep, diff in rank[case].items():
            assert isinstance(diff, float) and diff <= 1e-5, (ep, diff)


@pytest.mark.slow
def test_moe_experts_load_from_and_into_ep4(toy_checkpoint, tmp_path):
    """A world of 4: SequentialMLP experts saved at ep4 load at ep4, ep2 and ep1; experts saved at ep1 (grouped GEMM
    where the release has GroupedMLP) load into SequentialMLP at ep4."""
    from tests import megatron_native_worker as worker

    for rank in run_distributed(worker.ep4_paths, 4, str(toy_checkpoint), str(tmp_path), timeout=900):
        for case, diffs in rank.items():
            for ep, diff in diffs.items():
                assert isinstance(diff, float) and diff <= 1e-5, (case, ep, diff)
