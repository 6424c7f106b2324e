"""nano_eval in torchtitan 0.3.0's REAL Trainer (its Llama3 model, parallelize_llama, FSDP2, TP, pipeline_llm, DCP
checkpointer, data loader) on CPU/gloo, through hooks/torchtitan_eval.py under torchrun (tests/torchtitan_launch.py
installs the CPU test double tests/torchtitan_cpu.py first; tests/torchtitan_configs.py is a tiny Llama3 config).

For each layout (fsdp2 = dp_shard 2, tp2 with sequence parallelism, pp2, fsdp2 with `unshard: false`; slow: hsdp
2x2 on 4 ranks, fsdp2 x tp2, tp2 x pp2, cp2 folded into data parallelism):
- the run trains 4 steps, evaluates at steps 2 and 4 (the interval; the step-2 / step-4 checkpoints are saved there
  too: evaluated once per step) with consumed tokens = steps x global batch x sequence length;
- losses and gradient norms are bitwise equal to the same run without the hook;
- the live step-4 scores equal `run.py --checkpoint <dump>/checkpoint/step-4` (torchtitan's model class in one
  process, the DCP read through nano_eval's checked reader): every per-request log-prob within 1e-5, accuracies and
  generations identical; for fsdp2, `nano_eval sweep <dump>` instead, which finds step-2 and step-4 and scores
  each as the live model was scored at that step, with the same step and consumed tokens;
- 5 documents per task in 24-token batches give the data-parallel ranks different numbers of forwards (3 and 2 for
  demo|arithmetic: `test_the_batches_are_uneven`): with the FSDP2 parameters gathered once per evaluation (default)
  or sharded (`unshard: false`: lockstep), nothing hangs. (Sharded without lockstep, the run stops at gloo's
  timeout: "Application timeout caused pair closure".)

torchtitan is not in the global environment: these tests run in the venv of scripts/setup_torchtitan.sh (.ci/run
does, with NANO_EVAL_REQUIRE_TORCHTITAN=1 so they fail rather than skip; NANO_EVAL_TORCHTITAN_SLOW=1 adds the slow
layouts).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = os.environ.get("NANO_EVAL_REQUIRE_TORCHTITAN") == "1"
SLOW = os.environ.get("NANO_EVAL_TORCHTITAN_SLOW") == "1"
TASKS = "demo|arithmetic|0,demo|arithmetic_ppl|0,demo|arithmetic_gen|0"
STEPS, LOCAL_BATCH_ROWS, SEQ = 4, 2, 64
DOCS, BATCH_TOKENS = 5, 24
LOGGERS = ["--metrics.enable_wandb", "--metrics.enable_tensorboard"]  # torchtitan's own (W&B offline in the tests)
# name: (ranks, training batch degree (dp_replicate x dp_shard), torchtitan arguments, nano_eval options[, the model's
# config in tests/torchtitan_configs.py: tiny_llama if not given])
MOE = ["--parallelism.expert_parallel_degree", "2", "--debug.moe_force_load_balance"]
SWEPT = "fsdp2"  # its checkpoints are scored by `nano_eval sweep` on the run's dump folder (the others': run.py)
LAYOUTS = {
    "fsdp2": (2, 2, [], {}),
    "tp2": (2, 1, ["--parallelism.tensor_parallel_degree", "2"], {}),
    "pp2": (2, 1, ["--parallelism.pipeline_parallel_degree", "2", *LOGGERS], {}),
    "fsdp2_sharded": (2, 2, [], {"unshard": False}),
    # expert parallelism (all-to-all token dispatch over the two data-parallel ranks: lockstep), trained with
    # round-robin routing (torchtitan's debug option), scored with learned routing as the checkpoint is
    "ep2_qwen3_moe": (2, 2, MOE, {}, "tiny_qwen3_moe"),
}
SLOW_LAYOUTS = {
    "hsdp": (4, 4, ["--parallelism.data_parallel_replicate_degree", "2"], {}),
    "fsdp2_tp2": (4, 2, ["--parallelism.tensor_parallel_degree", "2"], {}),
    "tp2_pp2": (4, 1, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.pipeline_parallel_degree", "2"], {}),
    # torchtitan's CP with flex attention wants the sequence divisible by cp x 128
    "cp2": (2, 1, ["--parallelism.context_parallel_degree", "2", "--training.seq_len", "256"], {}),
    "ep2_deepseek_v3": (2, 2, MOE, {}, "tiny_deepseek_v3"),
}


def require_torchtitan():
    if importlib.util.find_spec("torchtitan") is not None:
        return
    reason = ("torchtitan is not installed here (the global environment has none). Run these tests in the venv of "
              "scripts/setup_torchtitan.sh (.ci/run does)")
    if REQUIRED:
        pytest.fail(f"NANO_EVAL_REQUIRE_TORCHTITAN=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A text dataset torchtitan's loader reads (jsonl, `text` field) and the toy tokenizer (600 ids)."""
    require_torchtitan()
    from nano_eval.toy import build_tokenizer, corpus

    root = tmp_path_factory.mktemp("torchtitan_assets")
    (root / "data").mkdir()
    with open(root / "data" / "train.jsonl", "w") as f:
        for line in corpus(n=400):
            f.write(json.dumps({"text": line}) + "\n")
    tokenizer = build_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(root / "tokenizer")
    return root


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra: dict | None = None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), WANDB_MODE="offline", WANDB_SILENT="true")
    env.update(extra or {})
    return env


