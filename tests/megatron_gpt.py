"""A tiny Llama-style megatron-core GPTModel (local spec: RMSNorm, RoPE, GQA, SwiGLU, no biases, untied embeddings)
and the same weights as transformers' LlamaForCausalLM.

Weights are a pure function of (seed, logical name) under transformers' names (`logical_weights`), built full on
every rank and cut the way Megatron shards them (`megatron_shard`): linear_qkv rows grouped per query group
([q heads of group g | k_g | v_g] for each g) and split over TP by whole groups; linear_fc1 = [gate shard | up
shard] per TP rank; row-parallel layers split by input columns. So every TP x PP (x virtual PP) layout holds the
same model, and the transformers model built from `logical_weights` is the ground truth for scores and converters.
Import only in a process where megatron-core may be imported (the spawned workers, or the checkpoint tests).
"""

from __future__ import annotations

import hashlib
from argparse import Namespace
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 544  # padded vocabulary (>= the toy tokenizer's 537), divisible by tp
    hidden_size: int = 64
    ffn_hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: int = 2  # must divide by tp
    num_layers: int = 4  # divisible by pp x vp = 4
    max_position_embeddings: int = 128
    norm_epsilon: float = 1e-6
    rotary_base: float = 10000.0

    @property
    def kv_channels(self) -> int:
        return self.hidden_size // self.num_attention_heads


def _seeded_normal(shape, name: str, seed: int, scale: float = 0.2) -> torch.Tensor:
    digest = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")
    return torch.randn(shape, generator=torch.Generator().manual_seed(digest)) * scale


