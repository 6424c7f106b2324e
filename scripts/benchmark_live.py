"""The live model's evaluation cost: nanotron and megatron-core against the transformers path and lm-eval's `hf`.

    python scripts/benchmark_live.py [--limit 24] [--reps 2] [--cases "hellaswag 0-shot,..."] [--paths ...]
    python scripts/benchmark_live.py --quick        # 6 documents, one repetition, two cases

One model, SmolLM2-135M-Instruct (see scripts/suite_vs_lm_eval.py: its GGUF dequantized to float32; else the toy
model), loaded into every path, each in a process of its own (the CPU doubles below patch process-wide state):
  transformers  nano_eval's reference path: TransformersModel, packed rows (a document's context once, shared
                few-shot prefixes, several documents per row), output layer on scored positions
  unpacked      the same with one row per request (BatchingConfig(packing=False)): what the live backends ran before
  nanotron      nanotron 0.4's LlamaForTraining (built by nanotron's build_model, tp1) behind NanotronModel
  megatron      megatron-core's GPTModel (local layer spec, tp1) behind MegatronModel
  lm-eval       lm-evaluation-harness 0.4.13's `hf` model (HFLM on the transformers model, best of --lm-batch-sizes),
                its own task YAMLs on the same rows (scripts/benchmark.py prepares both)
For every case and path: seconds per evaluation (Evaluator.evaluate / simple_evaluate, model loaded, tasks built once
for nano_eval as in the training hook), token positions given to the model (counted at its embedding: rows x
columns, padding included), output-layer positions (rows the output projection computed), and accuracies per
document, which must be equal on every path (else exit 1). Repetitions are interleaved (every path once, then every
path again) and medians reported: the machine may be shared, so times are noisy; positions are exact.
In-loop cost (--train-steps N, default 4): nanotron's and megatron-core's own training step (forward, backward, AdamW;
sequence --train-seq, micro-batch 1) timed on the same model, and the evaluation's share of training time at
--interval steps between evaluations: eval / (interval x step + eval).

On a CPU machine nanotron runs with the repository's flash-attn TEST DOUBLE (tests/nanotron_cpu.py) and megatron-core
with its CUDA-call double (tests/megatron_cpu.py): nanotron's times are then the double's, no speed reference (its
positions are). nanotron 0.4's Llama has no rope_theta setting (its rotary base is flash-attn's default, 10000):
the benchmark sets SmolLM2's 100000 on each layer's rotary module after building, so scores can be compared.
On a GPU (scripts/gpu_check.sh runs --quick) every path runs on CUDA with the real kernels, in bfloat16 by default
(flash-attn takes no float32): accuracies may then part on near ties, which is reported, not failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

PATHS = ("transformers", "unpacked", "nanotron", "megatron", "lm-eval")
CASES = ("hellaswag 0-shot", "hellaswag 5-shot", "arc_easy 5-shot", "mmlu anatomy 5-shot")


def case_pairs(name: str):
    """A case's suite_vs_lm_eval.Pair (nano_eval's lighteval task, lm-eval's YAML, few-shot count)."""
    from suite_vs_lm_eval import ACC, Pair

    return {"hellaswag 0-shot": Pair("hellaswag", "hellaswag/hellaswag.yaml"),
            "hellaswag 5-shot": Pair("hellaswag", "hellaswag/hellaswag.yaml", shots=5),
            "arc_easy 5-shot": Pair("arc:easy", "arc/arc_easy.yaml", shots=5),
            "mmlu anatomy 5-shot": Pair("mmlu_mc:anatomy", "mmlu/default/mmlu_anatomy.yaml", ACC, shots=5)}[name]


# ---- weights: SmolLM2's transformers state dict in nanotron's and megatron-core's names -----------------------


