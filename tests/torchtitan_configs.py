"""torchtitan config registry for the tests: tiny models built by torchtitan's own config builders.

`--module tests.torchtitan_configs --config tiny_llama` on torchtitan's command line (its ConfigManager imports this
module as a user's config registry). The models, at a size a 2-core CPU trains in seconds, with the toy tokenizer's
vocabulary (600 ids: nano_eval.toy):
- tiny_llama: torchtitan's `Llama3Model` (fused qkv, GQA, RoPE with llama scaling, flex attention with
  per-document masks);
- tiny_qwen3_moe: its `Qwen3Model` with MoE layers (QK norms, cos/sin RoPE, 4 experts top-2 with torchtitan's
  token-choice router and grouped experts, all-to-all token dispatch under expert parallelism);
- tiny_deepseek_v3: its `DeepSeekV3Model` (multi-latent attention with YaRN RoPE, a dense first layer, then MoE
  layers with a shared expert).
Training runs in float32 (parameters and FSDP's compute dtype), so the live model and a checkpoint of it score
alike to float rounding (torchtitan's grouped experts compute in bfloat16 whatever the model's dtype, the same in
both); no compile, no activation checkpointing, no CUDA graphs (CPU).
"""

from __future__ import annotations

from functools import partial

import torch

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import CompileConfig, DebugConfig, ParallelismConfig, TrainingConfig
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.components.optimizer import register_moe_load_balancing_hook
from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, _build_dsv3_layers, parallelize_deepseekv3
from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter
from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers, parallelize_llama
from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_moe_layers, parallelize_qwen3
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.trainer import Trainer

VOCAB = 600  # the toy tokenizer's
DIM, HEADS, KV_HEADS, LAYERS = 64, 4, 2, 4


def tiny_llama_model(vocab: int = VOCAB) -> ModelSpec:
    layers = _build_llama3_layers(
        fuse_qkv=True, n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS,
        hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=32),
        rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=4096, theta=500000, scaling="llama"),
        attn_backend="flex")
    config = _roots(Llama3Model, vocab, layers=layers)
    return ModelSpec(name="llama3", flavor="tiny", model=config, parallelize_fn=parallelize_llama,
                     pipelining_fn=pipeline_llm, post_optimizer_build_fn=None,
                     state_dict_adapter=Llama3StateDictAdapter)


def _roots(cls, vocab: int = VOCAB, **layers):
    """A decoder config of `cls` with the tests' embedding, final norm and lm_head around `layers`."""
    init = {"weight": partial(torch.nn.init.trunc_normal_, std=0.02)}
    return cls.Config(
        dim=DIM, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=DIM, param_init=init),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init={"weight": torch.nn.init.ones_}),
        lm_head=Linear.Config(in_features=DIM, out_features=vocab, param_init=init), **layers)


def tiny_qwen3_moe_model() -> ModelSpec:
    head_dim = DIM // HEADS
    layers = _build_qwen3_moe_layers(
        n_layers=2, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=head_dim, moe_hidden_dim=32,
        num_experts=4, top_k=2, attn_backend="flex", moe_comm_backend="standard",
        rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=4096, theta=1000000.0))
    return ModelSpec(name="qwen3", flavor="tiny_moe", model=_roots(Qwen3Model, layers=layers),
                     parallelize_fn=parallelize_qwen3, pipelining_fn=pipeline_llm,
                     post_optimizer_build_fn=register_moe_load_balancing_hook, state_dict_adapter=Qwen3StateDictAdapter)


def tiny_deepseek_v3_model() -> ModelSpec:
    layers = _build_dsv3_layers(
        n_layers=2, n_dense_layers=1, dim=DIM, n_heads=HEADS, q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=16, v_head_dim=16, mscale=0.70, dense_hidden_dim=128, moe_hidden_dim=32, num_experts=4,
        num_shared_experts=1, router_top_k=2, router_score_func="softmax", attn_backend="flex",
        moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=16, max_seq_len=4096, theta=10000.0, scaling="yarn", rope_factor=40.0,
                                beta_fast=32.0, beta_slow=1.0, original_seq_len=4096))
    return ModelSpec(name="deepseek_v3", flavor="tiny", model=_roots(DeepSeekV3Model, layers=layers),
                     parallelize_fn=parallelize_deepseekv3, pipelining_fn=pipeline_llm,
                     post_optimizer_build_fn=register_moe_load_balancing_hook,
                     state_dict_adapter=DeepSeekV3StateDictAdapter)


def tiny_llama() -> Trainer.Config:
    return _trainer(tiny_llama_model())


def tiny_qwen3_moe() -> Trainer.Config:
    return _trainer(tiny_qwen3_moe_model())


def tiny_deepseek_v3() -> Trainer.Config:
    return _trainer(tiny_deepseek_v3_model())


def _trainer(spec: ModelSpec) -> Trainer.Config:
    return Trainer.Config(
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=VOCAB)),
        model_spec=spec,
        optimizer=default_adamw(lr=3e-3),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=1, decay_ratio=0.8, decay_type="linear",
                                                  min_lr_factor=0.0),
        training=TrainingConfig(local_batch_size=2, seq_len=64, steps=4, dtype="float32",
                                mixed_precision_param="float32", disable_cuda_graphs=True),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test"),
        metrics=MetricsProcessor.Config(log_freq=1),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor", pipeline_parallel_schedule="GPipe",
                                      pipeline_parallel_microbatch_size=1),
        checkpoint=CheckpointManager.Config(interval=2, last_save_model_only=False),
        activation_checkpoint=None,
        compile=CompileConfig(),
        debug=DebugConfig(seed=0),  # the same initial weights in every run (the with / without-hook comparison)
    )
