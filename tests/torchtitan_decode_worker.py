"""Greedy generation through nano_eval's torchtitan KV cache against the re-run path, on a model built by
torchtitan's REAL Trainer (its model, parallelize function, FSDP2 / TP / PP, meshes, schedule) in one layout; no
training step. Run on CPU under torchrun through tests/torchtitan_launch.py (the CPU double):

    python -m torch.distributed.run --nproc_per_node=2 tests/torchtitan_launch.py tests/torchtitan_decode_worker.py \\
        OUT_DIR UNSHARD --module tests.torchtitan_configs --config tiny_llama ... (torchtitan's own arguments)

UNSHARD: auto / false (the backend's option: false keeps FSDP2 sharded, so the backend runs in lockstep).
`... tests/torchtitan_decode_worker.py compiled OUT_DIR` (one process, no torchrun): tiny_llama with every block
compiled as torchtitan's `apply_compile` does (`block.compile(fullgraph=True)`; backend "eager": dynamo traces, no
C++ toolchain), generations of both paths and the graphs dynamo built while the cache decoded, in OUT_DIR/compiled.json.
Each rank writes OUT_DIR/rank<R>.json: tests/generation_checks.py's cached_and_rerun (generations of both paths,
with and without a stop sequence, tokens through the embedding) plus "shared": both paths on prompts with a long
common prefix, which the decoder prefills once (`shared_prefix`: the longest prefix a prefill shared).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

SHARED_PROMPTS = ["Question: what is the sum of all the numbers from one to ten? " + tail
                  for tail in ("Answer:", "Think, then answer:", "A")]


def build_backend(trainer, unshard):
    from transformers import AutoTokenizer

    from nano_eval.backends.torchtitan import TorchtitanModel

    config = trainer.config
    tokenizer = AutoTokenizer.from_pretrained(config.hf_assets_path)
    schedule = getattr(trainer, "pp_schedule", None) if trainer.parallel_dims.pp > 1 else None
    return TorchtitanModel(trainer.model_parts, trainer.parallel_dims, tokenizer, max_length=config.training.seq_len,
                           schedule=schedule, sequence_parallel=config.parallelism.enable_sequence_parallel,
                           unshard=unshard, device=trainer.device)


def shared_prefix(backend) -> dict:
    """Both paths on SHARED_PROMPTS with shared_prefix_tokens=8: {"cached", "rerun", "shared_prefix"}."""
    from nano_eval.decoder import CacheDecoder
    from nano_eval.engine import BatchingConfig, Engine
    from nano_eval.tasks.requests import GreedyUntilRequest
    from tests.generation_checks import Rerunning

    requests = [GreedyUntilRequest("s", i, 0, p, stop_sequence=[], generation_size=8)
                for i, p in enumerate(SHARED_PROMPTS)]
    shared, prefill = [0], CacheDecoder._prefill  # every prefill of a pool, refills included

    def recorded(self, *args):
        out = prefill(self, *args)
        shared.append(self.shared)
        return out

    def generate(model):  # 2 rows for 3 prompts: the third refills a freed slot from the pool's prefix cache
        engine = Engine(model, BatchingConfig(max_batch_tokens=400, max_batch_size=2, shared_prefix_tokens=8),
                        progress=False)
        return {str(k): r.tokens for k, r in sorted(engine.run_greedy(engine.prepare_greedy(requests)).items())}

    CacheDecoder._prefill = recorded
    try:
        return {"cached": generate(backend), "rerun": generate(Rerunning(backend)), "shared_prefix": max(shared)}
    finally:
        CacheDecoder._prefill = prefill


def compiled(out_dir: Path) -> None:
    import torch
    from torch._dynamo.utils import counters

    import tests.torchtitan_configs as configs
    from nano_eval.backends.base import evaluation_mode
    from nano_eval.backends.torchtitan import TorchtitanModel
    from nano_eval.checkpoints.torchtitan import build_model
    from nano_eval.toy import build_tokenizer
    from tests.generation_checks import Rerunning, generate

    torch.manual_seed(0)
    model = build_model(configs.tiny_llama(), 64)
    tokenizer = build_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    backend = TorchtitanModel([model], None, tokenizer, max_length=64)
    for block in model.layers.values():
        block.compile(backend="eager", fullgraph=True)
    with backend.session(), evaluation_mode(model):
        rerun = generate(Rerunning(backend), [])
        graphs = counters["stats"]["unique_graphs"]
        cached = generate(backend, [])
        graphs = counters["stats"]["unique_graphs"] - graphs
    still = all(block._compiled_call_impl is not None for block in model.layers.values())
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "compiled.json").write_text(json.dumps({"equal": cached == rerun, "graphs_while_decoding": graphs,
                                                       "rerun_graphs": counters["stats"]["unique_graphs"] - graphs,
                                                       "still_compiled": still}))


def main() -> None:
    import torch.distributed as dist
    from torchtitan.config import ConfigManager

    from nano_eval.backends.base import evaluation_mode
    from tests.generation_checks import cached_and_rerun

    out_dir, unshard, rest = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    config = ConfigManager().parse_args(rest)
    trainer = type(config)._owner(config)
    try:
        backend = build_backend(trainer, {"auto": "auto", "false": False}[unshard])
        embedding = getattr(trainer.model_parts[0], "tok_embeddings", None)  # the first stage's only
        with backend.session():
            result = cached_and_rerun(backend, embedding)
            with evaluation_mode(backend.module):
                result["shared"] = shared_prefix(backend)
        for key in ("cached", "rerun", "cached_stop", "rerun_stop"):
            result[key] = {str(k): v for k, v in result[key].items()}
        for key in ("divergences", "divergences_stop"):
            result[key] = {str(k): v for k, v in result[key].items()}
        result["lockstep"] = backend.lockstep
        result["layout"] = backend.layout.describe()
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(result))
    finally:
        trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "compiled":
        compiled(Path(sys.argv[2]))
    else:
        main()