def half_to_interleaved(w, heads: int):
    """q / k rows from transformers' rotate-half order to interleaved pairs (nanotron 0.4's rotary)."""
    d = w.shape[0] // heads
    return w.view(heads, 2, d // 2, -1).transpose(1, 2).reshape(w.shape)


def nanotron_state(hf: dict, cfg) -> dict:
    """LlamaForTraining's names (tp1): fused qkv (q / k interleaved), fused gate_up, tied lm_head."""
    import torch

    out = {"model.token_position_embeddings.pp_block.token_embedding.weight": hf["model.embed_tokens.weight"],
           "model.final_layer_norm.pp_block.weight": hf["model.norm.weight"],
           "model.lm_head.pp_block.weight": hf.get("lm_head.weight", hf["model.embed_tokens.weight"])}
    for i in range(cfg.num_hidden_layers):
        s, d = f"model.layers.{i}.", f"model.decoder.{i}.pp_block."
        q = half_to_interleaved(hf[s + "self_attn.q_proj.weight"], cfg.num_attention_heads)
        k = half_to_interleaved(hf[s + "self_attn.k_proj.weight"], cfg.num_key_value_heads)
        out |= {d + "attn.qkv_proj.weight": torch.cat([q, k, hf[s + "self_attn.v_proj.weight"]]),
                d + "attn.o_proj.weight": hf[s + "self_attn.o_proj.weight"],
                d + "mlp.gate_up_proj.weight": torch.cat([hf[s + "mlp.gate_proj.weight"], hf[s + "mlp.up_proj.weight"]]),
                d + "mlp.down_proj.weight": hf[s + "mlp.down_proj.weight"],
                d + "input_layernorm.weight": hf[s + "input_layernorm.weight"],
                d + "post_attention_layernorm.weight": hf[s + "post_attention_layernorm.weight"]}
    return out


def megatron_state(hf: dict, cfg) -> dict:
    """GPTModel's local-spec names (tp1; tests/megatron_gpt.py's mapping: linear_qkv grouped per query group, linear_fc1
    = [gate | up]), output_layer tied to the embedding."""
    from tests.megatron_gpt import GPTConfig, megatron_shard

    shape = GPTConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.intermediate_size,
                      num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_key_value_heads,
                      num_layers=cfg.num_hidden_layers)
    return megatron_shard({"lm_head.weight": hf["model.embed_tokens.weight"], **hf}, shape, 0, 1)


# ---- one path, in its own process --------------------------------------------------------------------------


def init_world() -> None:
    """A torch.distributed world of one (gloo), as the frameworks' layouts need."""
    import torch.distributed as dist

    from tests.dist_utils import free_port

    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
        dist.init_process_group("gloo", rank=0, world_size=1)


