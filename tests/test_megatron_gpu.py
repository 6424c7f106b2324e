"""GPU-only: a real megatron-core GPTModel behind MegatronModel scores like its transformers conversion.

TP1 on one GPU; with two or more GPUs also TP2 and PP2 (PP goes through Megatron's forward-only schedule and P2P).
The weights are tests/megatron_gpt.py's: sliced into GPTModel's state dict (Transformer Engine names when TE is
installed, local-spec names otherwise) and, unsliced, loaded into transformers' Llama. The CPU tests
(tests/test_megatron.py) cover every layout on the local spec; this file is for the CUDA kernels (TE spec, bf16).
"""

import os
import pickle
import traceback

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'nano_eval[megatron]')")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TASKS = "demo|arithmetic|0,demo|arithmetic_ppl|0"
TE_SPEC_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                 "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def _layer_spec():
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(), False
    except ImportError:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        return get_gpt_layer_local_spec(), True


def build_gpt_model(tp: int, pp: int):
    """GPTModel on this rank's TP shard and PP stage, holding the seed-0 toy weights."""
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from tests.megatron_gpt import GPTConfig, logical_weights, megatron_shard

    cfg = GPTConfig()
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.kv_channels, normalization="RMSNorm", layernorm_epsilon=cfg.norm_epsilon,
        gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False, add_bias_linear=False,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, attention_dropout=0.0, hidden_dropout=0.0)
    spec, local = _layer_spec()
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=cfg.vocab_size,
                     max_sequence_length=cfg.max_position_embeddings, pre_process=first, post_process=last,
                     parallel_output=True, share_embeddings_and_output_weights=False,
                     position_embedding_type="rope", rotary_base=int(cfg.rotary_base)).cuda()
    per_stage, stage = cfg.num_layers // pp, ps.get_pipeline_model_parallel_rank()
    full = megatron_shard(logical_weights(cfg), cfg, ps.get_tensor_model_parallel_rank(), tp)
    state = {}
    for name, tensor in full.items():
        if name.startswith("decoder.layers."):
            index = int(name.split(".")[2])
            if not stage * per_stage <= index < (stage + 1) * per_stage:
                continue
            name = name.replace(f"decoder.layers.{index}.", f"decoder.layers.{index - stage * per_stage}.", 1)
        if not local:
            name = next((name.replace(k, v) for k, v in TE_SPEC_NAMES.items() if name.endswith(k)), name)
        state[name] = tensor.cuda()
    expected = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    missing = expected - set(state)
    assert not missing, f"GPTModel parameters without toy weights: {sorted(missing)}"
    model.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=False)
    return model.eval()


def evaluate_gpt(rank, world, tp, pp, tokenizer_dir):
    from transformers import AutoTokenizer

    from nano_eval.backends.megatron import MegatronModel
    from nano_eval.compat.megatron import import_megatron_core
    from tests.nanotron_worker import summarize

    import_megatron_core().initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    backend = MegatronModel(build_gpt_model(tp, pp), AutoTokenizer.from_pretrained(tokenizer_dir), max_length=128,
                            micro_batch_size=2)
    return summarize(backend, TASKS, 1024, 12)


def _entry(rank, world, port, fn, args, queue):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        queue.put((rank, "ok", pickle.dumps(fn(rank, world, *args))))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def run_nccl(fn, world, *args, timeout=600):
    """fn(rank, world, *args) on `world` GPUs under nccl; per-rank results in rank order."""
    import torch.multiprocessing as mp

    from tests.dist_utils import free_port

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict((r, (s, out)) for r, s, out in (queue.get(timeout=timeout) for _ in procs))
    for p in procs:
        p.join(timeout=60)
    errors = [f"rank {r}:\n{out}" for r, (s, out) in sorted(results.items()) if s == "error"]
    assert not errors, "\n".join(errors)
    return [pickle.loads(results[r][1]) for r in range(world)]


@pytest.fixture(scope="module")
def reference(toy_checkpoint):
    """The same weights in transformers' LlamaForCausalLM on the GPU."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from nano_eval.backends.transformers import TransformersModel
    from tests.nanotron_worker import summarize
    from tests.megatron_gpt import GPTConfig, logical_weights

    cfg = GPTConfig()
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups, max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.norm_epsilon, rope_theta=cfg.rotary_base, tie_word_embeddings=False))
    hf.load_state_dict(logical_weights(cfg))
    backend = TransformersModel(hf.cuda().eval(), AutoTokenizer.from_pretrained(str(toy_checkpoint)))
    return summarize(backend, TASKS, 1024, 12)


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)], ids=["tp1", "tp2", "pp2"])
def test_gpt_model_matches_transformers(reference, toy_checkpoint, tp, pp):
    if tp * pp > torch.cuda.device_count():
        pytest.skip(f"needs {tp * pp} GPUs")
    per_rank = run_nccl(evaluate_gpt, tp * pp, tp, pp, str(toy_checkpoint))
    got = per_rank[0]
    assert all(r == got for r in per_rank), "ranks disagree"
    for key, ref in reference.items():
        assert got[key]["metrics"]["acc" if "ppl" not in key else "bits_per_byte"] == pytest.approx(
            ref["metrics"]["acc" if "ppl" not in key else "bits_per_byte"], rel=1e-4)
        for a, b in zip(ref["logprobs"], got[key]["logprobs"], strict=True):
            assert b == pytest.approx(a, rel=1e-4, abs=1e-4), key