def logical_weights(cfg: GPTConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """The full model under transformers' LlamaForCausalLM names: the ground truth a converter must reproduce."""
    h, d = cfg.hidden_size, cfg.kv_channels
    w = {"model.embed_tokens.weight": _seeded_normal((cfg.vocab_size, h), "embed", seed, 1.0),
         "model.norm.weight": 1.0 + _seeded_normal((h,), "final_norm", seed, 0.1),
         "lm_head.weight": _seeded_normal((cfg.vocab_size, h), "lm_head", seed)}
    shapes = {"self_attn.q_proj": (cfg.num_attention_heads * d, h), "self_attn.k_proj": (cfg.num_query_groups * d, h),
              "self_attn.v_proj": (cfg.num_query_groups * d, h), "self_attn.o_proj": (h, cfg.num_attention_heads * d),
              "mlp.gate_proj": (cfg.ffn_hidden_size, h), "mlp.up_proj": (cfg.ffn_hidden_size, h),
              "mlp.down_proj": (h, cfg.ffn_hidden_size)}
    for i in range(cfg.num_layers):
        for name, shape in shapes.items():
            w[f"model.layers.{i}.{name}.weight"] = _seeded_normal(shape, f"{i}.{name}", seed)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            w[f"model.layers.{i}.{norm}.weight"] = 1.0 + _seeded_normal((h,), f"{i}.{norm}", seed, 0.1)
    return w


def megatron_shard(w: dict[str, torch.Tensor], cfg: GPTConfig, tp_rank: int, tp: int) -> dict[str, torch.Tensor]:
    """TP rank `tp_rank`'s share of the logical weights `w` under GPTModel's local-spec names, global layer numbers."""
    def rows(t):  # column-parallel: a contiguous block of output rows
        return t.chunk(tp, dim=0)[tp_rank]

    def cols(t):  # row-parallel: a contiguous block of input columns
        return t.chunk(tp, dim=1)[tp_rank]

    ng, d, qg = cfg.num_query_groups, cfg.kv_channels, cfg.num_attention_heads // cfg.num_query_groups
    out = {"embedding.word_embeddings.weight": rows(w["model.embed_tokens.weight"]),
           "decoder.final_layernorm.weight": w["model.norm.weight"], "output_layer.weight": rows(w["lm_head.weight"])}
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        q, k, v = (w[src + f"self_attn.{p}_proj.weight"] for p in "qkv")
        grouped = torch.cat([q.view(ng, qg * d, -1), k.view(ng, d, -1), v.view(ng, d, -1)], dim=1)  # [ng, .., H]
        gate, up = rows(w[src + "mlp.gate_proj.weight"]), rows(w[src + "mlp.up_proj.weight"])
        out |= {dst + "self_attention.linear_qkv.weight": rows(grouped.reshape(-1, cfg.hidden_size)),
                dst + "input_layernorm.weight": w[src + "input_layernorm.weight"],
                dst + "self_attention.linear_proj.weight": cols(w[src + "self_attn.o_proj.weight"]),
                dst + "mlp.linear_fc1.weight": torch.cat([gate, up]),
                dst + "pre_mlp_layernorm.weight": w[src + "post_attention_layernorm.weight"],
                dst + "mlp.linear_fc2.weight": cols(w[src + "mlp.down_proj.weight"])}
    return out


def megatron_args(cfg: GPTConfig, tp: int = 1, pp: int = 1) -> Namespace:
    """The subset of Megatron-LM's training arguments (as pickled into checkpoints) that describes the model."""
    return Namespace(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, group_query_attention=True,
        num_query_groups=cfg.num_query_groups, kv_channels=cfg.kv_channels,
        max_position_embeddings=cfg.max_position_embeddings, seq_length=cfg.max_position_embeddings,
        padded_vocab_size=cfg.vocab_size, normalization="RMSNorm", norm_epsilon=cfg.norm_epsilon, swiglu=True,
        position_embedding_type="rope", rotary_base=cfg.rotary_base, rotary_percent=1.0, rotary_interleaved=False,
        untie_embeddings_and_output_weights=True, add_bias_linear=False, add_qkv_bias=False, qk_layernorm=False,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, params_dtype=torch.float32,
        global_batch_size=8, micro_batch_size=2, ckpt_format="torch_dist",
    )


# Megatron-LM's training defaults (its --no-*-fusion flags) that the local layer spec runs without Transformer
# Engine or Apex: the fused softmax (a CUDA extension; tests/megatron_kernels/ on CPU) and the torch.compile'd
# bias-SwiGLU and bias-dropout-add. Not here: apply_rope_fusion (megatron-core refuses it without Transformer Engine),
# persist_layer_norm (Apex's FusedLayerNorm only; megatron's torch norm refuses it) and gradient_accumulation_fusion
# (Apex's fused_weight_gradient_mlp_cuda; training only).
MEGATRON_LM_FUSIONS = dict(masked_softmax_fusion=True, bias_activation_fusion=True, bias_dropout_fusion=True)
BF16 = dict(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)


def transformer_config(cfg: GPTConfig, *, dropout: float = 0.0, **options):
    """megatron-core's TransformerConfig of the model (fp32, fusions off); `options`: tensor/pipeline/virtual sizes,
    sequence_parallel, or any other field (e.g. **BF16, **MEGATRON_LM_FUSIONS)."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    fields = dict(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.kv_channels, normalization="RMSNorm", layernorm_epsilon=cfg.norm_epsilon,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        use_cpu_initialization=True, attention_dropout=dropout, hidden_dropout=dropout)
    return TransformerConfig(**{**fields, **options})


def build_gpt_chunks(cfg: GPTConfig = GPTConfig(), *, vp: int | None = None, seed: int = 0, dropout: float = 0.0,
                     sequence_parallel: bool = False, **options) -> list:
    """This rank's GPTModel chunks (one, or `vp` for an interleaved pipeline) holding the seed's weights;
    `options`: more TransformerConfig fields (see transformer_config).

    parallel_state must be initialised with the same tp / pp (and vp). Chunk v of stage p holds global layers
    [(v * pp + p) * L, ...) with L = num_layers / (pp * vp); megatron numbers them (`layer_number`, 1-based)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    model_parallel_cuda_manual_seed(1234)
    config = transformer_config(cfg, dropout=dropout, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                virtual_pipeline_model_parallel_size=vp, sequence_parallel=sequence_parallel, **options)
    shard = megatron_shard(logical_weights(cfg, seed), cfg, ps.get_tensor_model_parallel_rank(), tp)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if sequence_parallel:  # megatron's torch norm refuses SP; Apex's does not: stand in for it (tests/megatron_cpu.py)
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

        from tests.megatron_cpu import local_spec_norm

        norm = local_spec_norm()
        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = norm
        spec = TransformerBlockSubmodules(layer_specs=[spec] * (cfg.num_layers // (pp * (vp or 1))), layer_norm=norm)
    chunks = []
    for v in range(vp or 1):
        stage = {"vp_stage": v} if vp else {}
        model = GPTModel(config=config, transformer_layer_spec=spec,
                         vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_position_embeddings,
                         pre_process=ps.is_pipeline_first_stage(ignore_virtual=vp is None, **stage),
                         post_process=ps.is_pipeline_last_stage(ignore_virtual=vp is None, **stage),
                         parallel_output=True, share_embeddings_and_output_weights=False,
                         position_embedding_type="rope", rotary_base=int(cfg.rotary_base), **stage)
        local = {f"decoder.layers.{i}.": f"decoder.layers.{layer.layer_number - 1}."
                 for i, layer in enumerate(model.decoder.layers)}
        state = {}
        for name in model.state_dict():
            if name.endswith("_extra_state"):
                continue
            prefix = next((p for p in local if name.startswith(p)), None)
            state[name] = shard[name if prefix is None else local[prefix] + name[len(prefix):]]
        model.load_state_dict(state, strict=False)
        chunks.append(model)
    return chunks


def transformers_llama(cfg: GPTConfig = GPTConfig(), seed: int = 0):
    """The same weights in transformers' LlamaForCausalLM (fp32, eval mode)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups, max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.norm_epsilon, rope_theta=cfg.rotary_base, tie_word_embeddings=False))
    model.load_state_dict(logical_weights(cfg, seed))
    return model.eval()
