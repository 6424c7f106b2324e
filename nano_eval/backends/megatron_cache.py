"""Greedy decoding from megatron-core's own KV cache, in the model's TP x PP layout (see nano_eval.generate).

`StaticCache` keeps a megatron-core `StaticInferenceContext` per batch of prompts: GPTModel's attention
layers write their keys and values into it (`[capacity, b, groups/tp, head_dim]` per layer, on the ranks that
hold the layer) and read every earlier column back, so each prompt runs through the model once and then one token
per row per step. Between pipeline stages the hidden states travel through Megatron's schedule, as in the
backend's scoring forward: the whole batch is one microbatch, or pp equal ones under the interleaved schedule
(several chunks per stage; the batch is topped up with copies of its first row, and each microbatch writes its
rows of the cache through the context's batch offset). The vocab-sharded logits `[b, V/tp]` of each row's
newest token come out of the last stage.

Megatron's static cache gives every row the same column for its newest token, so prompts are left-padded, and
what makes each row see exactly what it would see alone is ours:
- an explicit mask `[b, 1, new, columns]` (True = masked): causal, and a row's padding columns masked;
- per-row positions: the RoPE table becomes `[capacity, b, 1, dim]`, column c of row r at position c - pad_r
  (learned absolute positions get the same numbers as `position_ids`);
- rows that finish are dropped from the cache (they stop costing compute); the cache holds the batch's longest
  prompt + max_new_tokens columns (rows x columns: the engine's --batch-tokens budget), allocated once;
- every causal `FusedScaleMaskSoftmax` is told it holds a padding mask while decoding: with fp16/bf16 and
  `masked_softmax_fusion=True` (Megatron-LM's default) a causal layer otherwise takes the fused upper-triangular
  kernel for square score blocks (the prefill, width divisible by 4 in 17..4096), and that kernel takes no mask, so
  left-padded rows would attend to their padding. With the padding type the same kernel family applies our mask
  (the fused masked kernel where its shape rules allow, else torch's softmax).
While decoding, sequence parallelism and fused RoPE are switched off and restored after every call (same maths;
megatron-core's static inference supports neither), and the output layer keeps vocab-parallel logits.

Which column's logits: the context is built to hand the output layer EVERY new column (`[n, b, H]`,
nano_eval.compat.megatron.static_inference_context) and each row's logits are picked at its last one, on every
release. (megatron-core can hand only the last column, but from 0.18 it does so only under its process-wide
InferenceMode, which nano_eval does not set; a decoder that took index 0 as "the last column" read the prompt's
first position and generated wrong tokens, silently, on 0.18 / 0.19.)

Nothing is taken on trust from the release: while decoding, every core attention must receive this call's queries
against exactly the cache columns [0, end) and our mask, every output layer exactly the new columns of the
microbatch, and after the call every local layer's keys and values must sit in the cache at [capacity, cache rows,
...]. A release that moved any of this stops the generation with one line (`CacheContractError`) instead of
decoding differently from the re-run path; a megatron-core minor release nano_eval's table does not know decodes
by re-running the prompt (`unsupported_reason`).

Exact where the core attention is megatron-core's local `DotProductAttention` (it applies the mask we pass).
Other models keep the re-run path (`unsupported_reason` says why): Transformer Engine / flash attention cores
(in megatron's static-inference path they apply a causal or no mask, ignoring the padding mask), sliding-window
attention (megatron's softmax then builds its own window mask, ignoring ours), flash decoding or CUDA graphs,
multi-latent attention, multi-token prediction, position embeddings other than rope / learned absolute / none,
`pad_to_length`.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

import torch

from nano_eval.compat.megatron import inference_mode_active, static_inference_context, unwrap, version_string
from nano_eval.errors import NanoEvalError

_POSITIONS = ("rope", "learned_absolute", "none")
_SEQUENCE_PARALLEL_ATTRS = ("sequence_parallel", "scatter_to_sequence_parallel", "reduce_scatter_embeddings")


def unsupported_reason(backend) -> str | None:
    """Why `backend` (a MegatronModel) cannot decode from the static KV cache exactly; None when it can. Looks at
    this rank's chunks only (MegatronModel.incremental_decoder makes the pipeline stages agree)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    try:
        if static_inference_context(1, 1) is None:
            return f"megatron-core {version_string()} is not in nano_eval's release table"
    except ImportError:
        return "this megatron-core has no megatron.core.inference.contexts.StaticInferenceContext"

    if backend.pad_to_length:
        return "pad_to_length (static shapes)"
    for model in map(unwrap, backend.chunks):
        config = getattr(model, "config", None)
        if config is None or not hasattr(model, "decoder"):
            return "not a megatron-core GPTModel"
        if getattr(model, "position_embedding_type", None) not in _POSITIONS:
            return f"position embedding {getattr(model, 'position_embedding_type', None)!r}"
        for flag in ("flash_decode", "multi_latent_attention", "mtp_num_layers", "window_size"):
            if getattr(config, flag, None):
                return f"config.{flag}"
        if getattr(config, "cuda_graph_impl", "none") != "none":
            return "CUDA graphs"
        if getattr(model, "post_process", False) and getattr(model, "output_layer", None) is None:
            return "no output_layer"
        for layer in model.decoder.layers:
            core = getattr(getattr(layer, "self_attention", None), "core_attention", None)
            if not isinstance(core, DotProductAttention):
                return f"core attention {type(core).__name__} (the padding mask needs megatron's DotProductAttention)"
    return None


