"""A small Llama-style GPT built from megatron-core's own tensor-parallel layers, for tests and CPU examples.

megatron-core's GPTModel needs CUDA to run. This model runs on CPU/gloo and mirrors it where it matters:
- building blocks: VocabParallelEmbedding, ColumnParallelLinear, RowParallelLinear (RMSNorm, RoPE and causal
  attention are written in torch);
- state-dict names of GPTModel with the Transformer Engine layer spec (`embedding.word_embeddings.weight`,
  `decoder.layers.{i}.self_attention.linear_qkv.{weight,layer_norm_weight}`, `...linear_proj.weight`,
  `mlp.linear_fc1.{weight,layer_norm_weight}`, `mlp.linear_fc2.weight`, `decoder.final_layernorm.weight`,
  `output_layer.weight`);
- Megatron's sharding: linear_qkv rows grouped per query group ([q heads of group g | k_g | v_g] for each g) and
  split over TP by whole groups; linear_fc1 holds [gate shard | up shard] on each TP rank (swiglu);
  RoPE rotates halves (Megatron's default, rotary_interleaved=False);
- the call convention: `model(input_ids [B, S], position_ids [B, S], attention_mask [1, 1, S, S] bool, True =
  masked)` returns fp32 logits `[B, S, V/tp]` (parallel_output=True); `.config` is a TransformerConfig.
Weights are a pure function of (seed, logical name), built full on every rank and sliced: every TP layout holds
the same model, and `logical_weights` gives the same tensors with transformers' Llama names.
"""

from __future__ import annotations

import hashlib
from argparse import Namespace
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nano_eval.compat.megatron import import_megatron_core

import_megatron_core()

from megatron.core import parallel_state  # noqa: E402
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402


@dataclass(frozen=True)
class ToyConfig:
    vocab_size: int = 544  # padded vocabulary (>= the toy tokenizer's 537), divisible by tp
    hidden_size: int = 64
    ffn_hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: int = 2  # must divide by tp
    num_layers: int = 2
    max_position_embeddings: int = 128
    norm_epsilon: float = 1e-6
    rotary_base: float = 10000.0

    @property
    def kv_channels(self) -> int:
        return self.hidden_size // self.num_attention_heads


def megatron_args(cfg: ToyConfig, tp: int = 1, pp: int = 1) -> Namespace:
    """The subset of Megatron-LM's training arguments (as pickled into `model_optim_rng.pt`) that describes it."""
    return Namespace(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, group_query_attention=True,
        num_query_groups=cfg.num_query_groups, kv_channels=cfg.kv_channels,
        max_position_embeddings=cfg.max_position_embeddings, seq_length=cfg.max_position_embeddings,
        padded_vocab_size=cfg.vocab_size, normalization="RMSNorm", norm_epsilon=cfg.norm_epsilon, swiglu=True,
        position_embedding_type="rope", rotary_base=cfg.rotary_base, rotary_percent=1.0, rotary_interleaved=False,
        untie_embeddings_and_output_weights=True, add_bias_linear=False, add_qkv_bias=False, qk_layernorm=False,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, params_dtype=torch.float32,
        global_batch_size=8, micro_batch_size=2, ckpt_format="torch",
    )


def transformer_config(cfg: ToyConfig, tp: int) -> TransformerConfig:
    return TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.kv_channels, normalization="RMSNorm", layernorm_epsilon=cfg.norm_epsilon,
        gated_linear_unit=True, add_bias_linear=False, tensor_model_parallel_size=tp, use_cpu_initialization=True,
        params_dtype=torch.float32,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def rotate_half(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Megatron's default RoPE: x [S, B, heads, d] rotated as halves (x[i], x[i + d/2]); positions [S, B]."""
    d = x.shape[-1]
    freqs = base ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions[..., None, None].float() * torch.cat((freqs, freqs))  # [S, B, 1, d]
    x1, x2 = x.float().chunk(2, dim=-1)
    return (x.float() * angles.cos() + torch.cat((-x2, x1), dim=-1) * angles.sin()).to(x.dtype)


class LayerNormColumnParallelLinear(ColumnParallelLinear):
    """RMSNorm fused in front of a column-parallel linear, as Transformer Engine's layer of that name (its norm
    weight is saved as `<name>.layer_norm_weight`)."""

    def __init__(self, input_size: int, output_size: int, *, eps: float, config: TransformerConfig):
        super().__init__(input_size, output_size, config=config, init_method=nn.init.zeros_, bias=False,
                         gather_output=False)
        self.layer_norm_weight, self.eps = nn.Parameter(torch.ones(input_size)), eps

    def forward(self, x):
        return super().forward(rms_norm(x, self.layer_norm_weight, self.eps))


class SelfAttention(nn.Module):
    def __init__(self, cfg: ToyConfig, config: TransformerConfig, tp: int):
        super().__init__()
        d, nq, ng = cfg.kv_channels, cfg.num_attention_heads, cfg.num_query_groups
        self.groups, self.q_per_group, self.d, self.base = ng // tp, nq // ng, d, cfg.rotary_base
        self.linear_qkv = LayerNormColumnParallelLinear(cfg.hidden_size, (nq + 2 * ng) * d, eps=cfg.norm_epsilon,
                                                        config=config)
        self.linear_proj = RowParallelLinear(nq * d, cfg.hidden_size, config=config, init_method=nn.init.zeros_,
                                             bias=False, input_is_parallel=True, skip_bias_add=True)

    def forward(self, x, positions, attention_mask):  # x [S, B, H] -> [S, B, H]
        s, b, _ = x.shape
        d, g, qg = self.d, self.groups, self.q_per_group
        qkv, _ = self.linear_qkv(x)
        q, k, v = qkv.view(s, b, g, (qg + 2) * d).split([qg * d, d, d], dim=-1)  # per query group, as Megatron
        q = rotate_half(q.reshape(s, b, g * qg, d), positions, self.base)
        k = rotate_half(k, positions, self.base)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [B, heads, S, d]
        keep = None if attention_mask is None else ~attention_mask
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=keep is None, enable_gqa=True)
        out, _ = self.linear_proj(att.permute(2, 0, 1, 3).reshape(s, b, -1))
        return out


