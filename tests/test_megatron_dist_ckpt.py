"""torch_dist checkpoints (current Megatron-LM's default format) -> transformers, on CPU with real megatron-core.

The world of 4 ranks of tests/test_megatron.py (the `megatron_world` fixture) saves its live tp2 x dp2 GPTModel as
Megatron-LM writes it: legacy (mp_rank_XX) and torch_dist (`dist_checkpointing.save` of the real GPTModel's
sharded_state_dict through megatron-core's own save strategy and file writer), and its pp2 x dp2 model as
torch_dist. The files are the installed megatron-core's: the common state in `common.pt` (0.16), or as a
`common_state` entry inside the .distcp files (0.19). That world then loads the tp2 torch_dist checkpoint on every
rank, as run.py under torchrun does; the tests below load it in this process alone (a gloo world of 1 that the
loader creates and removes).
"""

import json
import pickle
import shutil

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")

import torch  # noqa: E402

from nano_eval.errors import NanoEvalError  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402
from tests.megatron_worker import state_digest  # noqa: E402
from tests.test_megatron import assert_same_scores  # noqa: E402

ITERATION = 100
ITER = f"iter_{ITERATION:07d}"


@pytest.fixture(scope="module")
def saved(megatron_world):
    root = megatron_world["root"]
    return {"root": root, "dist": root / "tp2", "legacy": root / "legacy",
            "ranks": [r["loaded"] for r in megatron_world["ranks"]]}


@pytest.fixture(scope="module")
def converted(saved):
    from nano_eval.checkpoints.megatron_legacy import load_megatron_llama_as_hf

    return load_megatron_llama_as_hf(saved["dist"] / ITER)


