"""A small causal LM built from nanotron's own parallel modules, for tests and CPU examples.

nanotron's Llama needs flash-attn and CUDA, so it cannot run on CPU. This model uses the same building blocks
(TensorParallelEmbedding, column/row linears, PipelineBlock + P2P + TensorPointer, a vocab-parallel LM head) and
the same calling convention as nanotron's LlamaModel: `model(input_ids [B, S], input_mask [B, S])` returns fp32
vocab-sharded logits `[S, B, V/tp]` on the last pipeline stage and a TensorPointer elsewhere.

Weights are a pure function of (seed, parameter name), so every TP/PP/DP layout holds the same model.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

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
    vocab_size: int = 512  # must divide by tp
    hidden: int = 64
    heads: int = 4  # must divide by tp
    layers: int = 4
    max_position_embeddings: int = 128
    position_ids_input: bool = False  # True: forward(input_ids, position_ids) like nanotron main's Qwen2


class Embedding(nn.Module):
    def __init__(self, cfg: ToyConfig, tp_pg):
        super().__init__()
        self.token = TensorParallelEmbedding(cfg.vocab_size, cfg.hidden, pg=tp_pg, mode=ALL_REDUCE)
        self.position = nn.Embedding(cfg.max_position_embeddings, cfg.hidden)

    def forward(self, input_ids, input_mask):  # [B, S] -> hidden [S, B, H]
        ids = input_ids.transpose(0, 1)
        positions = torch.arange(ids.shape[0], device=ids.device)
        return {"hidden_states": self.token(ids) + self.position(positions)[:, None, :]}


class EmbeddingWithPositionIds(Embedding):
    """Qwen2-style entry (nanotron main): positions come in as `position_ids` [B, S] instead of a mask."""

    def forward(self, input_ids, position_ids):  # [B, S] -> hidden [S, B, H]
        ids, positions = input_ids.transpose(0, 1), position_ids.transpose(0, 1)
        return {"hidden_states": self.token(ids) + self.position(positions)}


class DecoderLayer(nn.Module):
    """Pre-norm causal self-attention and MLP; heads and MLP columns are split over the TP group."""

    def __init__(self, cfg: ToyConfig, tp_pg):
        super().__init__()
        h, tp = cfg.hidden, tp_pg.size()
        self.local_heads, self.head_dim = cfg.heads // tp, h // cfg.heads
        self.norm1, self.norm2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv = TensorParallelColumnLinear(h, 3 * h, pg=tp_pg, mode=ALL_REDUCE, bias=False, contiguous_chunks=(h, h, h))
        self.out = TensorParallelRowLinear(h, h, pg=tp_pg, mode=ALL_REDUCE, bias=False)
        self.up = TensorParallelColumnLinear(h, 4 * h, pg=tp_pg, mode=ALL_REDUCE, bias=False)
        self.down = TensorParallelRowLinear(4 * h, h, pg=tp_pg, mode=ALL_REDUCE, bias=False)

    def forward(self, hidden_states):  # [S, B, H] -> [S, B, H]
        s, b, _ = hidden_states.shape
        q, k, v = self.qkv(self.norm1(hidden_states)).chunk(3, dim=-1)  # each [S, B, H/tp]
        q, k, v = (t.reshape(s, b, self.local_heads, self.head_dim).permute(1, 2, 0, 3) for t in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, heads/tp, S, d]
        x = hidden_states + self.out(att.permute(2, 0, 1, 3).reshape(s, b, -1))
        return {"hidden_states": x + self.down(F.gelu(self.up(self.norm2(x))))}


class LMHead(nn.Module):
    def __init__(self, cfg: ToyConfig, tp_pg):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.hidden)
        self.proj = TensorParallelColumnLinear(cfg.hidden, cfg.vocab_size, pg=tp_pg, mode=ALL_REDUCE, bias=False)

    def forward(self, hidden_states):  # [S, B, H] -> fp32 logits [S, B, V/tp]
        return {"logits": self.proj(self.norm(hidden_states)).float()}


class ToyNanotronLM(nn.Module):
    """Embedding on the first pipeline stage, layers spread evenly, LM head on the last stage."""

    def __init__(self, cfg: ToyConfig, parallel_context, device=torch.device("cpu")):
        super().__init__()
        self.config = cfg
        tp_pg, pp_pg = parallel_context.tp_pg, parallel_context.pp_pg
        pp = pp_pg.size()
        p2p = P2P(pp_pg, device=device)
        entry, keys = (EmbeddingWithPositionIds, "position_ids") if cfg.position_ids_input else (Embedding, "input_mask")
        self.embed = PipelineBlock(p2p, entry, dict(cfg=cfg, tp_pg=tp_pg), {"input_ids", keys}, {"hidden_states"})
        self.layers = nn.ModuleList(
            PipelineBlock(p2p, DecoderLayer, dict(cfg=cfg, tp_pg=tp_pg), {"hidden_states"}, {"hidden_states"})
            for _ in range(cfg.layers)
        )
        self.head = PipelineBlock(p2p, LMHead, dict(cfg=cfg, tp_pg=tp_pg), {"hidden_states"}, {"logits"})
        self.embed.build_and_set_rank(0)
        for i, layer in enumerate(self.layers):
            layer.build_and_set_rank(i * pp // cfg.layers)
        self.head.build_and_set_rank(pp - 1)
        self.output_pp_rank = pp - 1

    def forward(self, input_ids, input_mask):
        """input_ids, input_mask: [B, S] on the first stage (TensorPointer elsewhere) -> logits [S, B, V/tp]."""
        return self._run(self.embed(input_ids=input_ids, input_mask=input_mask)["hidden_states"])

    def _run(self, hidden):
        for layer in self.layers:
            hidden = layer(hidden_states=hidden)["hidden_states"]
        return self.head(hidden_states=hidden)["logits"]


class ToyQwenStyleLM(ToyNanotronLM):
    """The same model with nanotron main's Qwen2 calling convention: forward(input_ids, position_ids)."""

    def forward(self, input_ids, position_ids):
        return self._run(self.embed(input_ids=input_ids, position_ids=position_ids)["hidden_states"])


def _seeded_normal(shape, name: str, seed: int) -> torch.Tensor:
    digest = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")
    return torch.randn(shape, generator=torch.Generator().manual_seed(digest)) * 0.2


@torch.no_grad()
def init_weights(model: nn.Module, seed: int = 0) -> None:
    """Fill every parameter from its full (unsharded) tensor, drawn from (seed, name): same model in every layout."""
    for name, param in model.named_parameters():
        if name.endswith(".weight") and ".norm" in name:
            param.fill_(1.0)
            continue
        if name.endswith(".bias"):
            param.zero_()
            continue
        if isinstance(param, NanotronParameter) and param.is_sharded:
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


def build_toy_nanotron_model(parallel_context, cfg: ToyConfig = ToyConfig(), seed: int = 0) -> ToyNanotronLM:
    model = (ToyQwenStyleLM if cfg.position_ids_input else ToyNanotronLM)(cfg, parallel_context)
    init_weights(model, seed)
    tie_replicated_parameters(model, parallel_context)
    return model