class StaticCache:
    """megatron-core's static KV cache for one batch of rows (the KVCache of nano_eval.decoder).

    Every rank of the model replica calls it with the same arguments; logits come back on the last pipeline stage
    only (None elsewhere). Each rank's cache holds its own layers' keys and values for its TP shard of the query
    groups. Rows are left-padded (the prompts first, then one token per row per call: no shared prefix), so a row's
    padding is the columns before its first token; a refilled slot's too (its prompt copied in right-aligned), and
    megatron-core keeps keys before RoPE, rotating every cached column at each step by our per-row table, so a
    row's positions follow its padding wherever its tokens were copied or trimmed to.
    """

    multi_token_extend = False  # the per-row RoPE positions below assume left padding only

    def __init__(self, backend):
        self.backend = backend
        self.models = [unwrap(chunk) for chunk in backend.chunks]
        self.groups = backend.decode_microbatches  # the batch is split into this many equal microbatches
        self.context = None  # megatron-core StaticInferenceContext of the current batch
        self.rows = 0  # real rows; the cache also holds filler rows (copies of row 0) up to a multiple of groups
        self.pads: torch.Tensor | None = None  # [cache rows] int64: left-padding columns of each cache row
        self.span = (0, 0)  # cache columns [start, end) of the call in flight

    def allocate(self, rows: int, columns: int) -> None:
        self.context = static_inference_context(rows + (-rows % self.groups), columns)
        if self.context is None:
            raise CacheContractError("its StaticInferenceContext keeps the last-column switch where nano_eval does "
                                     "not look")

    def select_rows(self, index: torch.Tensor, start: int = 0, columns: int | None = None) -> None:
        """Rows `index` of every layer's keys / values [capacity, cache rows, groups/tp, head_dim], columns from
        `start` on moved to the front; `columns`: the new capacity (the RoPE table follows it)."""
        context = self.context
        index = self._filled(index.to(self.backend.device))
        end = context.sequence_len_offset
        capacity = columns or context.max_sequence_length
        memory = context.key_value_memory_dict
        for layer, pair in memory.items():
            moved = []
            for t in pair:
                new = t.new_zeros((capacity, len(index), *t.shape[2:]))
                new[: end - start] = t[start:end].index_select(1, index.to(t.device))
                moved.append(new)
            memory[layer] = tuple(moved)
        context.max_batch_size, context.max_sequence_length = len(index), capacity
        context.sequence_len_offset = end - start

    def write_rows(self, slots: torch.Tensor, source: StaticCache | None, rows: torch.Tensor | None = None,
                   columns: int | None = None) -> None:
        """Rows `slots` become `source`'s rows `rows`: its last `columns` columns of every layer's keys / values
        into this cache's last ones (grown in front when it holds fewer), the slots' columns before them zero.
        source None: nothing to do (the next run's `real` makes the slots' old columns padding)."""
        if source is None:
            return
        device, context, theirs = self.backend.device, self.context, source.context
        slots = slots.to(device)
        rows = (torch.arange(len(slots)) if rows is None else rows).to(device)
        n = theirs.sequence_len_offset if columns is None else columns
        end = context.sequence_len_offset
        grow = max(0, n - end)
        memory = context.key_value_memory_dict
        for layer, pair in theirs.key_value_memory_dict.items():
            mine = memory.get(layer)
            if mine is None:  # a cache just allocated
                mine = tuple(t.new_zeros((context.max_sequence_length, context.max_batch_size, *t.shape[2:]))
                             for t in pair)
            if grow:
                mine = tuple(torch.cat([t.new_zeros((grow, *t.shape[1:])), t[:-grow]]) for t in mine)
            for t, other in zip(mine, pair):
                t[: end + grow - n, slots] = 0
                t[end + grow - n: end + grow, slots] = other[theirs.sequence_len_offset - n: theirs.sequence_len_offset,
                                                             rows.to(other.device)].to(t.device)
            memory[layer] = mine
        context.sequence_len_offset = end + grow

    def _filled(self, rows: torch.Tensor) -> torch.Tensor:
        """[b] -> [b'] with b' the next multiple of self.groups: filler rows repeat the first row (their logits are
        never read)."""
        fill = -rows.shape[0] % self.groups
        return torch.cat([rows, rows[:1].expand(fill, *rows.shape[1:])]) if fill else rows

    @torch.no_grad()
    def run(self, ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor | None:
        """ids [b, n] into cache columns [start, start + n) of every row; logits [b, V/tp] at the last one."""
        device, context = self.backend.device, self.context
        start = context.sequence_len_offset
        end = start + ids.shape[1]
        self.rows = ids.shape[0]
        self.pads = self._filled((~real).sum(dim=1).to(device))  # [cache rows] left-padding columns of each row
        new_ids = self._filled(ids.to(device))
        columns = torch.arange(start, end, device=device)
        positions = (columns[None, :] - self.pads[:, None]).clamp(min=0)  # [cache rows, n]
        keys = torch.arange(end, device=device)
        masked = (keys[None, None, :] > columns[None, :, None]) | (keys[None, None, :] < self.pads[:, None, None])
        rows = torch.arange(self.rows, device=device)
        if inference_mode_active():
            raise CacheContractError("its InferenceMode is on (an inference engine holds the model)",
                                     "evaluate while megatron-core's inference engine is not running (InferenceMode "
                                     "is process-wide)")
        self.span = (start, end)
        last = torch.full_like(rows, end - start - 1)  # the output layer gets every new column: each row's last
        with self._decoding():
            logits = self.backend.run((new_ids, positions, masked[:, None]), rows, last, context)
        self._check_cache_written(len(self.pads))
        context.sequence_len_offset = end
        return logits

    @contextmanager
    def _decoding(self):
        """While inside: per-row RoPE positions, sequence parallelism / fused RoPE off, and the contract checks on
        every core attention and output layer (all restored after)."""
        with ExitStack() as stack:
            for model in self.models:
                rotary = getattr(model, "rotary_pos_emb", None)
                if model.position_embedding_type == "rope" and rotary is not None:
                    stack.callback(rotary.register_forward_hook(self._per_row_rotary).remove)
                for layer in model.decoder.layers:
                    core = layer.self_attention.core_attention
                    stack.callback(core.register_forward_pre_hook(self._check_attention_inputs).remove)
                output_layer = getattr(model, "output_layer", None)
                if output_layer is not None:  # registered before the backend's own pre-hook: sees the model's input
                    stack.callback(output_layer.register_forward_pre_hook(self._check_output_layer_input).remove)
                stack.enter_context(_plain_attributes(model))
            yield

    def _check_attention_inputs(self, module, args) -> None:
        """Core attention pre-hook: queries [new, mb, heads/tp, d] against keys and values of exactly the cache
        columns [0, end) of this microbatch's rows, and our mask [mb, 1, new, end]."""
        query, key, value, mask = args[:4]
        (start, end), mb = self.span, len(self.pads) // self.groups
        got = (tuple(query.shape[:2]), key.shape[0], value.shape[0], tuple(key.shape[1:2]),
               None if mask is None else tuple(mask.shape))
        if got != ((end - start, mb), end, end, (mb,), (mb, 1, end - start, end)):
            raise CacheContractError(f"its attention saw (query [new, rows], key / value columns, key rows, mask) = "
                                     f"{got} for cache columns {start}..{end} of {mb} rows")

    def _check_output_layer_input(self, module, args) -> None:
        """Output-layer pre-hook: the hidden states of every new column of the microbatch, [new, mb, H]."""
        (start, end), mb = self.span, len(self.pads) // self.groups
        if tuple(args[0].shape[:2]) != (end - start, mb):
            raise CacheContractError(f"its output layer got hidden states {tuple(args[0].shape)} for {end - start} "
                                     f"new columns of {mb} rows")

    def _check_cache_written(self, rows: int) -> None:
        """After a call: every layer of this rank's chunks holds its keys and values in the context,
        [capacity, cache rows, ...]."""
        memory = self.context.key_value_memory_dict
        layers = {layer.layer_number for model in self.models for layer in model.decoder.layers}
        shapes = {n: tuple(t.shape[:2]) for n, kv in memory.items() for t in kv}
        expected = (self.context.max_sequence_length, rows)
        if set(memory) != layers or any(shape != expected for shape in shapes.values()):
            raise CacheContractError(f"after a call its KV cache holds layers {sorted(memory)} shaped "
                                     f"{sorted(set(shapes.values()))}, expected layers {sorted(layers)} shaped "
                                     f"{expected}")

    def _per_row_rotary(self, module, args, emb: torch.Tensor) -> torch.Tensor:
        """RoPE table [capacity, 1, 1, dim] -> [capacity, mb, 1, dim] for the microbatch in flight (cache rows
        [batch_size_offset, + mb)): column c of row r at position c - pad_r."""
        mb = len(self.pads) // self.groups
        pads = self.pads[self.context.batch_size_offset:self.context.batch_size_offset + mb].to(emb.device)
        columns = torch.arange(emb.shape[0], device=emb.device)
        return emb[:, 0][(columns[:, None] - pads[None, :]).clamp(min=0)]


class CacheContractError(NanoEvalError):
    """megatron-core did not decode from its static KV cache the way nano_eval relies on (module docstring)."""

    def __init__(self, what: str, fix: str = "report this message to nano_eval; meanwhile score generative tasks "
                                              "with megatron-core 0.16.1 to 0.19.2 (tested)"):
        super().__init__(f"greedy generation from megatron-core {version_string()}'s KV cache stopped: {what}, not "
                         f"what nano_eval's decoder relies on, so its tokens could differ from the model's. Fix: "
                         f"{fix}.")


@contextmanager
def _plain_attributes(model):
    """Sequence parallelism and fused RoPE off on every module and config of `model` that has them on, and every
    causal FusedScaleMaskSoftmax switched to the padding mask type (it then applies the mask it is given, see the
    module docstring); restored on exit. The same sequence-parallel attributes megatron-core's
    set_model_to_sequence_parallel flips (not used: it caches modules by id(model), which a later model can reuse)."""
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType

    flipped = [(m, attr, True, False) for m in model.modules() for attr in _SEQUENCE_PARALLEL_ATTRS
               if getattr(m, attr, None) is True]
    configs = {id(c): c for c in (getattr(m, "config", None) for m in model.modules()) if c is not None}
    flipped += [(c, attr, True, False) for c in configs.values() for attr in ("sequence_parallel", "apply_rope_fusion")
                if getattr(c, attr, None) is True]
    flipped += [(m, "attn_mask_type", AttnMaskType.causal, AttnMaskType.padding) for m in model.modules()
                if isinstance(m, FusedScaleMaskSoftmax) and m.attn_mask_type == AttnMaskType.causal]
    try:
        for obj, attr, _, value in flipped:
            setattr(obj, attr, value)
        yield
    finally:
        for obj, attr, value, _ in flipped:
            setattr(obj, attr, value)