def build_path(path: str, checkpoint: str, dtype: str = "float32"):
    """(backend or HF model, embedding module, output-layer module, training step or None) of one path."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    hf_model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="sdpa").eval()
    cfg = hf_model.config
    if torch.cuda.is_available():
        hf_model = hf_model.to("cuda", getattr(torch, dtype))
    if path in ("transformers", "unpacked", "lm-eval"):
        from nano_eval.backends.transformers import TransformersModel

        target = hf_model if path == "lm-eval" else TransformersModel(hf_model, tokenizer)
        return target, hf_model.get_input_embeddings(), hf_model.get_output_embeddings(), None
    hf = {k: v.detach().float().cpu().clone() for k, v in hf_model.state_dict().items()}
    del hf_model
    init_world()
    if path == "nanotron":
        return build_nanotron(cfg, hf, tokenizer, getattr(torch, dtype))
    return build_megatron(cfg, hf, tokenizer, getattr(torch, dtype))


def build_nanotron(cfg, hf: dict, tokenizer, dtype):
    import torch

    if not torch.cuda.is_available():
        from tests.nanotron_cpu import install  # TEST DOUBLE for flash-attn's CUDA kernels (module docstring)

        install()
    from nanotron.config import LlamaConfig, ParallelismArgs
    from nanotron.models import build_model
    from nanotron.models.llama import LlamaForTraining
    from nanotron.parallel.tensor_parallel.enum import TensorParallelLinearMode

    from nano_eval.backends.nanotron import NanotronModel
    from nano_eval.compat.nanotron import cpu_parallel_context

    config = LlamaConfig(
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, hidden_act="silu", hidden_size=cfg.hidden_size,
        initializer_range=0.02, intermediate_size=cfg.intermediate_size, max_position_embeddings=2048,
        num_attention_heads=cfg.num_attention_heads, num_hidden_layers=cfg.num_hidden_layers,
        num_key_value_heads=cfg.num_key_value_heads, pad_token_id=None, pretraining_tp=1, rms_norm_eps=cfg.rms_norm_eps,
        rope_scaling=None, tie_word_embeddings=True, use_cache=True, vocab_size=cfg.vocab_size)
    pc = cpu_parallel_context(tp=1, pp=1, dp=1)
    parallel = ParallelismArgs(dp=1, pp=1, tp=1, tp_mode=TensorParallelLinearMode.ALL_REDUCE,
                               tp_linear_async_communication=False)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(model_builder=lambda: LlamaForTraining(config=config, parallel_context=pc,
                                                                parallel_config=parallel, random_states=None),
                        parallel_context=pc, dtype=dtype, device=device)
    missing = model.load_state_dict(nanotron_state(hf, config), strict=False)
    assert not missing.missing_keys, missing.missing_keys
    theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    for module in model.modules():  # nanotron 0.4 has no rope_theta: SmolLM2's base on every rotary (docstring)
        if hasattr(module, "flash_rotary_embedding"):
            rotary = module.flash_rotary_embedding
            rotary.base = theta
            rotary.inv_freq = rotary._compute_inv_freq(device=device)
            rotary._seq_len_cached = 0
            module.rotary_embedding.theta = theta
    backend = NanotronModel(model, pc, tokenizer, max_length=2048, device=device)
    embedding = model.model.token_position_embeddings.pp_block.token_embedding
    head = model.model.lm_head.pp_block
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)

    def train_step(ids):
        model.train()
        mask = torch.ones_like(ids, dtype=torch.bool)
        loss = model(input_ids=ids[:, :-1], input_mask=mask[:, :-1], label_ids=ids[:, 1:], label_mask=mask[:, 1:])
        loss["loss"].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return backend, embedding, head, train_step


def build_megatron(cfg, hf: dict, tokenizer, dtype):
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        from tests.megatron_cpu import install  # TEST DOUBLE for megatron-core's CUDA-only calls

        install()
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from nano_eval.backends.megatron import MegatronModel

    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    model_parallel_cuda_manual_seed(1234)
    theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    config = TransformerConfig(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_key_value_heads,
        kv_channels=cfg.hidden_size // cfg.num_attention_heads, normalization="RMSNorm",
        layernorm_epsilon=cfg.rms_norm_eps, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=cfg.vocab_size, max_sequence_length=2048, pre_process=True, post_process=True,
                     parallel_output=True, share_embeddings_and_output_weights=True, position_embedding_type="rope",
                     rotary_base=int(theta))
    if torch.cuda.is_available():
        model = model.cuda()
    state = {k: v for k, v in megatron_state(hf, cfg).items() if k in model.state_dict()}
    missing = model.load_state_dict(state, strict=False)
    assert not [k for k in missing.missing_keys if not k.endswith("_extra_state")], missing.missing_keys
    backend = MegatronModel([model], tokenizer, max_length=2048)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

    def train_step(ids):
        model.train()
        s = ids.shape[1] - 1
        positions = torch.arange(s, device=ids.device)[None]
        mask = torch.ones(s, s, dtype=torch.bool, device=ids.device).triu(1)[None, None]
        loss = model(ids[:, :-1], positions, mask, labels=ids[:, 1:]).float().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return backend, model.embedding.word_embeddings, model.output_layer, train_step


class Counts:
    """Token positions at the embedding (rows x columns of every call) and rows the output layer computed."""

    def __init__(self, embedding, head):
        self.positions = self.output = 0
        embedding.register_forward_pre_hook(self._embedded)
        head.register_forward_hook(self._projected)

    def _embedded(self, module, args):
        self.positions += args[0].numel()

    def _projected(self, module, args, out):
        out = out[0] if isinstance(out, tuple) else out
        self.output += out[..., 0].numel()

    def take(self) -> tuple[int, int]:
        taken, self.positions, self.output = (self.positions, self.output), 0, 0
        return taken


def worker(args) -> int:
    """One path over every case, once: writes {case: {seconds, scoring_s, positions, output_positions, docs, work,
    lm_batch_size}} and the training step's seconds to --json."""
    import torch

    from benchmark import nano_tasks, run_lm_eval

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    target, embedding, head, train_step = build_path(args.worker, args.checkpoint, args.dtype)
    counts = Counts(embedding, head)
    prepared = json.loads(Path(args.prepared).read_text())
    out = {"cases": {}}
    for name in args.cases.split(","):
        pair, (mirror, tasks_dir), limit = case_pairs(name), prepared[name], args.limit
        if args.worker == "lm-eval":
            best = None
            for bs in [int(b) for b in args.lm_batch_sizes.split(",")]:
                counts.take()
                (seconds, scoring), docs = run_lm_eval(target, target_tokenizer(args.checkpoint), [pair],
                                                        Path(tasks_dir), bs)
                if best is None or seconds < best[0]:
                    best = (seconds, scoring, docs, counts.take(), bs)
            seconds, scoring, docs, (positions, output), bs = best
            out["cases"][name] = {"seconds": seconds, "scoring_s": scoring, "positions": positions,
                                  "output_positions": output, "docs": per_doc(docs[pair.task]), "lm_batch_size": bs}
            continue
        from nano_eval.engine import BatchingConfig
        from nano_eval.evaluator import EvalConfig, Evaluator

        specs, tasks = nano_tasks([pair], Path(mirror))
        batching = BatchingConfig(packing=args.worker != "unpacked")
        evaluator = Evaluator(target, [(s, tasks[s.full_name]) for s in specs],
                              EvalConfig(max_samples=limit, batching=batching, progress=False))
        counts.take()
        start = time.perf_counter()
        results = evaluator.evaluate()
        seconds = time.perf_counter() - start
        positions, output = counts.take()
        details = results.tasks[specs[0].key].details
        out["cases"][name] = {"seconds": seconds, "scoring_s": results.timings.get("loglikelihood_s", 0.0)
                              + results.timings.get("loglikelihood_single_token_s", 0.0),
                              "positions": positions, "output_positions": output, "work": results.work,
                              "docs": per_doc([d["metrics"] for d in details])}
    if train_step is not None and args.train_steps:
        weight = next(iter(embedding.parameters()))  # [vocab (this TP rank's share at tp1: all), hidden]
        ids = torch.randint(0, weight.shape[0], (1, args.train_seq + 1), generator=torch.Generator().manual_seed(1))
        ids = ids.to(weight.device)
        train_step(ids)  # warm-up (optimizer state)
        start = time.perf_counter()
        for _ in range(args.train_steps):
            train_step(ids)
        out["train_step_s"] = (time.perf_counter() - start) / args.train_steps
    Path(args.json).write_text(json.dumps(out))
    return 0


