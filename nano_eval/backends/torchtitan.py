"""torchtitan backend: score the model parts torchtitan's Trainer holds, in their own FSDP2 / HSDP x TP x PP (x CP)
layout (what differs between torchtitan releases: nano_eval.compat.torchtitan).

A model part is a torchtitan `Decoder` (Llama3, Qwen3, ...) after torchtitan's own parallelize / pipeline functions;
called as `part(tokens or hidden [B, S(, H)], positions=[B, S], attention_masks=...)`.

- Rows: right-padded, positions 0..S-1 in every row and torchtitan's own attention masks built from them (each row
  one document: causal, so padding after a scored position never reaches it). Under sequence parallelism S is
  padded to a multiple of tp.
- Output layer on scored positions only: the decoder runs with `_skip_lm_head` (as torchtitan's ChunkedLossWrapper
  runs it) and returns the normed hidden states `[B, S, H]`; we pick the N scored positions and call the part's own
  `lm_head` on `[1, N, H]`. Under TP the lm_head is column-parallel with its output sharded over the vocabulary:
  `[N, V/tp]` on every TP rank, never gathered (an uneven last shard is padded with -inf to V/tp columns, so the
  scoring core's shard offsets hold).
- FSDP2 / HSDP: by default (`unshard="auto"`: always on CPU; on a GPU when the gathered parameters take at most
  half the free memory) the parameters are gathered once per evaluation (`session()`) and resharded after
  (nano_eval.compat.torchtitan.UnshardedParameters): no forward all-gathers, so data-parallel ranks run their own
  batches. With `unshard=False` (or too little memory) every forward all-gathers over the FSDP mesh, so `lockstep`
  is True and every data-parallel rank runs the same forwards with the same shapes (nano_eval.lockstep: the
  all-gathers would hang otherwise, torchtitan #1618).
- PP: this rank's stages (torchtitan's pipeline schedule's model parts) in stage order; hidden states move between
  ranks with point-to-point sends over torchtitan's "pp" mesh (a dtype code, then the activation: every rank of the
  replica holds the same batch, so shapes are known on both sides). Logits come out of the last stage.
- CP: folded into DP. Each CP rank scores whole rows; FlexAttention's key / value all-gather over the CP mesh is off
  while scoring (nano_eval.compat.torchtitan.local_context_parallel).
- MoE: torchtitan routes every token to its top-k experts (dropless) and counts expert load only in training mode,
  so scoring (in eval mode) leaves the load-balancing state alone; routers route by their scores while scoring
  (`--debug.moe_force_load_balance`'s round-robin routing, which depends on a token's index in its batch, is off
  and put back after: nano_eval.compat.torchtitan.learned_routing); HybridEP's capacity-factor dispatch is
  refused. Under expert parallelism the MoE all-to-all spans data-parallel ranks: lockstep.
- Greedy generation decodes from nano_eval's KV cache over the model's own modules, in the same layout
  (nano_eval.backends.torchtitan_cache: each prompt once, then one token per row per step); a model whose attention
  it cannot serve exactly (sliding windows, sinks, linear attention, multi-token prediction) re-runs the prompt for
  every new token (one note on rank 0 says so).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nano_eval.backends.base import Batch, note_rerun_generation
from nano_eval.compat import torchtitan as tt
from nano_eval.errors import NanoEvalError

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class TorchtitanModel:
    """torchtitan model parts behind the backend protocol (nano_eval.backends.base.Backend).

    parts: the Trainer's `model_parts`; parallel_dims: its `parallel_dims` (meshes built; None: a plain model,
    every process a data-parallel replica, as run.py scores a checkpoint); schedule: its
    `pp_schedule` under pipeline parallelism (else None); sequence_parallel: its
    `config.parallelism.enable_sequence_parallel` (activations sharded over TP along the sequence). Every rank of
    the world constructs it.
    """

    def __init__(self, parts, parallel_dims, tokenizer, *, max_length: int, schedule=None,
                 sequence_parallel: bool = False, unshard: bool | str = "auto",
                 device: str | torch.device | None = None):
        self.parts = list(parts)
        self.module = torch.nn.ModuleList(self.parts)
        self.parallel_dims = parallel_dims
        self.tokenizer, self.max_length = tokenizer, max_length
        dropping = tt.token_dropping(self.parts)
        if dropping is not None:
            raise NanoEvalError(f"cannot score this torchtitan MoE model without token dropping: {dropping}, so a "
                                "row's scores would depend on the other rows of its batch. Fix: evaluate with a "
                                "dropless token dispatcher (HybridEP without non_blocking_capacity_factor)")
        first = next(p for part in self.parts for p in part.parameters())
        self.device = torch.device(device) if device is not None else tt.local(first).device
        self.layout = tt.layout_of(parallel_dims, "cuda" if self.device.type == "cuda" else "cpu")
        if tt.has_moe(self.parts):  # token-choice top-k routing, never a capacity (HybridEP's is refused above)
            self.layout = dataclasses.replace(self.layout, moe_routing="dropless")
        tt.note_untested_version(self.layout.is_main)
        self.stages = tt.stages_of(schedule, self.parts)
        config = getattr(self.parts[0], "config", None)
        self.vocab_size = getattr(config, "vocab_size", None)
        self.seq_multiple = self.layout.tp_size if sequence_parallel else 1
        self.unsharded = tt.UnshardedParameters(self.parts) if self._unshard(unshard) else None
        fsdp_collectives = tt.fsdp_degree(parallel_dims) > 1 and self.unsharded is None
        self.lockstep = fsdp_collectives or self.layout.ep_size > 1
        self._owners = self._stage_owners() if self.layout.pp_size > 1 else {}
        self._depth = 0

    def _unshard(self, unshard: bool | str) -> bool:
        """Whether parameters are gathered for the evaluation (see the module docstring)."""
        if unshard != "auto":
            return bool(unshard)
        if self.device.type != "cuda":
            return True
        free, _ = torch.cuda.mem_get_info(self.device)
        wanted = torch.tensor([tt.unsharded_bytes(self.parts) <= free // 2], dtype=torch.int32, device=self.device)
        if dist.is_initialized():  # every rank must take the same path (lockstep or not)
            dist.all_reduce(wanted, op=dist.ReduceOp.MIN)
        return bool(wanted.item())

    def _stage_owners(self) -> dict[int, int]:
        """{stage index: its rank in the pp group}, from every pipeline rank (one all_gather_object at build)."""
        lay = self.layout
        mine = [s.index for s in self.stages]
        every: list = [None] * lay.pp_size
        dist.all_gather_object(every, mine, group=lay.pp_group)
        return {index: rank for rank, indices in enumerate(every) for index in indices}

    @contextlib.contextmanager
    def session(self):
        """A run of forwards (one evaluation): FSDP2 parameters gathered on entry and resharded on exit (when
        `unshard`); re-entrant, only the outermost call acts. Collective over the data-parallel mesh."""
        self._depth += 1
        try:
            if self._depth > 1 or self.unsharded is None:
                yield
            else:
                with self.unsharded.applied():
                    yield
        finally:
            self._depth -= 1

    def incremental_decoder(self, shared_prefix_tokens: int = 0):
        """Greedy generation from nano_eval's KV cache over the model's own modules
        (nano_eval.backends.torchtitan_cache) behind nano_eval.decoder.CacheDecoder; None (the prompt is re-run per
        token) for a model whose attention the cache cannot serve exactly (compat.torchtitan.cache_unsupported)."""
        from nano_eval.backends.torchtitan_cache import TorchtitanCache
        from nano_eval.decoder import CacheDecoder

        reason = tt.cache_unsupported(self.stages[0].module)
        if reason is None:
            return CacheDecoder(lambda: TorchtitanCache(self), shared_prefix_tokens)
        note_rerun_generation(self, reason)
        return None

    @torch.no_grad()
    def forward(self, batch: Batch) -> torch.Tensor | None:
        """Logits [N, V/tp] at (batch.rows, batch.cols) on the last pipeline stage; None on the other stages. Called
        inside `session()` (nano_eval.backends.base.scoring_session: the Evaluator and the hook open it)."""
        b, s = batch.input_ids.shape
        positions = torch.arange(s + (-s % self.seq_multiple), device=self.device).expand(b, -1)
        return self.run(batch.input_ids.to(self.device), positions, batch.rows.to(self.device),
                        batch.cols.to(self.device))

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
            masks: bool = True) -> torch.Tensor | None:
        """tokens [B, S] int64 at RoPE positions [B, S'] (S' >= S: S padded on the right to a multiple of tp under
        sequence parallelism, positions already are) through every stage; logits [N, V/tp] at (rows, cols) on the
        last stage, None elsewhere. `masks`: torchtitan's own attention masks from the positions (scoring), or none
        (the KV cache, nano_eval.backends.torchtitan_cache, attends with its own)."""
        if self.unsharded is not None and self._depth == 0:
            raise RuntimeError("TorchtitanModel.forward outside session(): FSDP2 would all-gather in this forward "
                               "while the data-parallel ranks are not in lockstep")
        extra = -tokens.shape[1] % self.seq_multiple
        if extra:
            tokens = F.pad(tokens, (0, extra), value=0)
        if positions.shape[1] < tokens.shape[1]:
            positions = F.pad(positions, (0, tokens.shape[1] - positions.shape[1]), value=0)
        positions = positions.contiguous()
        masks = tt.attention_masks(self.stages[0].module, positions) if masks else None
        tokens, positions = tt.spmd_inputs(self.parallel_dims, tokens, positions)
        with tt.local_context_parallel(self.parallel_dims), tt.learned_routing(self.parts), \
                tt.spmd_context(self.parallel_dims):
            return self._through_stages(tokens, positions, masks, rows, cols)

    def _through_stages(self, tokens, positions, masks, rows, cols) -> torch.Tensor | None:
        """Every stage of the model in order: this rank runs its own, receiving hidden states from the rank of the
        stage before and sending them to the rank of the stage after."""
        count = self.stages[0].count
        mine = {s.index: s.module for s in self.stages}
        hidden, logits = None, None
        for index in range(count):
            if index not in mine:
                continue
            if index == 0:
                hidden = tokens
            elif index - 1 not in mine:
                hidden = self._receive(self._owners[index - 1], tokens.shape)
            part = mine[index]
            if index == count - 1:
                logits = self._scored(part, hidden, positions, masks, rows, cols)
            else:
                hidden = part(hidden, positions=positions, attention_masks=masks)  # DTensor under TP
                if index + 1 not in mine:
                    self._send(hidden, self._owners[index + 1])
        return logits

    def _scored(self, part, hidden, positions, masks, rows, cols) -> torch.Tensor:
        """The last stage: normed hidden states from the decoder with its lm_head skipped, then lm_head on the
        scored positions only -> [N, V/tp] (every TP rank its vocabulary shard)."""
        skip = part._skip_lm_head
        part._skip_lm_head = True
        try:
            normed = part(hidden, positions=positions, attention_masks=masks)  # [B, S, H] (DTensor under TP)
        finally:
            part._skip_lm_head = skip
        picked = tt.like(tt.local(normed)[rows, cols].unsqueeze(0), normed)  # [1, N, H]
        logits = tt.local(part.lm_head(picked))[0]  # [N, V/tp]
        return self._even_shard(logits)

    def _even_shard(self, logits: torch.Tensor) -> torch.Tensor:
        """DTensor shards the vocabulary unevenly when tp does not divide it (the last ranks hold fewer columns):
        pad to ceil(V/tp) columns with -inf, which no log-sum-exp or argmax sees."""
        if self.vocab_size is None or self.layout.tp_size == 1:
            return logits
        width = -(-self.vocab_size // self.layout.tp_size)
        if logits.shape[-1] == width:
            return logits
        return F.pad(logits, (0, width - logits.shape[-1]), value=float("-inf"))

    # ---- pipeline point-to-point -----------------------------------------------------------------------------

    def _peer(self, pp_rank: int) -> int:
        return dist.get_global_rank(self.layout.pp_group, pp_rank)

    def _send(self, hidden: torch.Tensor, pp_rank: int) -> None:
        """A dtype code and the TP placement code of `hidden` (nano_eval.compat.torchtitan.placement_code), then
        its local part."""
        local = tt.local(hidden)
        code = torch.tensor([_DTYPES.index(local.dtype), tt.placement_code(hidden)], dtype=torch.int64,
                            device=local.device)
        dist.send(code, self._peer(pp_rank), group=self.layout.pp_group)
        dist.send(local.contiguous(), self._peer(pp_rank), group=self.layout.pp_group)

    def _receive(self, pp_rank: int, shape: torch.Size) -> torch.Tensor:
        """Hidden states [B, S/sp, H] (this rank's sequence share under sequence parallelism) from the stage before,
        a DTensor placed as the sender's was (under TP: the next stage's modules mix it with their DTensors, as
        torchtitan's PipelineStage re-wraps what it receives)."""
        code = torch.zeros(2, dtype=torch.int64, device=self.device)
        dist.recv(code, self._peer(pp_rank), group=self.layout.pp_group)
        b, s = shape
        hidden = torch.empty(b, s // self.seq_multiple, self._dim(), dtype=_DTYPES[int(code[0].item())],
                             device=self.device)
        dist.recv(hidden, self._peer(pp_rank), group=self.layout.pp_group)
        return tt.with_placement(hidden, int(code[1].item()), self.parallel_dims)

    def _dim(self) -> int:
        dim = getattr(getattr(self.parts[0], "config", None), "dim", None)
        if dim is None:
            raise NanoEvalError(f"the torchtitan model {type(self.parts[0]).__name__} has no config.dim: nano_eval "
                                "cannot size the hidden states it receives between pipeline stages. Fix: score it "
                                "without pipeline parallelism")
        return dim