def test_checkpoint_is_written_as_megatron_lm_writes_it(saved):
    """The installed release's files: every rank's .distcp files, the index, metadata.json, and the common state as
    a common.pt file (up to megatron-core 0.18) or as the index's common_state entry (0.19)."""
    from nano_eval.checkpoints.megatron_dist import COMMON_STATE, read_metadata_safely
    from nano_eval.compat.megatron import release

    run = saved["dist"]
    assert (run / "latest_checkpointed_iteration.txt").read_text() == str(ITERATION)
    files = sorted(p.name for p in (run / ITER).iterdir())
    in_file = release().common_state == "common.pt"
    assert [f for f in files if not f.endswith(".distcp")] == [".metadata", *(["common.pt"] if in_file else []),
                                                               "metadata.json"]
    writers = {f.split("_")[2] for f in files if f.endswith(".distcp")}  # __<rank>_<n>.distcp
    assert {"0", "1"} <= writers <= {"0", "1", "2", "3"}  # the tp2 ranks of the main replica hold every shard
    assert json.loads((run / ITER / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    assert (COMMON_STATE in read_metadata_safely(run / ITER).state_dict_metadata) != in_file


def test_converter_reproduces_the_logical_weights(converted):
    """Megatron stacks layers, splits swiglu's linear_fc1 into two sharded halves and groups linear_qkv per query
    group; after megatron-core reshards TP2 -> TP1 and the legacy path un-fuses, every tensor is exact."""
    from tests.megatron_gpt import GPTConfig, logical_weights

    state = converted.state_dict()
    for name, expected in logical_weights(GPTConfig()).items():
        assert torch.equal(state[name], expected), name
    assert converted.config.num_key_value_heads == 2 and not converted.config.tie_word_embeddings


def test_loading_leaves_no_process_group_behind(converted):
    """This process had no process group: the loader's gloo world and Megatron's parallel_state are gone."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    assert not dist.is_initialized() and not ps.model_parallel_is_initialized()


def test_every_rank_of_a_running_world_loads_the_same_model(saved, converted):
    """Inside a world of 4 (torchrun), every rank loads it, keeps its process group and leaves parallel_state clean."""
    for rank in saved["ranks"]:
        assert rank["world"] == 4 and rank["parallel_state_clean"]
        assert rank["digest"] == state_digest(converted.state_dict())


def test_run_py_scores_the_iteration_folder(saved, toy_checkpoint, tmp_path):
    from nano_eval.cli import main

    assert main(["--checkpoint", str(saved["dist"] / ITER), "--tokenizer", str(toy_checkpoint),
                 "--tasks", "demo|arithmetic|0", "--max-samples", "8", "--output-dir", str(tmp_path),
                 "--device", "cpu"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["num_docs"]["demo|arithmetic|0"] == 8 and "acc" in results["results"]["demo|arithmetic|0"]


class _Touch:
    """A pickle that, if unpickled without an allow-list, creates a file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (type(self.path).touch, (self.path,))


def test_unsafe_or_incomplete_checkpoints_are_refused(saved, tmp_path):
    from nano_eval.checkpoints.megatron_legacy import load_megatron_llama_as_hf

    unsafe = tmp_path / ITER
    shutil.copytree(saved["dist"] / ITER, unsafe)
    marker = tmp_path / "pwned"
    (unsafe / ".metadata").write_bytes(pickle.dumps(_Touch(marker)))
    with pytest.raises(NanoEvalError, match="not allowed in a checkpoint"):
        load_megatron_llama_as_hf(unsafe)
    assert not marker.exists()

    shutil.copy(saved["dist"] / ITER / ".metadata", unsafe / ".metadata")
    if (unsafe / "common.pt").exists():  # megatron-core <= 0.18's common state
        (unsafe / "common.pt").unlink()
    else:  # 0.19's: an entry of the index (our own file: plain pickle may read and rewrite it)
        from nano_eval.checkpoints.megatron_dist import COMMON_STATE

        index = pickle.loads((unsafe / ".metadata").read_bytes())
        del index.state_dict_metadata[COMMON_STATE]
        (unsafe / ".metadata").write_bytes(pickle.dumps(index))
    with pytest.raises(NanoEvalError, match="has no common.pt and its index has no common_state"):
        load_megatron_llama_as_hf(unsafe)


def test_the_index_is_unpickled_once_by_the_allow_list(saved, monkeypatch):
    """torch.distributed.checkpoint never unpickles `.metadata` itself (a file swapped after our check could not
    slip through): with its pickle.load made to fail, the checkpoint loads all the same."""
    import torch.distributed.checkpoint.filesystem as dcp_fs

    from nano_eval.checkpoints.megatron_legacy import load_megatron_llama_as_hf

    def no_second_read(*args, **kwargs):
        raise AssertionError("torch.distributed.checkpoint unpickled .metadata itself")

    monkeypatch.setattr(dcp_fs.pickle, "load", no_second_read)
    model = load_megatron_llama_as_hf(saved["dist"] / ITER)
    assert model.config.num_hidden_layers > 0


def test_wrong_args_are_refused_with_a_fix(saved):
    """Non-Llama args stop before any model is built; args that do not match the tensors (4 query groups where
    the checkpoint has 2) make megatron-core's loader fail, reported with the folder and the fix, and the loader's
    process group is gone after the failure too."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from nano_eval.checkpoints.megatron_legacy import load_megatron_llama_as_hf

    with pytest.raises(NanoEvalError, match="not a Llama-style"):
        load_megatron_llama_as_hf(saved["dist"] / ITER, megatron_args={"swiglu": False})
    with pytest.raises(NanoEvalError, match="could not load it into the GPTModel.*megatron_args"):
        load_megatron_llama_as_hf(saved["dist"] / ITER, megatron_args={"num_query_groups": 4})
    assert not dist.is_initialized() and not ps.model_parallel_is_initialized()


def test_saved_pp2_converts_exactly(saved):
    """The world's pp2 x dp2 save: megatron-core reshards PP stages into the TP1/PP1 model, layers at their global
    numbers."""
    from nano_eval.checkpoints.megatron_legacy import load_megatron_llama_as_hf
    from tests.megatron_gpt import GPTConfig, logical_weights

    state = load_megatron_llama_as_hf(saved["root"] / "pp2" / ITER).state_dict()
    for name, tensor in logical_weights(GPTConfig()).items():
        assert torch.equal(state[name], tensor), name


@pytest.mark.parametrize("tp, pp, untie", [
    pytest.param(2, 2, True, marks=pytest.mark.slow),
    pytest.param(2, 1, False, marks=pytest.mark.slow),
], ids=["tp2xpp2", "tp2-tied"])
def test_other_layouts_convert_exactly(tmp_path, tp, pp, untie):
    """megatron-core reshards any TP x PP into the TP1/PP1 model: PP stages' layers land at their global numbers;
    tied embeddings give lm_head = the embedding."""
    from nano_eval.checkpoints.megatron_legacy import load_megatron_llama_as_hf
    from tests.megatron_worker import save_dist_layout
    from tests.megatron_gpt import GPTConfig, logical_weights

    run_distributed(save_dist_layout, tp * pp, str(tmp_path), tp, pp, untie, ITERATION, timeout=600)
    state = load_megatron_llama_as_hf(tmp_path / ITER).state_dict()
    expected = logical_weights(GPTConfig())
    if not untie:
        expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name


@pytest.mark.parametrize("name", ["torch_dist tp2 -> tp1", "torch_dist pp2 -> tp2", "torch_dist tp2 -> pp2",
                                  "legacy tp2 -> tp2"])
def test_native_backend_scores_a_checkpoint_in_another_layout_like_the_live_model(megatron_world, name):
    """`--backend megatron --tp T --pp P`: megatron-core's GPTModel built from the checkpoint's args in the world of
    4 (dp = 4 / (tp x pp)) scores exactly like the live tp2 model that was saved."""
    from tests.megatron_worker import NATIVE

    ranks = megatron_world["ranks"]
    live = ranks[0]["tp2"]["scores"]
    _, tp, pp = NATIVE[name]
    for rank in ranks:
        got = rank["native"][name]
        assert got["layout"] == {"world_size": 4, "dp": 4 // (tp * pp), "tp": tp, "pp": pp}
        assert_same_scores(live, got["scores"], name)


def test_native_backend_refuses_a_legacy_checkpoint_in_another_layout(megatron_world, toy_checkpoint):
    from nano_eval.checkpoints.megatron_native import load_native

    with pytest.raises(NanoEvalError, match="loads only in that layout.*--tp 2 --pp 1 --ep 1"):
        load_native(str(megatron_world["root"] / "legacy"), str(toy_checkpoint), tp=1, pp=1, ep=1,
                    dtype="float32", max_length=None, device="cpu")


def test_loading_again_in_another_layout_leaves_no_process_group_behind():
    """A sweep sets parallel_state up once per checkpoint: the groups of the previous one are destroyed, not only
    forgotten (megatron's destroy_model_parallel), so they do not pile up (on CPU/gloo 12 leftover layouts made
    scoring 2.4x slower; on GPUs each holds NCCL buffers). A group nano_eval did not make is left alone."""
    import torch.distributed as dist

    from nano_eval.compat.megatron import _process_groups, initialize_model_parallel_for_eval, reset_model_parallel

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        trainers = dist.new_group([0])  # someone else's group
        counts = []
        for _ in range(3):
            reset_model_parallel()
            initialize_model_parallel_for_eval(tp=1, pp=1, ep=1)
            counts.append(len(_process_groups()))
        reset_model_parallel()
        assert counts[0] > 2 and counts == [counts[0]] * 3, counts
        assert set(_process_groups()) == {dist.GroupMember.WORLD, trainers}  # before: 17 more per layout
    finally:
        dist.destroy_process_group()


def test_weights_the_model_has_no_place_for_are_refused(tmp_path):
    """A legacy shard holding a layer its args do not declare (args edited to fewer layers, say) would load the
    others and score without it; `_fill` names the extra weight instead. Extra state may come or go."""
    from nano_eval.checkpoints.megatron_native import _fill

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    state = dict(model.state_dict()) | {"0._extra_state": torch.zeros(1)}
    _fill(model, state, tmp_path / "model_optim_rng.pt")
    with pytest.raises(NanoEvalError, match=r"unexpected \['1.weight'\]"):
        _fill(model, state | {"1.weight": torch.zeros(2, 2)}, tmp_path / "model_optim_rng.pt")
    with pytest.raises(NanoEvalError, match=r"missing \['0.bias'\]"):
        _fill(model, {"0.weight": torch.zeros(2, 2)}, tmp_path / "model_optim_rng.pt")