class MLP(nn.Module):
    def __init__(self, cfg: ToyConfig, config: TransformerConfig):
        super().__init__()
        self.linear_fc1 = LayerNormColumnParallelLinear(cfg.hidden_size, 2 * cfg.ffn_hidden_size,
                                                        eps=cfg.norm_epsilon, config=config)
        self.linear_fc2 = RowParallelLinear(cfg.ffn_hidden_size, cfg.hidden_size, config=config,
                                            init_method=nn.init.zeros_, bias=False, input_is_parallel=True,
                                            skip_bias_add=True)

    def forward(self, x):
        gate, up = self.linear_fc1(x)[0].chunk(2, dim=-1)  # this rank's [gate shard | up shard]
        return self.linear_fc2(F.silu(gate) * up)[0]


class TransformerLayer(nn.Module):
    def __init__(self, cfg: ToyConfig, config: TransformerConfig, tp: int):
        super().__init__()
        self.self_attention = SelfAttention(cfg, config, tp)
        self.mlp = MLP(cfg, config)

    def forward(self, x, positions, attention_mask):
        x = x + self.self_attention(x, positions, attention_mask)
        return x + self.mlp(x)


class Embedding(nn.Module):
    def __init__(self, cfg: ToyConfig, config: TransformerConfig):
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, init_method=nn.init.zeros_,
                                                      config=config)


class Decoder(nn.Module):
    def __init__(self, cfg: ToyConfig, config: TransformerConfig, tp: int):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(cfg, config, tp) for _ in range(cfg.num_layers))
        self.final_layernorm = nn.Module()
        self.final_layernorm.weight = nn.Parameter(torch.ones(cfg.hidden_size))


class ToyGPTModel(nn.Module):
    """One pipeline stage holding the whole model (pp = 1); GPTModel's forward convention and parameter names."""

    parallel_output = True

    def __init__(self, cfg: ToyConfig):
        super().__init__()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.cfg, self.config = cfg, transformer_config(cfg, tp)
        self.max_sequence_length = cfg.max_position_embeddings  # GPTModel's attribute of that name
        self.embedding = Embedding(cfg, self.config)
        self.decoder = Decoder(cfg, self.config, tp)
        self.output_layer = ColumnParallelLinear(cfg.hidden_size, cfg.vocab_size, config=self.config,
                                                 init_method=nn.init.zeros_, bias=False, gather_output=False)

    def forward(self, input_ids, position_ids, attention_mask=None):
        """input_ids, position_ids [B, S]; attention_mask [1 or B, 1, S, S] bool (True = masked) or None (causal).
        Returns fp32 logits [B, S, V/tp]."""
        x = self.embedding.word_embeddings(input_ids.transpose(0, 1))  # [S, B, H]
        positions = position_ids.transpose(0, 1)
        for layer in self.decoder.layers:
            x = layer(x, positions, attention_mask)
        x = rms_norm(x, self.decoder.final_layernorm.weight, self.cfg.norm_epsilon)
        logits, _ = self.output_layer(x)
        return logits.float().transpose(0, 1).contiguous()


def _seeded_normal(shape, name: str, seed: int, scale: float = 0.2) -> torch.Tensor:
    digest = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")
    return torch.randn(shape, generator=torch.Generator().manual_seed(digest)) * scale


def logical_weights(cfg: ToyConfig, seed: int = 0) -> dict[str, torch.Tensor]:
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


def megatron_shard(w: dict[str, torch.Tensor], cfg: ToyConfig, tp_rank: int, tp: int) -> dict[str, torch.Tensor]:
    """TP rank `tp_rank`'s GPTModel state dict (TE names) for the logical weights `w`."""
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
                dst + "self_attention.linear_qkv.layer_norm_weight": w[src + "input_layernorm.weight"],
                dst + "self_attention.linear_proj.weight": cols(w[src + "self_attn.o_proj.weight"]),
                dst + "mlp.linear_fc1.weight": torch.cat([gate, up]),
                dst + "mlp.linear_fc1.layer_norm_weight": w[src + "post_attention_layernorm.weight"],
                dst + "mlp.linear_fc2.weight": cols(w[src + "mlp.down_proj.weight"])}
    return out


def build_toy_megatron_model(cfg: ToyConfig = ToyConfig(), seed: int = 0) -> ToyGPTModel:
    """The toy model on this rank's TP shard; parallel_state must be initialised (tp from it, pp must be 1)."""
    if parallel_state.get_pipeline_model_parallel_world_size() != 1:
        raise ValueError("the toy Megatron model is one pipeline stage; initialise parallel_state with pp=1")
    model = ToyGPTModel(cfg)
    tp, rank = model.config.tensor_model_parallel_size, parallel_state.get_tensor_model_parallel_rank()
    missing, unexpected = model.load_state_dict(megatron_shard(logical_weights(cfg, seed), cfg, rank, tp), strict=False)
    missing = [m for m in missing if not m.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"toy Megatron weights do not fit: missing {missing}, unexpected {unexpected}")
    return model.eval()
