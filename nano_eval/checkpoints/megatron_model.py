"""megatron-core's GPTModel from the training arguments a Megatron checkpoint pickles (Megatron-LM's names).

Both Megatron readers build the model this way: the torch_dist -> transformers converter at TP1/PP1
(megatron_dist.py) and the native backend in any TP x PP x EP layout (megatron_native.py). The architecture is
what Megatron-LM built from the args (megatron_config.translate: every model-math argument applied or refused by
name; plain values only, the args are untrusted); everything about the run (parallel sizes, fusions that need
compiled kernels, dropout, recomputation) is set for evaluation on this machine. Norm weights of a run with
`--apply-layernorm-1p` are stored zero-centred: the caller adds 1 after loading (`unfold_zero_centered_gamma`).

The layer spec is megatron-core's local one (no Transformer Engine needed): its sharded state dict names every
weight as the Transformer Engine spec does, so checkpoints of either spec load. MoE layers use `SequentialMLP`
(no grouped GEMM); `moe_layer_freq` decides which layers are MoE, as in training.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from nano_eval.checkpoints.megatron_config import ModelArgs, translate
from nano_eval.errors import NanoEvalError


def transformer_config(args: Mapping, *, tp: int, pp: int, ep: int = 1, dtype: torch.dtype | None = None,
                       translated: ModelArgs | None = None):
    """TransformerConfig of the model `args` describe (megatron_config.translate), for evaluation at tp x pp x ep
    (cp 1, no sequence parallelism); weights are not initialised (the checkpoint overwrites them)."""
    from dataclasses import fields

    from megatron.core.transformer import TransformerConfig

    translated = translated or translate(args)
    known = {f.name for f in fields(TransformerConfig)}
    kwargs = {k: v for k, v in translated.config.items() if k in known}
    if dtype is None:
        dtype = args.get("params_dtype") if isinstance(args.get("params_dtype"), torch.dtype) else torch.float32
    try:
        return TransformerConfig(
            **kwargs, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
            context_parallel_size=1, sequence_parallel=False, params_dtype=dtype, pipeline_dtype=dtype,
            bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, hidden_dropout=0.0, attention_dropout=0.0,
            bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
            apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
            moe_grouped_gemm=False, moe_permute_fusion=False, use_cpu_initialization=True,
            perform_initialization=False)
    except (ValueError, AssertionError, TypeError) as e:  # megatron-core's own consistency checks
        raise NanoEvalError(f"megatron-core refuses the model the checkpoint's args describe ({type(e).__name__}: "
                            f"{' '.join(str(e).split())[:200]}). Fix: check the run's args (common.pt / "
                            f"model_optim_rng.pt) against the megatron-core version installed here.") from e


def build_gpt_model(args: Mapping, *, tp: int | None = None, pp: int | None = None, ep: int | None = None,
                    dtype: torch.dtype | None = None):
    """This rank's GPTModel stage in the current parallel_state (sizes default to it); at TP1/PP1, the whole
    model."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    tp = tp or ps.get_tensor_model_parallel_world_size()
    pp = pp or ps.get_pipeline_model_parallel_world_size()
    ep = ep or ps.get_expert_model_parallel_world_size()
    try:
        translated = translate(args)
        config = transformer_config(args, tp=tp, pp=pp, ep=ep, dtype=dtype, translated=translated)
        if config.num_moe_experts:
            spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                              normalization=translated.spec["normalization"],
                                              qk_l2_norm=translated.spec["qk_l2_norm"])
        else:
            spec = get_gpt_layer_local_spec(**translated.spec)
        return GPTModel(config=config, transformer_layer_spec=spec, pre_process=ps.is_pipeline_first_stage(),
                        post_process=ps.is_pipeline_last_stage(), **translated.gpt)
    except KeyError as e:
        raise NanoEvalError(f"the checkpoint's args lack {e}. Fix: pass megatron_args=... (Megatron's names).") from e
