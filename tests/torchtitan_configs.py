"""torchtitan config registry for the tests: tiny Llama3 models built by torchtitan's own config builders.

`--module tests.torchtitan_configs --config tiny_llama` on torchtitan's command line (its ConfigManager imports this
module as a user's config registry). The model is torchtitan's `Llama3Model` (fused qkv, GQA, RoPE with llama
scaling, flex attention with per-document masks) at a size a 2-core CPU trains in seconds; the vocabulary is the
toy tokenizer's (600 ids: nano_eval.toy). Training runs in float32 (parameters and FSDP's compute dtype), so the
live model and a checkpoint of it score alike to float rounding; no compile, no activation checkpointing, no CUDA
graphs (CPU).
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
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers, parallelize_llama
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.trainer import Trainer

VOCAB = 600  # the toy tokenizer's
DIM, HEADS, KV_HEADS, LAYERS = 64, 4, 2, 4


def tiny_llama_model(vocab: int = VOCAB) -> ModelSpec:
    init = {"weight": partial(torch.nn.init.trunc_normal_, std=0.02)}
    config = Llama3Model.Config(
        dim=DIM,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=DIM, param_init=init),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init={"weight": torch.nn.init.ones_}),
        lm_head=Linear.Config(in_features=DIM, out_features=vocab, param_init=init),
        layers=_build_llama3_layers(
            fuse_qkv=True, n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS,
            hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=32),
            rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=4096, theta=500000, scaling="llama"),
            attn_backend="flex",
        ),
    )
    return ModelSpec(name="llama3", flavor="tiny", model=config, parallelize_fn=parallelize_llama,
                     pipelining_fn=pipeline_llm, post_optimizer_build_fn=None,
                     state_dict_adapter=Llama3StateDictAdapter)


def tiny_llama() -> Trainer.Config:
    spec = tiny_llama_model()
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
