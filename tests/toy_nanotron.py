"""A small Llama built from nanotron's own parallel modules, for tests and CPU examples.

nanotron's Llama needs flash-attn and CUDA, so it cannot run on CPU. This model mirrors it: the same parameter
names and shapes (`model.decoder.<i>.pp_block.attn.qkv_proj.weight`, ...), fused qkv / gate_up projections split
over TP with nanotron's `contiguous_chunks`, RMSNorm, SwiGLU, grouped-query attention, and rotary embeddings in
nanotron's training convention (interleaved pairs, as flash-attn's `interleaved=True`). Its building blocks are
nanotron's: TensorParallelEmbedding, column/row linears, PipelineBlock + P2P + TensorPointer, a vocab-parallel LM
head. `model.model(input_ids [B, S], input_mask [B, S])` returns fp32 vocab-sharded logits `[S, B, V/tp]` on the
last pipeline stage and a TensorPointer elsewhere, like nanotron's LlamaModel.

Weights are a pure function of (seed, parameter name), so every TP/PP/DP layout holds the same model.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nano_eval.compat.nanotron import import_nanotron

import_nanotron()

import nanotron.distributed as ndist  # noqa: E402
from nanotron.parallel.parameters import NanotronParameter  # noqa: E402
from nanotron.parallel.pipeline_parallel.block import PipelineBlock  # noqa: E402
from nanotron.parallel.pipeline_parallel.p2p import P2P  # noqa: E402
from nanotron.parallel.tensor_parallel.enum import TensorParallelLinearMode  # noqa: E402
from nanotron.parallel.tensor_parallel.nn import (  # noqa: E402
    TensorParallelColumnLinear,
    TensorParallelEmbedding,
    TensorParallelRowLinear,
)
from nanotron.parallel.tied_parameters import create_pg_for_tied_weights, tie_parameters  # noqa: E402

ALL_REDUCE = TensorParallelLinearMode.ALL_REDUCE


@dataclass(frozen=True)
class ToyConfig:
    """Field names follow nanotron's LlamaConfig so `llama_config()` can be written into a checkpoint."""

    vocab_size: int = 512  # must divide by tp
    hidden_size: int = 64
    intermediate_size: int = 128
    num_attention_heads: int = 4  # must divide by tp
    num_key_value_heads: int = 2  # must divide by tp
    num_hidden_layers: int = 4
    max_position_embeddings: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    position_ids_input: bool = False  # True: forward(input_ids, position_ids) like nanotron main's Qwen2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def llama_config(self) -> dict:
        """The `model.model_config` section of a nanotron config.yaml for this model."""
        cfg = {k: v for k, v in asdict(self).items() if k != "position_ids_input"}
        return {**cfg, "hidden_act": "silu", "tie_word_embeddings": False, "is_llama_config": True}


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(hidden_size)), eps

    def forward(self, input):
        x = input.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return {"hidden_states": (self.weight * x).to(input.dtype)}