def target_tokenizer(checkpoint: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


def per_doc(rows: list[dict]) -> list[dict]:
    """Each document's accuracies (acc, acc_norm), as floats."""
    return [{k: float(v) for k, v in r.items() if k in ("acc", "acc_norm")} for r in rows]


# ---- the driver ------------------------------------------------------------------------------------------------


def run_path(path: str, args, prepared: Path, workdir: Path, rep: int) -> dict:
    out = workdir / f"{path}_{rep}.json"
    cmd = [sys.executable, __file__, "--worker", path, "--checkpoint", args.checkpoint, "--prepared", str(prepared),
           "--json", str(out), "--cases", args.cases, "--limit", str(args.limit), "--threads", str(args.threads),
           "--lm-batch-sizes", args.lm_batch_sizes if rep == 0 else str(args.best_bs or args.lm_batch_sizes),
           "--train-steps", str(args.train_steps if rep == 0 else 0), "--train-seq", str(args.train_seq),
           "--dtype", args.dtype]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    if done.returncode:
        raise SystemExit(f"benchmark_live: error: the {path} worker failed:\n{done.stderr[-4000:]}")
    print(f"  rep {rep + 1}: {path} done in {time.perf_counter() - start:.0f}s", flush=True)
    return json.loads(out.read_text())


def summarize(runs: dict, args) -> tuple[str, bool]:
    """Markdown tables of positions, output-layer positions, seconds and ratios; and whether accuracies agree."""
    cases = args.cases.split(",")
    paths = [p for p in PATHS if p in runs]
    lines = ["Token positions at the embedding (rows x columns, padding included) / output-layer positions, and "
             "their ratio to the transformers packed path:", "",
             "| case | " + " | ".join(paths) + " |", "|---|" + "---|" * len(paths)]
    agree, ref = True, runs.get("transformers") or runs[paths[0]]
    for case in cases:
        base = ref[0]["cases"][case]
        cells = []
        for p in paths:
            c = runs[p][0]["cases"][case]
            cells.append(f"{c['positions']:,} / {c['output_positions']:,} ({c['positions'] / base['positions']:.2f}x / "
                         f"{c['output_positions'] / max(1, base['output_positions']):.2f}x)")
            if c["docs"] != base["docs"]:
                agree = False
                cells[-1] += " ACCURACY DIFFERS"
        lines.append(f"| {case} ({len(base['docs'])} docs) | " + " | ".join(cells) + " |")
    lines += ["", f"Seconds per evaluation (median of {args.reps} interleaved runs; scoring only in brackets) and "
              "ratios:", "", "| case | " + " | ".join(paths) + " | megatron / transformers | lm-eval / megatron | "
              "lm-eval / nanotron |", "|---|" + "---|" * (len(paths) + 3)]
    medians = {}
    for case in cases:
        cells = []
        for p in paths:
            seconds = statistics.median(r["cases"][case]["seconds"] for r in runs[p])
            scoring = statistics.median(r["cases"][case]["scoring_s"] for r in runs[p])
            medians[(case, p)] = seconds
            cells.append(f"{seconds:.1f} ({scoring:.1f})")

        def ratio(a, b):
            return f"{medians[(case, a)] / medians[(case, b)]:.2f}" if (case, a) in medians and (case, b) in medians \
                else "-"
        lines.append(f"| {case} | " + " | ".join(cells) + f" | {ratio('megatron', 'transformers')} | "
                     f"{ratio('lm-eval', 'megatron')}x | {ratio('lm-eval', 'nanotron')}x |")
    loops = [(p, runs[p][0].get("train_step_s")) for p in ("nanotron", "megatron") if p in runs]
    loops = [(p, s) for p, s in loops if s]
    if loops:
        lines += ["", f"In-loop cost: training step (sequence {args.train_seq}, micro-batch 1, forward + backward + "
                  f"AdamW) and the evaluation of every case above at one interval of {args.interval} steps:", "",
                  "| path | step s | evaluation s (all cases) | share of training time |", "|---|---|---|---|"]
        for p, step in loops:
            evaluation = sum(medians[(case, p)] for case in cases)
            share = evaluation / (args.interval * step + evaluation)
            lines.append(f"| {p} | {step:.2f} | {evaluation:.1f} | {share:.1%} |")
    return "\n".join(lines), agree


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", help="transformers Llama folder (default: SmolLM2-135M-Instruct, else toy)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of: {', '.join(CASES)}")
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of: {', '.join(PATHS)}")
    p.add_argument("--limit", type=int, default=24, help="documents per case (first N)")
    p.add_argument("--reps", type=int, default=2, help="interleaved repetitions (medians reported)")
    p.add_argument("--lm-batch-sizes", default="8,32", help="lm-eval batch sizes tried in the first repetition")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--train-steps", type=int, default=4, help="timed training steps per live path (0: none)")
    p.add_argument("--train-seq", type=int, default=512)
    p.add_argument("--interval", type=int, default=1000, help="training steps between evaluations (the share)")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    p.add_argument("--quick", action="store_true", help="6 documents, 1 repetition, 2 cases, 1 training step")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--prepared", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dtype is None:
        import torch

        args.dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    if args.worker:
        return worker(args)
    if args.quick:
        args.limit, args.reps, args.train_steps = 6, 1, 1
        args.cases = "hellaswag 0-shot,mmlu anatomy 5-shot"
    args.best_bs = None
    from benchmark import prepare_case
    from suite_vs_lm_eval import default_checkpoint

    with tempfile.TemporaryDirectory(prefix="nano_live_") as tmp:
        workdir = Path(tmp)
        described = args.checkpoint
        if not args.checkpoint:
            args.checkpoint, described = default_checkpoint(workdir)
        prepared = {name: [str(x) for x in prepare_case([case_pairs(name)], args.limit, workdir / f"case{i}")]
                    for i, name in enumerate(args.cases.split(","))}
        prepared_file = workdir / "prepared.json"
        prepared_file.write_text(json.dumps(prepared))
        runs: dict[str, list] = {}
        for rep in range(args.reps):
            for path in args.paths.split(","):
                runs.setdefault(path, []).append(run_path(path, args, prepared_file, workdir, rep))
                if path == "lm-eval" and rep == 0:
                    sizes = {c["lm_batch_size"] for c in runs[path][0]["cases"].values()}
                    args.best_bs = ",".join(map(str, sorted(sizes)))
    import torch

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    table, agree = summarize(runs, args)
    print(f"\nmodel: {described}; torch {torch.__version__}, {args.threads} threads per process, "
          f"{'CUDA' if torch.cuda.is_available() else 'CPU'}; {args.limit} documents per case; 1-min load average "
          f"at the end {load:.1f}\n\n{table}")
    print("\nACCURACIES IDENTICAL ON EVERY PATH" if agree else "\nACCURACIES DIFFER")
    return 0 if agree or args.dtype != "float32" else 1


if __name__ == "__main__":
    sys.exit(main())