def train(assets: Path, out: Path, nproc: int, args: list[str], evaluation: dict | None, timeout: int = 900,
          config: str = "tiny_llama") -> Path:
    """One torchtitan run of STEPS steps (checkpoints at steps 2 and 4) of tests/torchtitan_configs.py's `config`,
    with the hook when `evaluation` is given; every rank's losses in out/losses.rank<R>.jsonl."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={_port()}", str(ROOT / "tests" / "torchtitan_launch.py"),
               str(ROOT / "hooks" / "torchtitan_eval.py"), "--module", "tests.torchtitan_configs",
               "--config", config, "--dataloader.dataset_path", str(assets / "data"),
               "--hf_assets_path", str(assets / "tokenizer"), "--dump_folder", str(out), *args]
    if evaluation is not None:
        options = {"tasks": TASKS, "interval": 2, "max_samples": DOCS, "batch_tokens": BATCH_TOKENS, "write_details": True,
                   "fail_soft": False, "output_dir": str(out / "nano_eval"), **evaluation}
        (out / "eval.yaml").parent.mkdir(parents=True, exist_ok=True)
        (out / "eval.yaml").write_text(json.dumps(options))  # JSON is YAML
        command += ["--checkpoint.enable", "--nano-eval", str(out / "eval.yaml")]
    out.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(command, cwd=ROOT, env=_env({"NANO_EVAL_TEST_LOSSES": str(out / "losses")}),
                          capture_output=True, text=True, timeout=timeout)
    (out / "log.txt").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return out


def losses(out: Path) -> dict[int, list]:
    """{rank: [(step, loss, max_loss, grad_norm)]} of the ranks that log a loss (the last pipeline stage's)."""
    found = {}
    for path in sorted(out.glob("losses.rank*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        if any(r["loss"] != -1.0 for r in rows):  # pipeline stages without the loss log -1
            found[int(path.name.split("rank")[1].split(".")[0])] = [
                (r["step"], r["loss"], r["max_loss"], r["grad_norm"]) for r in rows]
    return found


def score_checkpoint(assets: Path, checkpoint: Path, out: Path, config: str = "tiny_llama") -> Path:
    """run.py on a torchtitan checkpoint folder, one process (the CPU double installed by the launcher)."""
    command = [sys.executable, str(ROOT / "tests" / "torchtitan_launch.py"), str(ROOT / "nano_eval" / "run.py"),
               "--checkpoint", str(checkpoint), "--tokenizer", str(assets / "tokenizer"),
               "--torchtitan-config", f"tests.torchtitan_configs:{config}", "--tasks", TASKS, "--max-samples", str(DOCS),
               "--output-dir", str(out)]
    done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return out


def sweep(assets: Path, run: Path, out: Path, config: str = "tiny_llama") -> Path:
    """`nano_eval sweep RUN` on a torchtitan dump folder (its checkpoint/step-N/ folders), one process."""
    command = [sys.executable, str(ROOT / "tests" / "torchtitan_launch.py"), str(ROOT / "nano_eval" / "run.py"), "sweep",
               str(run), "--tokenizer", str(assets / "tokenizer"), "--torchtitan-config",
               f"tests.torchtitan_configs:{config}", "--tasks", TASKS, "--max-samples", str(DOCS), "--output-dir", str(out)]
    done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return out


def details(folder: Path) -> dict[str, list[dict]]:
    return {p.name: [json.loads(line) for line in p.read_text().splitlines()]
            for p in sorted((folder / "details").glob("*.jsonl"))}


def assert_same_scores(live: Path, checkpoint: Path, tolerance: float = 1e-5) -> float:
    """Per-request log-probs within `tolerance` (absolute, or relative to the value), greedy flags, predictions and
    accuracies identical; returns the largest |difference|."""
    got, want = details(live), details(checkpoint)
    assert got.keys() == want.keys() and got, (got.keys(), want.keys())
    worst = 0.0
    for name in want:
        assert len(got[name]) == len(want[name]) == DOCS, name
        for a, b in zip(got[name], want[name]):
            assert a["context"] == b["context"] and a.get("predictions") == b.get("predictions"), (name, a, b)
            assert a["argmax_logits_eq_gold"] == b["argmax_logits_eq_gold"], name
            for x, y in zip(a["logprobs"], b["logprobs"]):
                worst = max(worst, abs(x - y))
                assert x == pytest.approx(y, rel=tolerance, abs=tolerance), (name, a["doc_index"], x, y)
    live_results = json.loads((live / "results.json").read_text())["results"]
    ckpt_results = json.loads((checkpoint / "results.json").read_text())["results"]
    for task, metrics in ckpt_results.items():
        for metric in ("acc", "exact_match"):
            if metric in metrics:
                assert live_results[task][metric] == metrics[metric], (task, metric)
    return worst


def run_layout(name: str, spec, assets: Path, root: Path) -> None:
    nproc, dp, args, evaluation, *model = spec
    config = model[0] if model else "tiny_llama"
    live = train(assets, root / f"{name}_hook", nproc, args, evaluation, config=config)
    plain = train(assets, root / f"{name}_plain", nproc, args, None, config=config)
    with_hook, without = losses(live), losses(plain)
    assert with_hook and with_hook == without, (with_hook, without)
    assert [step for step, *_ in next(iter(with_hook.values()))] == list(range(1, STEPS + 1))
    rows = [json.loads(line) for line in next(live.rglob("eval_results.jsonl")).read_text().splitlines()]
    seq = int(args[args.index("--training.seq_len") + 1]) if "--training.seq_len" in args else SEQ
    assert [(r["step"], r["consumed_tokens"]) for r in rows] == [(s, s * LOCAL_BATCH_ROWS * dp * seq) for s in (2, 4)]
    assert all("failed" not in r for r in rows), rows
    model_file = json.loads((live / "checkpoint" / "step-4" / "nano_eval_torchtitan.json").read_text())
    assert (model_file["module"], model_file["config"], model_file["step"]) == ("tests.torchtitan_configs",
                                                                                config, 4)
    if LOGGERS[0] in args:
        check_loggers(live, rows)
    if name == SWEPT:  # the run's dump folder swept: every saved step scored as the live model was at that step
        swept = sweep(assets, live, root / f"{name}_sweep", config)
        worst = max(assert_same_scores(live / "nano_eval" / f"step_{s}", swept / f"step-{s}") for s in (2, 4))
        done = [json.loads((swept / f"step-{s}" / "results.json").read_text()) for s in (2, 4)]
        assert [(r["step"], r["consumed_tokens"]) for r in done] == [(r["step"], r["consumed_tokens"]) for r in rows]
        assert {r["sweep"]["kind"] for r in done} == {"torchtitan"}
    else:
        checkpoint = score_checkpoint(assets, live / "checkpoint" / "step-4", root / f"{name}_ckpt", config)
        worst = assert_same_scores(live / "nano_eval" / "step_4", checkpoint)
    print(f"{name}: losses bitwise equal over {STEPS} steps; live vs checkpoint: max |logprob diff| {worst:.1e}")


def check_loggers(out: Path, rows: list[dict]) -> None:
    """The evaluations are in torchtitan's own W&B run (opened by its metrics processor on its logging rank, the
    last pipeline stage's first rank) at step= the training step, beside its losses, with n_tokens_seen, and in its
    TensorBoard folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.test_wandb import read_run

    (run_dir,) = {p.parent.parent for p in out.rglob("offline-run-*")}
    history, _ = read_run(run_dir)
    key = "eval/demo|arithmetic|0/acc"
    evaluated = [(r["_step"], r["n_tokens_seen"], r[key]) for r in history if key in r]
    assert evaluated == [(r["step"], r["consumed_tokens"], r["results"]["demo|arithmetic|0"]["acc"]) for r in rows]
    assert {r["_step"] for r in history if "loss_metrics/global_avg_loss" in r} == set(range(1, STEPS + 1))
    events = EventAccumulator(str(run_dir))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars(key)] == [(s, pytest.approx(a)) for s, _, a in evaluated]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_hook_in_torchtitan_trainer(name, assets, tmp_path):
    run_layout(name, LAYOUTS[name], assets, tmp_path)


@pytest.mark.parametrize("name", list(SLOW_LAYOUTS))
def test_hook_in_torchtitan_trainer_slow(name, assets, tmp_path):
    if not SLOW:
        pytest.skip("NANO_EVAL_TORCHTITAN_SLOW=1 runs the 4-rank layouts")
    run_layout(name, SLOW_LAYOUTS[name], assets, tmp_path)


# name: (ranks, the backend's `unshard`, torchtitan arguments[, config])
DECODE_LAYOUTS = {
    "fsdp2": (2, "auto", []),
    "fsdp2_sharded": (2, "false", []),  # FSDP2 all-gathers in every forward: lockstep
    "tp2": (2, "auto", ["--parallelism.tensor_parallel_degree", "2"]),  # sequence parallel (torchtitan's default)
    "pp2": (2, "auto", ["--parallelism.pipeline_parallel_degree", "2"]),
    # multi-latent attention (the cache holds the keys / values its module hands the kernel) and MoE under EP
    "ep2_deepseek_v3": (2, "auto", MOE, "tiny_deepseek_v3"),
}
SLOW_DECODE_LAYOUTS = {
    "tp2_no_sp": (2, "auto", ["--parallelism.tensor_parallel_degree", "2",
                              "--parallelism.no-enable-sequence-parallel"]),
    "tp2_pp2": (4, "auto", ["--parallelism.tensor_parallel_degree", "2", "--parallelism.pipeline_parallel_degree", "2"]),
    "cp2": (2, "auto", ["--parallelism.context_parallel_degree", "2", "--training.seq_len", "256"]),
    "ep2_qwen3_moe": (2, "auto", MOE, "tiny_qwen3_moe"),
}


def decode(assets: Path, out: Path, nproc: int, unshard: str, args: list[str], config: str = "tiny_llama") -> list[dict]:
    """tests/torchtitan_decode_worker.py in one layout: every rank's result."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={_port()}",
               str(ROOT / "tests" / "torchtitan_launch.py"), str(ROOT / "tests" / "torchtitan_decode_worker.py"),
               str(out / "results"), unshard, "--module", "tests.torchtitan_configs", "--config", config,
               "--dataloader.dataset_path", str(assets / "data"), "--hf_assets_path", str(assets / "tokenizer"),
               "--dump_folder", str(out / "dump"), *args]
    done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return [json.loads((out / "results" / f"rank{r}.json").read_text()) for r in range(nproc)]


def check_decoding(name: str, ranks: list[dict]) -> None:
    from tests.generation_checks import check_cost

    for gen in ranks:
        assert gen["decoder"], name
        assert gen["cached"] == gen["rerun"] and gen["cached_stop"] == gen["rerun_stop"], name
        assert not gen["divergences"] and not gen["divergences_stop"], name
        shared = gen["shared"]
        assert shared["cached"] == shared["rerun"], name
        # prompts with a common prefix: prefilled once, then each prompt's own suffix (never under lockstep, whose
        # forwards must have the same shapes on every data-parallel rank)
        assert shared["shared_prefix"] == 0 if gen["lockstep"] else shared["shared_prefix"] >= 8, (name, shared)
    lengths = {len(tokens) for g in ranks for tokens, _, _ in g["cached_stop"].values()}
    assert len(lengths) > 1, (name, lengths)  # rows finished at different steps
    cached, rerun = check_cost(ranks)
    print(f"{name}: generations equal; tokens through the embedding {cached} (cache) vs {rerun} (re-run)")


@pytest.mark.parametrize("name", list(DECODE_LAYOUTS))
def test_kv_cache_generations_equal_the_rerun_path(name, assets, tmp_path):
    """Greedy generation through nano_eval's torchtitan KV cache (nano_eval.backends.torchtitan_cache: torchtitan's
    own modules, its attention kernel swapped for the cache's) equals the re-run path token for token on a model
    built by torchtitan's real Trainer in each layout (fp32): rows of different prompt lengths (left padding), rows
    finishing at different steps (a stop sequence), prompts sharing a prefix prefilled once (padding in the middle
    of the rows); each prompt goes through the embedding once, the re-run path's prompt x answer tokens.
    Before: the torchtitan backend had no decoder and re-ran the prompt for every new token."""
    require_torchtitan()
    nproc, unshard, args, *config = DECODE_LAYOUTS[name]
    ranks = decode(assets, tmp_path, nproc, unshard, args, *config)
    assert ranks[0]["lockstep"] == (name in ("fsdp2_sharded", "ep2_deepseek_v3"))  # FSDP2 / EP collectives in forwards
    check_decoding(name, ranks)


@pytest.mark.parametrize("name", list(SLOW_DECODE_LAYOUTS))
def test_kv_cache_generations_equal_the_rerun_path_slow(name, assets, tmp_path):
    if not SLOW:
        pytest.skip("NANO_EVAL_TORCHTITAN_SLOW=1 runs these layouts")
    nproc, unshard, args, *config = SLOW_DECODE_LAYOUTS[name]
    check_decoding(name, decode(assets, tmp_path, nproc, unshard, args, *config))


def test_kv_cache_runs_compiled_blocks_eagerly(tmp_path):
    """With every block compiled as torchtitan's apply_compile does (fullgraph=True), the cache decodes with the
    blocks run eagerly (its shapes change at every step: dynamo would recompile until its limit, which fullgraph
    makes a hard failure, as it did before) and they are compiled again after; generations equal the re-run path's,
    which runs the compiled blocks."""
    require_torchtitan()
    command = [sys.executable, str(ROOT / "tests" / "torchtitan_launch.py"),
               str(ROOT / "tests" / "torchtitan_decode_worker.py"), "compiled", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    result = json.loads((tmp_path / "compiled.json").read_text())
    assert result["equal"] and result["still_compiled"], result
    assert result["graphs_while_decoding"] == 0 < result["rerun_graphs"], result


def test_the_batches_are_uneven(assets):
    """The evaluation above gives the two data-parallel ranks different numbers of demo|arithmetic forwards (the
    situation in which FSDP2's per-forward all-gathers hang without lockstep)."""
    import torch
    from transformers import AutoTokenizer

    from nano_eval.data import GenDistributedSampler
    from nano_eval.engine import BatchingConfig
    from nano_eval.evaluator import EvalConfig, Evaluator
    from nano_eval.parallel import ParallelLayout
    from nano_eval.tasks import load_tasks

    class Shape:  # what the Evaluator reads of a backend to cut batches
        layout, max_length, module, vocab_size = ParallelLayout(), SEQ, torch.nn.Linear(1, 1), 600
        tokenizer = AutoTokenizer.from_pretrained(assets / "tokenizer")

    evaluator = Evaluator(Shape(), load_tasks("demo|arithmetic|0"),
                          EvalConfig(max_samples=DOCS, batching=BatchingConfig(max_batch_tokens=BATCH_TOKENS)))
    (dataset,) = evaluator.datasets.values()
    counts = [len(list(dataset.splits_iterator(list(GenDistributedSampler(dataset, 2, rank)), BATCH_TOKENS, 512)))
              for rank in (0, 1)]
    assert counts[0] != counts[1], counts


def test_cpu_attention_double_matches_flex_attention():
    """The CPU double's attention (training forwards only: torch has no CPU backward for flex attention) equals
    eager flex_attention on a packed-document mask."""
    require_torchtitan()
    from tests.torchtitan_cpu import check_double

    assert check_double() < 1e-5


def test_options_file_errors(tmp_path):
    require_torchtitan()
    from nano_eval.errors import NanoEvalError
    from nano_eval.training.torchtitan import parse_options, read_options

    path = tmp_path / "eval.yaml"
    path.write_text("nano_eval:\n  tasks: demo|arithmetic|0\n  interval: 5\n  unshard: false\n")
    options = read_options(path)
    assert (options.hook.every_n_steps, options.unshard, options.on_save) == (5, False, True)
    assert options.hook.wandb_log_step and options.hook.tokens_key == "n_tokens_seen"
    with pytest.raises(NanoEvalError, match="intervall.*did you mean interval"):
        parse_options({"tasks": "demo|arithmetic|0", "intervall": 5})
    with pytest.raises(NanoEvalError, match="publish_rank"):
        parse_options({"tasks": "demo|arithmetic|0", "publish_rank": 1})
    with pytest.raises(NanoEvalError, match="unshard"):
        parse_options({"tasks": "demo|arithmetic|0", "unshard": "sometimes"})
    assert parse_options({"enabled": False}) is None


def test_checkpoint_model_names_are_checked(tmp_path):
    """The model file in a checkpoint is untrusted: a module outside torchtitan's models is not imported from it;
    without it (or --torchtitan-config) the error says what to pass; run.py needs --tokenizer."""
    require_torchtitan()
    from nano_eval.checkpoints.torchtitan import MODEL_FILE, is_torchtitan_checkpoint, model_names
    from nano_eval.checkpoints.untrusted import CheckpointFileError, Folder
    from nano_eval.errors import NanoEvalError

    folder = tmp_path / "step-3"
    folder.mkdir()
    (folder / ".metadata").write_bytes(b"")
    assert is_torchtitan_checkpoint(folder)
    with pytest.raises(CheckpointFileError, match="--torchtitan-config MODULE:CONFIG"):
        model_names(Folder(folder).check(), None)
    (folder / MODEL_FILE).write_text(json.dumps({"module": "os", "config": "system"}))
    with pytest.raises(CheckpointFileError, match="not one of torchtitan's own models"):
        model_names(Folder(folder).check(), None)
    (folder / MODEL_FILE).write_text(json.dumps({"module": "llama3", "config": "llama3_8b"}))
    assert model_names(Folder(folder).check(), None)[:2] == ("llama3", "llama3_8b")
    assert model_names(Folder(folder).check(), "tests.torchtitan_configs:tiny_llama")[:2] == (
        "tests.torchtitan_configs", "tiny_llama")
    with pytest.raises(NanoEvalError, match="MODULE:CONFIG"):
        model_names(Folder(folder).check(), "os.system")
    (folder / "common.pt").write_bytes(b"")  # Megatron's torch_dist folder
    assert not is_torchtitan_checkpoint(folder)


def test_unsharded_parameters_restore_fsdp_settings():
    """UnshardedParameters on a real FSDP2 model (a 1-process gloo world): parameters gathered inside, each unit's
    reshard-after-forward setting and sharded parameters back after; unsharded_bytes counts the gathered size."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from nano_eval.compat.torchtitan import UnshardedParameters, unsharded_bytes

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        fully_shard(model[0], mesh=mesh, reshard_after_forward=True,
                    mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        fully_shard(model, mesh=mesh, reshard_after_forward=False,
                    mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        assert unsharded_bytes([model]) == (72 + 36) * 2  # gathered in the forward dtype (bf16), fp32 sharded
        groups = [g for m in (model[0], model) for g in m._get_fsdp_state()._fsdp_param_groups]
        before = [g.post_forward_mesh_info for g in groups]
        sharded = [p for p in model.parameters()]
        with UnshardedParameters([model]).applied():
            assert all(g.is_unsharded for g in groups)
            assert all(g.post_forward_mesh_info is None for g in groups)
            with torch.no_grad():
                model(torch.ones(2, 8, dtype=torch.bfloat16))
            assert all(g.is_unsharded for g in groups)  # no reshard after the forward
        assert [g.post_forward_mesh_info for g in groups] == before
        assert not any(g.is_unsharded for g in groups)
        assert [p for p in model.parameters()] == sharded
    finally:
        if own:
            dist.destroy_process_group()


def test_kv_cache_refuses_what_it_cannot_serve_exactly():
    """compat.torchtitan.cache_unsupported, on models built (on the meta device) from torchtitan's own configs: the
    tests' Llama3, Qwen3 MoE and DeepSeek-V3 decode from the cache; gpt-oss (sliding windows and sinks, its own
    masks) and a varlen sliding window re-run the prompt, each with its reason. (Qwen3.5's linear attention needs the
    `fla` package, not installed here; its attention is not GQA, so it is refused the same way.)"""
    require_torchtitan()
    import dataclasses

    import torch
    from torchtitan.models import gpt_oss
    from torchtitan.models.common.attention import VarlenAttention

    import tests.torchtitan_configs as configs
    from nano_eval.compat.torchtitan import cache_unsupported

    def built(config):
        with torch.device("meta"):
            return config.build()

    for spec in (configs.tiny_llama_model(), configs.tiny_qwen3_moe_model(), configs.tiny_deepseek_v3_model()):
        assert cache_unsupported(built(spec.model)) is None, spec.name
    assert "its own attention masks" in cache_unsupported(built(gpt_oss.model_registry("debugmodel").model))
    windowed = configs.tiny_llama_model().model
    for layer in windowed.layers:
        layer.attention = dataclasses.replace(layer.attention,
                                              inner_attention=VarlenAttention.Config(window_size=(8, 0)))
    assert "attention window (8, 0)" in cache_unsupported(built(windowed))
