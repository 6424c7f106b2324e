"""Greedy decoding from nanotron 0.4's own KV cache, in the model's TP x PP layout (see nano_eval.generate).

nanotron 0.4's Llama has an inference path: with a `Store` attached (nanotron.generation.generate_store), each
`CausalSelfAttention` keeps its keys and values `[b, max_position_embeddings, kv_heads/tp, head_dim]` and each
row's position offset; the prefill runs `flash_attn_varlen_func` on the unpadded prompts (pads must be on the
left) and moves them into the cache; every later step appends one token per row with `flash_attn_with_kvcache`
at that row's own length. So each row sees exactly its own tokens at its own positions. `StoreCache` drives it
the way the backend's scoring forward drives the model (inputs on the first stage, TensorPointers elsewhere, the
model's P2P between stages), keeps the logits of the last column `[b, V/tp]` on the last stage, and drops
finished rows from every stored tensor (batch is their first dimension). nano_eval.decoder.CacheDecoder keeps the
rows' bookkeeping.

Memory: nanotron sizes each layer's cache to `prefill_kv_len` columns per row and its RoPE table to
`rotary_embedding.end` positions (both max_position_embeddings); the decoding asserts they are equal. While the
decoder runs the model, both are set to the batch's longest prompt + max_new_tokens (and restored after each call),
so a batch's cache is rows x (longest prompt + answer) columns: inside the engine's --batch-tokens budget, not
rows x max_position_embeddings. The RoPE table of those positions holds the same values as nanotron's own.
Costs: the prefill projects every prompt position through lm_head, as the scoring forward does.
flash-attn >= 2.6 returns 5 values from `unpad_input`, which nanotron 0.4's prefill unpacks into 4:
nano_eval.compat.nanotron.four_value_unpad_input adapts it. The inference path rotates q/k with nanotron's complex-
valued RotaryEmbedding instead of the training path's flash-attn rotary kernel: the same interleaved rotation,
equal up to float rounding. Not used (the prompt is re-run per token, `unsupported_reason` says why) for
`tp_mode: REDUCE_SCATTER` (one token per step cannot be split along the sequence over TP ranks), a max_length
past max_position_embeddings (positions the model was not built for), or a model other than nanotron's LlamaModel.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from nano_eval.compat.nanotron import four_value_unpad_input

_COLUMNS = ("key", "value")  # stored tensors [rows, room, kv_heads/tp, head_dim]; the others are [rows]


def unsupported_reason(backend) -> str | None:
    """Why `backend` (a NanotronModel) cannot decode from nanotron's KV cache; None when it can. Depends only on
    the model's class and config, so every rank gets the same answer."""
    from nanotron.generation.generate_store import AttachableStore
    from nanotron.models.llama import CausalSelfAttention, LlamaModel

    if not isinstance(backend.forward_module, LlamaModel):
        return f"{type(backend.forward_module).__name__} is not nanotron 0.4's LlamaModel"
    if not issubclass(CausalSelfAttention, AttachableStore):
        return "this nanotron's attention has no inference store"
    if backend.seq_multiple > 1:
        return "tp_mode REDUCE_SCATTER"
    columns = backend.forward_module.config.max_position_embeddings
    if backend.max_length > columns:
        return f"max_length {backend.max_length} > max_position_embeddings {columns}"
    return None


