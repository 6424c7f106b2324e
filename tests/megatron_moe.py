"""A tiny Mixture-of-Experts megatron-core GPTModel (local spec: RMSNorm, RoPE, GQA; every layer MoE with 4 SwiGLU
experts, top-2, `SequentialMLP`) holding the same weights in every TP x PP x EP layout.

Each parameter's full tensor is a pure function of (seed, its *global* name): global layer number, global expert
index (EP rank x local experts + local index). It is then cut for this rank the way megatron shards it: along the
parameter's `partition_dim` over the TP group (expert parameters: over the expert-TP group), SwiGLU `linear_fc1` as
[gate shard | up shard]. The full tensors are synthetic, so the reference is the same model in another layout
(ep1 x tp1 x pp1), not a transformers conversion. Import only where megatron-core may be imported (spawned workers).
"""

from __future__ import annotations

import hashlib
import re

import torch

from tests.megatron_gpt import GPTConfig, megatron_args, transformer_config

EXPERTS, TOPK, MOE_FFN = 4, 2, 32
_LAYER = re.compile(r"^(.*decoder\.layers\.)(\d+)(\..*)$")
_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def moe_config(cfg: GPTConfig = GPTConfig(), *, dispatcher: str = "alltoall", capacity: float | None = None,
               pad_to_capacity: bool = False, balancing: str = "none", aux_loss: float = 0.0,
               expert_bias: bool = False, dropout: float = 0.0, **parallel):
    """megatron-core's TransformerConfig of the MoE model. capacity: moe_expert_capacity_factor (None = dropless);
    balancing / aux_loss / expert_bias: the router's load balancing (aux loss; aux-loss-free expert bias, which
    takes sigmoid scores). `parallel`: tensor / pipeline / expert / context parallel sizes."""
    return transformer_config(
        cfg, dropout=dropout, num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=MOE_FFN,
        moe_grouped_gemm=False, moe_permute_fusion=False, moe_token_dispatcher_type=dispatcher,
        moe_expert_capacity_factor=capacity, moe_pad_expert_input_to_capacity=pad_to_capacity,
        moe_router_load_balancing_type=balancing, moe_aux_loss_coeff=aux_loss,
        moe_router_enable_expert_bias=expert_bias, moe_router_score_function="sigmoid" if expert_bias else "softmax",
        **parallel)


def build_moe_model(cfg: GPTConfig = GPTConfig(), *, seed: int = 0, **options):
    """This rank's MoE GPTModel (one chunk) holding the seed's weights; parallel_state must be initialised with the
    layout (tp, pp, ep, cp), and `options` go to moe_config."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234)
    config = moe_config(cfg, tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
                        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
                        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(), **options)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False, normalization="RMSNorm")
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=cfg.vocab_size,
                     max_sequence_length=cfg.max_position_embeddings, pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage(), parallel_output=True,
                     share_embeddings_and_output_weights=False, position_embedding_type="rope",
                     rotary_base=int(cfg.rotary_base))
    load_moe_weights(model, seed)
    return model


def global_name(model, name: str) -> str:
    """A parameter's name in the whole model: the global layer number (megatron's 1-based layer_number - 1) and the
    global expert index."""
    from megatron.core import parallel_state as ps

    m = _LAYER.match(name)
    if m:
        name = f"{m.group(1)}{model.decoder.layers[int(m.group(2))].layer_number - 1}{m.group(3)}"
    m = _EXPERT.match(name)
    if m:
        local = EXPERTS // ps.get_expert_model_parallel_world_size()
        name = f"{m.group(1)}{ps.get_expert_model_parallel_rank() * local + int(m.group(2))}{m.group(3)}"
    return name


def _full_tensor(shape, name: str, seed: int) -> torch.Tensor:
    digest = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")
    full = torch.randn(shape, generator=torch.Generator().manual_seed(digest))
    if name.endswith("layernorm.weight"):
        return 1.0 + 0.1 * full
    if name.endswith("word_embeddings.weight"):
        return full
    return (0.5 if name.endswith("router.weight") else 0.2) * full


def load_moe_weights(model, seed: int = 0) -> None:
    """Fill every parameter of `model` with its shard of the seed's full tensor (see the module docstring)."""
    from megatron.core import parallel_state as ps

    tp = (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank())
    etp = (ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank())
    with torch.no_grad():
        for name, param in model.named_parameters():
            name = global_name(model, name)
            size, rank = etp if _EXPERT.match(name) else tp
            sharded = getattr(param, "tensor_model_parallel", False) and size > 1
            shape = list(param.shape)
            if sharded:
                shape[param.partition_dim] *= size
            full = _full_tensor(shape, name, seed)
            if sharded and name.endswith("linear_fc1.weight"):  # SwiGLU: [gate | up], each cut over TP
                gate, up = full.chunk(2, dim=0)
                full = torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]])
            elif sharded:
                full = full.chunk(size, param.partition_dim)[rank]
            param.copy_(full)


def moe_args(cfg: GPTConfig = GPTConfig(), *, tp: int = 1, pp: int = 1, ep: int = 1, dispatcher: str = "alltoall",
             capacity: float | None = None, pad_to_capacity: bool = False, balancing: str = "none",
             aux_loss: float = 0.0, expert_bias: bool = False):
    """Megatron-LM's training arguments (as pickled into checkpoints) of the MoE model built with the same options
    (moe_config): megatron_gpt's dense args plus the MoE ones under Megatron-LM's names (--num-experts, --moe-*,
    --expert-model-parallel-size)."""
    args = megatron_args(cfg, tp=tp, pp=pp)
    args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size = EXPERTS, TOPK, MOE_FFN
    args.expert_model_parallel_size, args.expert_tensor_parallel_size = ep, tp
    args.moe_grouped_gemm, args.moe_token_dispatcher_type, args.moe_permute_fusion = False, dispatcher, False
    args.moe_router_load_balancing_type, args.moe_aux_loss_coeff = balancing, aux_loss
    args.moe_expert_capacity_factor, args.moe_pad_expert_input_to_capacity = capacity, pad_to_capacity
    args.moe_router_enable_expert_bias = expert_bias
    args.moe_router_score_function = "sigmoid" if expert_bias else "softmax"
    args.moe_layer_freq, args.moe_router_topk_scaling_factor, args.moe_router_pre_softmax = 1, None, False
    args.moe_shared_expert_intermediate_size, args.transformer_impl = None, "local"
    return args
