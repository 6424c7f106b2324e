"""A KV cache for nanotron main's Qwen2 (the SmolLM3 code), which has no inference path of its own.

nanotron main's Qwen2Model only has its training forward: flattened `[B * S]` tokens, flash-attn's varlen kernel
over documents that start wherever a position id is 0. Greedy generation on it would re-run the prompt for every
new token (nano_eval.generate). `Qwen2Cache` runs the model's OWN modules one step at a time instead, in the
model's TP x PP layout, and keeps each layer's rotated keys and values:

- the token embedding (vocab-parallel, TP all-reduce), then for each Qwen2DecoderLayer on this pipeline stage: its
  input norm, its fused qkv projection (column-parallel: this rank's q / k / v heads, with the qkv bias when the
  model has one), its RoPE module (`attn.rotary_emb`, flash-attn's RotaryEmbedding as nanotron subclasses it,
  with nanotron's cos/sin table, interpolation factor included) rotating q and k in place at each token's own
  position (skipped in no-RoPE layers, `(layer + 1) % no_rope_layer == 0`, as the model does), attention of the
  new tokens over the cached keys / values plus their own (below), o_proj (row-parallel, TP all-reduce), the
  post-attention norm and the layer's MLP module as is (dense or MoE: both work token by token), the residuals as
  the layer adds them; then the final norm and lm_head (vocab-parallel logits) of the LAST new column only;
- between stages the hidden states move with the model's own P2P (`model.p2p`), in the order of its blocks; every
  rank of the replica gets the same ids / mask (the KVCache protocol), so no stage needs more than the states.

Attention reproduces what the training forward gives a row that is its own document (the backend's scoring
layout, nano_eval.backends.nanotron): causal over the row's real tokens, RoPE position of a token = number of real
tokens before it (`cumsum(real) - 1`), and with `sliding_window_size: w` a token sees itself and the w - 1 real
tokens before it (flash-attn's window (w - 1, 0); nanotron drops the window in no-RoPE layers, and so do we). It
runs in torch's scaled_dot_product_attention with a boolean mask, in fp32 (flash-attn's kernel accumulates in
fp32 too; the output is cast back to the model's dtype), grouped-query heads repeated to the query heads: the same
sums as flash-attn's up to float rounding (bf16, CPU: logits within 0.02 of the scoring forward; the model's dtype
throughout gave 0.13, MoE 0.47 through a routing flip). Padding (left padding of prompts, padding in the middle
after a shared prefix) is masked out as a key; a padding query sees itself too, so no softmax row is empty (its
output is never used).

Memory: the cache holds rows x columns (the driver's longest prompt + max_new_tokens) x kv_heads/tp x head_dim keys
and values per layer of this stage, in the model's dtype; each layer's attention makes transient fp32 copies with
the query heads' count. The RoPE module's own cos/sin table grows to `columns` positions if it was shorter (as a
longer training sequence grows it; the values of the shorter table are unchanged, so training is not affected).

Not used (the prompt is re-run per token; `unsupported_reason` says why): tp_mode REDUCE_SCATTER (the states
between TP ranks are split along the tokens, which a one-token step cannot split), a model whose attention is not
the packed qkv path (nanotron main's only working one).
Context parallelism needs nothing: the cache never rings, each CP rank decodes its own rows as a data-parallel
rank (the backend's `dp_cp_pg` layout).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nano_eval.decoder import positions as token_positions


def unsupported_reason(backend) -> str | None:
    """Why `backend` (a NanotronModel on nanotron main's Qwen2Model) cannot decode from `Qwen2Cache`; None when it
    can. Depends only on the model's config and layout, so every rank gets the same answer."""
    if backend.seq_multiple > 1:
        return "tp_mode REDUCE_SCATTER"
    if not getattr(backend.forward_module.config, "_use_qkv_packed", True):
        return "the Qwen2 attention is not nanotron's packed-qkv path (_use_qkv_packed: false)"
    return None


class Qwen2Cache:
    """nanotron main's Qwen2Model behind the KVCache protocol (nano_eval.decoder): one batch of rows' keys and
    values for this rank's layers (its pipeline stage, its TP share of the kv heads).

    Every rank of the model replica calls allocate / select_rows / run with the same arguments; `run` returns the
    vocab-parallel logits [b, V/tp] of the last new column on the stage holding lm_head, None elsewhere.
    """

    multi_token_extend = True  # any number of new columns onto a non-empty cache (a shared prompt prefix)

    def __init__(self, backend):
        model = backend.forward_module
        self.model, self.device = model, backend.device
        self.config = model.config
        self.pp_rank = dist.get_rank(model.p2p.pg) if dist.is_initialized() else 0
        # the model's blocks in forward order: (kind, PipelineBlock, layer index)
        self.blocks = ([("embed", model.token_position_embeddings, None)]
                       + [("layer", block, i) for i, block in enumerate(model.decoder)]
                       + [("norm", model.final_layer_norm, None), ("head", model.lm_head, None)])
        self.keys: dict[int, torch.Tensor] = {}  # layer index -> [rows, columns, kv_heads/tp, head_dim]
        self.values: dict[int, torch.Tensor] = {}
        self.length = self.columns = self.rows = 0

    def allocate(self, rows: int, columns: int) -> None:
        """An empty cache of up to `columns` columns; the tensors are made by the first `run` (or `write_rows`), for
        its rows (the driver may prefill a shared prefix as one row and copy it to `rows` rows)."""
        self.length, self.columns, self.rows = 0, columns, rows
        self.keys, self.values = {}, {}

    def select_rows(self, index: torch.Tensor, start: int = 0, columns: int | None = None) -> None:
        """Keep rows `index` (in that order, repeats allowed) of every cache, columns from `start` on moved to the
        front; `columns`: the new room per row."""
        self.columns = columns or self.columns
        for cache in (self.keys, self.values):
            for i, tensor in cache.items():
                kept = tensor.index_select(0, index.to(tensor.device))[:, start:self.length]
                cache[i] = kept.new_zeros((len(index), self.columns, *kept.shape[2:]))
                cache[i][:, : kept.shape[1]] = kept
        self.length -= start
        self.rows = len(index)

    def write_rows(self, slots: torch.Tensor, source: Qwen2Cache | None, rows: torch.Tensor | None = None,
                   columns: int | None = None) -> None:
        """Rows `slots` become `source`'s rows `rows`: its last `columns` columns into this cache's last ones
        (grown in front when it holds fewer), the slots' earlier columns zero. Keys are stored after RoPE at each
        token's own position (real tokens before it), which does not change with the column. source None: nothing to
        do (the next run's `real` makes the slots' old columns padding)."""
        if source is None:
            return
        if not self.keys:
            self._make(self.rows)
        n = source.length if columns is None else columns
        grow = max(0, n - self.length)
        rows = torch.arange(len(slots)) if rows is None else rows
        for mine, theirs in ((self.keys, source.keys), (self.values, source.values)):
            for i, tensor in mine.items():
                if grow:
                    tensor[:, grow:grow + self.length] = tensor[:, : self.length].clone()
                    tensor[:, :grow] = 0
                end = self.length + grow
                at = slots.to(tensor.device)
                tensor[at, : end - n] = 0
                tensor[at, end - n:end] = theirs[i][rows.to(tensor.device), source.length - n:source.length]
        self.length += grow

    @torch.no_grad()
    def run(self, ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor | None:
        """Write the n new columns `ids` [b, n] into the caches; `real` [b, S] marks the tokens of every column so
        far, the new ones included. Logits [b, V/tp] at the last new column on lm_head's stage, None elsewhere."""
        b, n = ids.shape
        total = real.shape[1]
        rows = next(iter(self.keys.values())).shape[0] if self.keys else b
        if total != self.length + n or rows != b:  # the driver's capacity check comes first (nano_eval.decoder)
            raise RuntimeError(f"Qwen2 KV cache of {rows} rows: {b} rows of {n} new columns onto {self.length} "
                               f"({total} in the mask)")
        if self.length == 0:
            self._make(b)
        real = real.to(self.device)
        positions = token_positions(real)  # RoPE position of each column: the real tokens before it
        masks = self._masks(real, positions, n)
        new_positions = positions[:, -n:].reshape(-1).to(torch.int32)
        p2p, holder, states, logits = self.model.p2p, self.blocks[0][1].rank, None, None
        for kind, block, i in self.blocks:
            if block.rank != holder:  # the states move to the next stage, as the model's own P2P moves them
                if self.pp_rank == holder:
                    p2p.send_tensors([states.contiguous()], to_rank=block.rank)
                elif self.pp_rank == block.rank:
                    states = p2p.recv_tensors(num_tensors=1, from_rank=holder)[0]
                holder = block.rank
            if self.pp_rank != block.rank:
                continue
            module = block.pp_block
            if kind == "embed":
                states = module(input_ids=ids.to(self.device), position_ids=None)["input_embeds"]  # [b * n, H]
            elif kind == "layer":
                states = self._layer(i, module, states, new_positions, masks, b, n)
            elif kind == "norm":
                states = module(states.view(b, n, -1)[:, -1].contiguous())  # only the last column's logits are needed
            else:
                logits = module(states)  # [b, V/tp]
        self.length = total
        return logits

    def _make(self, rows: int) -> None:
        """Zero keys / values [rows, columns, kv_heads/tp, head_dim] for this stage's layers, in the model's dtype."""
        for kind, block, i in self.blocks:
            if kind == "layer" and hasattr(block, "pp_block"):
                attn = block.pp_block.attn
                weight = attn.qkv_proj.weight
                shape = (rows, self.columns, attn.local_num_kv_heads, attn.head_dim)
                self.keys[i] = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
                self.values[i] = torch.zeros_like(self.keys[i])

    def _masks(self, real: torch.Tensor, positions: torch.Tensor, n: int) -> dict:
        """{window or None: boolean mask [b, 1, n, S]}: which columns each new column attends to (module
        docstring), for full-attention layers and, with a sliding window, for the windowed ones."""
        total = real.shape[1]
        columns = torch.arange(total, device=real.device)
        query_columns = columns[-n:]
        causal = columns[None, :] <= query_columns[:, None]  # [n, S]
        itself = (columns[None, :] == query_columns[:, None])[None]
        visible = real[:, None, :] & causal[None]  # [b, n, S]
        masks = {None: (visible | itself)[:, None]}
        window = self.config.sliding_window_size
        if window is not None:
            distance = positions[:, -n:, None] - positions[:, None, :]  # [b, n, S]
            masks[window] = ((visible & (distance < window)) | itself)[:, None]
        return masks

    def _layer(self, index: int, layer, states: torch.Tensor, positions: torch.Tensor, masks: dict, b: int,
               n: int) -> torch.Tensor:
        """One Qwen2DecoderLayer on the new columns' states [b * n, H], through its own modules (module docstring)."""
        attn = layer.attn
        heads, kv_heads, head_dim = attn.local_num_heads, attn.local_num_kv_heads, attn.head_dim
        residual = states
        qkv = attn.qkv_proj(layer.input_layernorm(states))  # [b * n, (heads + 2 * kv_heads) * head_dim] on this rank
        q = qkv[..., :attn.local_q_size].view(b * n, 1, heads, head_dim)  # each token its own sequence of one,
        kv = qkv[..., attn.local_q_size:].view(b * n, 1, 2, kv_heads, head_dim)  # at its own position
        no_rope = self.config.no_rope_layer is not None and (index + 1) % self.config.no_rope_layer == 0
        if not no_rope:
            q, kv = attn.rotary_emb(q, kv, seqlen_offset=positions, max_seqlen=self.columns)  # in place
        start = self.length
        self.keys[index][:, start:start + n] = kv[:, 0, 0].view(b, n, kv_heads, head_dim)
        self.values[index][:, start:start + n] = kv[:, 0, 1].view(b, n, kv_heads, head_dim)
        group = heads // kv_heads  # query head h reads kv head h // group, as flash-attn's GQA does

        def heads_first(cache):  # [b, S, kv_heads, d] -> [b, heads, S, d], fp32
            return cache[:, :start + n].transpose(1, 2).float().repeat_interleave(group, dim=1)

        mask = masks[None if no_rope else self.config.sliding_window_size]
        out = F.scaled_dot_product_attention(q.view(b, n, heads, head_dim).transpose(1, 2).float(),
                                             heads_first(self.keys[index]), heads_first(self.values[index]),
                                             attn_mask=mask)  # [b, heads, n, d]; scale head_dim ** -0.5
        out = out.to(qkv.dtype).transpose(1, 2).reshape(b * n, heads * head_dim)
        states = attn.o_proj(out) + residual
        residual = states
        return layer.mlp(hidden_states=layer.post_attention_layernorm(states))["hidden_states"] + residual