class StoreCache:
    """nanotron's inference Store for one batch of rows (the KVCache of nano_eval.decoder).

    Every rank of the model replica calls it with the same arguments; logits [b, V/tp] come back on the last
    pipeline stage only (None elsewhere). Each rank's store holds its own layers' caches. nanotron's prefill takes
    the left-padded prompts with their mask; every later call appends one token per row (no shared prefix). The
    store keeps each row's keys and values from its column 0 with its own length (flash-attn's `cache_seqlens`), so
    a refill copies a row as it is, and an empty row is a position offset of -1.
    """

    multi_token_extend = False  # nanotron's decoding path takes one new token per row once the cache is filled

    def __init__(self, backend):
        from nanotron.generation.generate_store import Store
        from nanotron.models.llama import CausalSelfAttention

        four_value_unpad_input()
        self.backend, self.store_class = backend, Store
        self.store = Store()
        self.attentions = [m for m in backend.forward_module.modules() if isinstance(m, CausalSelfAttention)
                           and hasattr(m, "prefill_kv_len") and hasattr(m, "rotary_embedding")]
        self.columns = 0  # cache columns of the current batch (longest prompt + max_new_tokens)
        self.rows = 0
        self.tables: dict[int, torch.Tensor] = {}  # RoPE table of `columns` positions, per attention layer

    def allocate(self, rows: int, columns: int) -> None:
        self.store, self.columns, self.tables, self.rows = self.store_class(), columns, {}, rows

    def select_rows(self, index: torch.Tensor, start: int = 0, columns: int | None = None) -> None:
        """Rows `index` of every stored tensor (batch is their first dimension); `start` moves only padding, which
        the store does not hold (each row's tokens start at its column 0); `columns`: the new room per row (key /
        value caches cut or grown with zeros, the RoPE table rebuilt for it)."""
        index = index.to(self.backend.device)
        for state in self.store.values():  # per module: key/value caches, position offsets, past lengths
            for name, value in state.items():
                if isinstance(value, torch.Tensor):
                    value = value.index_select(0, index.to(value.device))
                    state[name] = _room(value, columns) if name in _COLUMNS and columns else value
        self.rows = len(index)
        if columns and columns != self.columns:
            self.columns, self.tables = columns, {}

    def write_rows(self, slots: torch.Tensor, source: StoreCache | None, rows: torch.Tensor | None = None,
                   columns: int | None = None) -> None:
        """Rows `slots` become `source`'s rows `rows` as nanotron stores them (keys / values from column 0, the
        row's position offset and length); source None: the slots become empty (position offset -1, so the next
        token is at position 0, written into column 0). `columns` is not needed: rows are not column-aligned."""
        device = self.backend.device
        slots = slots.to(device)
        if source is None:
            for state in self.store.values():
                if "position_offsets" in state:
                    state["position_offsets"][slots] = -1
                if "past_length" in state:
                    state["past_length"][slots] = 0
            return
        rows = (torch.arange(len(slots)) if rows is None else rows).to(device)
        for module, theirs in source.store.items():
            mine = self.store[module]
            for name, value in theirs.items():
                if not isinstance(value, torch.Tensor):
                    continue
                if name not in mine:  # a cache just allocated: nanotron's layout, for this cache's rows and room
                    shape = (self.rows, self.columns, *value.shape[2:]) if name in _COLUMNS else (self.rows,)
                    mine[name] = value.new_zeros(shape)
                copied = value.index_select(0, rows)
                if name in _COLUMNS:
                    copied = _room(copied, mine[name].shape[1])
                mine[name][slots] = copied

    @torch.no_grad()
    def run(self, ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor | None:
        """The prompts (left-padded, the first call) or one new token per row through every stage."""
        return self._forward(ids, real[:, -ids.shape[1]:])

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        """ids / mask [b, n] through every stage with the store attached; logits [b, V/tp] of the last column."""
        from nanotron.generation.generate_store import attach_store
        from nanotron.parallel.pipeline_parallel.tensor_pointer import TensorPointer

        backend, layout = self.backend, self.backend.layout
        if layout.pp_rank == layout.input_pp_rank:
            ids, mask = ids.to(backend.device), mask.to(backend.device)
        else:
            ids = mask = TensorPointer(group_rank=layout.input_pp_rank)
        with attach_store(backend.forward_module, self.store), self._sized():
            logits = backend.forward_module(input_ids=ids, input_mask=mask)  # [n, b, V/tp] on the last stage
        if not layout.is_output_stage or isinstance(logits, TensorPointer):
            return None
        return logits[-1]

    @contextmanager
    def _sized(self):
        """While inside: every attention layer's cache length and RoPE table are `self.columns` (see the module
        docstring); nanotron's own values are put back on exit."""
        saved = []
        for attn in self.attentions:
            rotary = attn.rotary_embedding
            saved.append((attn, attn.prefill_kv_len, rotary.end, rotary._initialized_buffer,
                          rotary._buffers.get("freqs_cis")))
        try:
            for attn in self.attentions:
                rotary = attn.rotary_embedding
                attn.prefill_kv_len = rotary.end = self.columns
                if id(rotary) in self.tables:
                    rotary._buffers["freqs_cis"], rotary._initialized_buffer = self.tables[id(rotary)], True
                else:  # nanotron's own initialisation, for `columns` positions
                    rotary._initialized_buffer = False
                    rotary.init_rotary_embeddings()
                    self.tables[id(rotary)] = rotary.freqs_cis
            yield
        finally:
            for attn, length, end, initialized, table in saved:
                rotary = attn.rotary_embedding
                attn.prefill_kv_len, rotary.end, rotary._initialized_buffer = length, end, initialized
                if table is None:
                    rotary._buffers.pop("freqs_cis", None)
                else:
                    rotary._buffers["freqs_cis"] = table


def _room(t: torch.Tensor, columns: int) -> torch.Tensor:
    """A stored key / value cache [rows, room, ...] with `columns` of room: cut (the columns past every row's
    tokens) or grown with zeros."""
    if t.shape[1] >= columns:
        return t[:, :columns].contiguous()
    return torch.cat([t, t.new_zeros((t.shape[0], columns - t.shape[1], *t.shape[2:]))], dim=1)