def rotate_interleaved(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding on pairs (x[2i], x[2i+1]): x [S, B, heads, d], positions [S, B]."""
    d = x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)  # [d/2]
    angles = positions[..., None, None].float() * freqs  # [S, B, 1, d/2]
    cos, sin = angles.cos(), angles.sin()
    even, odd = x[..., 0::2].float(), x[..., 1::2].float()
    out = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


class Embedding(nn.Module):
    def __init__(self, cfg: ToyConfig, tp_pg):
        super().__init__()
        self.token_embedding = TensorParallelEmbedding(cfg.vocab_size, cfg.hidden_size, pg=tp_pg, mode=ALL_REDUCE)

    def forward(self, input_ids, input_mask):  # [B, S] -> [S, B, H], positions [S, B]
        positions = (input_mask.long().cumsum(-1) - 1).clamp(min=0)
        return self._embed(input_ids, positions)

    def _embed(self, input_ids, positions):
        return {"hidden_states": self.token_embedding(input_ids.transpose(0, 1)), "positions": positions.transpose(0, 1)}


class EmbeddingWithPositionIds(Embedding):
    """Qwen2-style entry (nanotron main): positions come in as `position_ids` [B, S] instead of a mask."""

    def forward(self, input_ids, position_ids):
        return self._embed(input_ids, position_ids)


class Attention(nn.Module):
    def __init__(self, cfg: ToyConfig, tp_pg):
        super().__init__()
        tp, d = tp_pg.size(), cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads // tp, cfg.num_key_value_heads // tp, d
        self.theta = cfg.rope_theta
        q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        self.qkv_proj = TensorParallelColumnLinear(
            cfg.hidden_size, q + 2 * kv, pg=tp_pg, mode=ALL_REDUCE, bias=False, contiguous_chunks=(q, kv, kv)
        )
        self.o_proj = TensorParallelRowLinear(q, cfg.hidden_size, pg=tp_pg, mode=ALL_REDUCE, bias=False)

    def forward(self, x, positions):  # x [S, B, H] -> [S, B, H]
        s, b, _ = x.shape
        d = self.head_dim
        q, k, v = self.qkv_proj(x).split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q = rotate_interleaved(q.reshape(s, b, self.heads, d), positions, self.theta)
        k = rotate_interleaved(k.reshape(s, b, self.kv_heads, d), positions, self.theta)
        v = v.reshape(s, b, self.kv_heads, d)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [B, heads, S, d]
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(att.permute(2, 0, 1, 3).reshape(s, b, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ToyConfig, tp_pg):
        super().__init__()
        i = cfg.intermediate_size
        self.gate_up_proj = TensorParallelColumnLinear(
            cfg.hidden_size, 2 * i, pg=tp_pg, mode=ALL_REDUCE, bias=False, contiguous_chunks=(i, i)
        )
        self.down_proj = TensorParallelRowLinear(i, cfg.hidden_size, pg=tp_pg, mode=ALL_REDUCE, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ToyConfig, tp_pg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, tp_pg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp_pg)

    def forward(self, hidden_states, positions):
        x = hidden_states + self.attn(self.input_layernorm(hidden_states)["hidden_states"], positions)
        x = x + self.mlp(self.post_attention_layernorm(x)["hidden_states"])
        return {"hidden_states": x, "positions": positions}


class ToyLlamaModel(nn.Module):
    """Embedding on the first pipeline stage, layers spread evenly, norm + LM head on the last stage."""

    def __init__(self, cfg: ToyConfig, parallel_context, device=torch.device("cpu")):
        super().__init__()
        tp_pg, pp = parallel_context.tp_pg, parallel_context.pp_pg.size()
        p2p = P2P(parallel_context.pp_pg, device=device)
        entry, key = (EmbeddingWithPositionIds, "position_ids") if cfg.position_ids_input else (Embedding, "input_mask")
        kw = dict(cfg=cfg, tp_pg=tp_pg)
        self.token_position_embeddings = PipelineBlock(p2p, entry, kw, {"input_ids", key}, {"hidden_states", "positions"})
        both = {"hidden_states", "positions"}
        self.decoder = nn.ModuleList(PipelineBlock(p2p, DecoderLayer, kw, both, both) for _ in range(cfg.num_hidden_layers))
        norm_kw = dict(hidden_size=cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.final_layer_norm = PipelineBlock(p2p, RMSNorm, norm_kw, {"input"}, {"hidden_states"})
        head_kw = dict(in_features=cfg.hidden_size, out_features=cfg.vocab_size, pg=tp_pg, mode=ALL_REDUCE, bias=False)
        self.lm_head = PipelineBlock(p2p, TensorParallelColumnLinear, head_kw, {"x"}, {"logits"})
        self.token_position_embeddings.build_and_set_rank(0)
        for i, layer in enumerate(self.decoder):
            layer.build_and_set_rank(i * pp // cfg.num_hidden_layers)
        self.final_layer_norm.build_and_set_rank(pp - 1)
        self.lm_head.build_and_set_rank(pp - 1)

    def forward(self, input_ids, input_mask):
        """[B, S] inputs on the first stage (TensorPointer elsewhere) -> fp32 logits [S, B, V/tp] on the last."""
        return self._run(self.token_position_embeddings(input_ids=input_ids, input_mask=input_mask))

    def _run(self, state):
        for layer in self.decoder:
            state = layer(hidden_states=state["hidden_states"], positions=state["positions"])
        hidden = self.final_layer_norm(input=state["hidden_states"])["hidden_states"]
        logits = self.lm_head(x=hidden)["logits"]
        return logits if not isinstance(logits, torch.Tensor) else logits.float()


class ToyQwenStyleModel(ToyLlamaModel):
    """The same model with nanotron main's Qwen2 calling convention: forward(input_ids, position_ids)."""

    def forward(self, input_ids, position_ids):
        return self._run(self.token_position_embeddings(input_ids=input_ids, position_ids=position_ids))


class ToyLlamaForTraining(nn.Module):
    """The wrapper nanotron's trainer holds (`.model` is the LlamaModel); checkpoint names start with `model.`."""

    def __init__(self, cfg: ToyConfig, parallel_context):
        super().__init__()
        self.config = cfg
        self.model = (ToyQwenStyleModel if cfg.position_ids_input else ToyLlamaModel)(cfg, parallel_context)


def _seeded_normal(shape, name: str, seed: int) -> torch.Tensor:
    digest = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")
    return torch.randn(shape, generator=torch.Generator().manual_seed(digest)) * 0.2


@torch.no_grad()
def init_weights(model: nn.Module, seed: int = 0) -> None:
    """Fill every parameter from its full (unsharded) tensor, drawn from (seed, name): same model in every layout."""
    for name, param in model.named_parameters():
        if "norm" in name:
            param.copy_(1.0 + 0.1 * _seeded_normal(param.shape, name, seed))
        elif isinstance(param, NanotronParameter) and param.is_sharded:
            info = param.get_sharded_info()
            full = _seeded_normal(info.unsharded_shape, name, seed)
            for pair in info.local_global_slices_pairs:
                param[pair.local_slices] = full[pair.global_slices]
        else:
            param.copy_(_seeded_normal(param.shape, name, seed))


def tie_replicated_parameters(model: nn.Module, parallel_context) -> None:
    """Mark parameters that every TP rank holds whole as tied across TP, as nanotron's trainer does, so that
    nanotron's save_weights writes them once."""
    tp_ranks = tuple(sorted(ndist.get_process_group_ranks(parallel_context.tp_pg)))
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if isinstance(param, NanotronParameter) and (param.is_sharded or param.is_tied):
                continue
            tie_parameters(model, [(f"{module_name}.{param_name}", tp_ranks)], parallel_context, reduce_op=None)
    create_pg_for_tied_weights(model, parallel_context)


def build_toy_nanotron_model(parallel_context, cfg: ToyConfig = ToyConfig(), seed: int = 0) -> ToyLlamaForTraining:
    model = ToyLlamaForTraining(cfg, parallel_context)
    init_weights(model, seed)
    tie_replicated_parameters(model, parallel_context)
    return model
