"""What MegatronModel changes in a megatron-core model while it scores, and puts back exactly afterwards.

`ScoringState(chunks).applied()` wraps every forward of the backend (scoring, prefill, each decoding step):

- Dropless MoE routing: a capacity factor (token dropping, a common training setting) makes a row's scores depend on
  the other rows of its batch and of the other expert-parallel ranks' batches. While scoring, every MoE layer routes
  every token to its top-k experts: `moe_expert_capacity_factor = None` and `moe_pad_expert_input_to_capacity =
  False` on the configs (the router reads them at every forward), and the same on the token dispatchers, which copy
  them at construction (alltoall: `drop_and_pad`, `moe_expert_capacity_factor`; flex dispatcher managers:
  `drop_and_pad`, `capacity_factor`; from 0.18 the hybrid-EP manager also a per-rank budget). The fields of each
  megatron-core release are its row of nano_eval.compat.megatron.RELEASES (`dropless_config`,
  `dispatcher_fields`). A dispatcher's attributes are restored whole, not just those: a forward leaves its split
  sizes there, and the alltoall dispatcher's pad-to-capacity path relies on finding the ones of its own previous
  forwards (None at first: equal splits), not a dropless forward's. Input jitter (`moe_input_jitter_eps`, random
  noise that the 0.16 router applies in eval mode too) is off as well.
  Fails closed: a model whose config or dispatchers lack one of these fields (renamed in a megatron-core upgrade),
  or whose dispatcher class nano_eval does not know, is refused by name when the backend is built
  (`check_dropless`), rather than scored with token dropping back on; and every router's routing map is probed as
  it leaves the router (each token must reach its top-k experts), so a drop that slipped past the check stops the
  evaluation with an error before a token dispatcher sees the short map (megatron-core 0.19's alltoall dispatcher
  sizes its splits as tokens x top-k when dropless and would crash on it; older ones scored it, moved).
- Training state untouched: each router's load-balancing counters (`local_tokens_per_expert` of aux-loss-free
  balancing, the expert bias, the global aux loss's `global_tokens_per_expert` / `ga_steps`) and megatron-core's
  MoE aux-loss logging tracker are copied before and written back after (0.16 skips them under no_grad; other
  releases count in eval too), so the next optimizer step sees exactly what training put there.
- Context parallelism off: each CP rank scores whole rows like a data-parallel rank (the layout counts CP ranks in
  dp). Transformer Engine attention modules get `set_context_parallel_group(None, None, None, cp_comm_type)` (what
  megatron's TEDotProductAttention does for packed sequences) and their group back after; rotary embeddings lose
  their `cp_group` (no per-CP-rank slice of the positions); configs say `context_parallel_size = 1`.

Every attribute is read when a forward starts and written back when it ends, so a trainer that changes one between
evaluations is respected. Rank-local; no collectives.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from nano_eval.compat.megatron import RELEASES, release, unwrap, version_string
from nano_eval.errors import NanoEvalError

# What scoring switches on a dispatcher, wherever the attribute is there (the alltoall dispatcher holds
# `moe_expert_capacity_factor` only when it pads): the dropless value of each.
_DROPLESS_DISPATCHER = {"drop_and_pad": False, "capacity_factor": None, "moe_expert_capacity_factor": None,
                        "moe_expert_rank_capacity_factor": None}
_ROUTER_COUNTERS = ("local_tokens_per_expert", "expert_bias", "global_tokens_per_expert", "ga_steps")
_TE_CP_ATTRS = ("cp_group", "cp_global_ranks", "cp_stream", "cp_comm_type")


class ScoringState:
    """The objects of `chunks` that scoring switches, found once (the model's structure does not change)."""

    def __init__(self, chunks):
        row = release() or RELEASES[max(RELEASES)]  # a release not in the table: the newest row, checked below
        self.dropless_config = dict(row.dropless_config)
        modules = [m for chunk in chunks for m in unwrap(chunk).modules()]
        configs = {id(c): c for c in (getattr(m, "config", None) for m in modules) if c is not None}
        self.configs = list(configs.values())
        self.moe = any(getattr(c, "num_moe_experts", None) for c in self.configs)
        dispatchers = [getattr(m, "token_dispatcher", None) for m in modules]
        self.dispatchers = [d for d in dispatchers if d is not None]
        self.dispatchers += [d._comm_manager for d in self.dispatchers if getattr(d, "_comm_manager", None)]
        for config in (getattr(d, "config", None) for d in self.dispatchers):  # the config a dispatcher reads
            if config is not None and id(config) not in configs:
                configs[id(config)] = config
                self.configs.append(config)
        if self.moe:
            check_dropless(self.configs, self.dispatchers, modules, self.dropless_config,
                           dict(row.dispatcher_fields))
        self.counters = [(m, name) for m in modules for name in _ROUTER_COUNTERS
                         if isinstance(getattr(m, name, None), torch.Tensor)]
        self.te_attention = [m for m in modules if callable(getattr(m, "set_context_parallel_group", None))]
        self.rotary = [m for m in modules if _is_rotary(m)]
        self.routers = [m for m in modules if isinstance(getattr(m, "topk", None), int)
                        and callable(getattr(m, "routing", None))]  # megatron-core's TopKRouter

    @property
    def routing(self) -> str | None:
        """How MoE layers route while scoring: "dropless", or None for a dense model."""
        return "dropless" if self.moe else None

    @contextmanager
    def applied(self):
        """While inside: dropless routing, training counters kept, context parallelism off (see the module)."""
        flipped = []  # (object, attribute, value before)

        def flip(obj, attr, value):
            flipped.append((obj, attr, getattr(obj, attr)))
            setattr(obj, attr, value)

        counters = [(buf := getattr(m, name), buf.clone()) for m, name in self.counters]
        tracker = _aux_loss_tracker() if self.moe else None
        logged = {k: dict(v, values=v["values"].clone()) for k, v in tracker.items()} if tracker is not None else None
        cp_groups = [(m, tuple(getattr(m, a, None) for a in _TE_CP_ATTRS)) for m in self.te_attention
                     if _size(getattr(m, "cp_group", None)) > 1]
        dispatchers = [(d, dict(vars(d))) for d in self.dispatchers]  # settings and what each forward leaves there
        probes = []
        try:
            for config in self.configs:
                if getattr(config, "num_moe_experts", None):  # every attribute is there (check_dropless)
                    for attr, value in self.dropless_config.items():
                        if getattr(config, attr) != value:
                            flip(config, attr, value)
                if (getattr(config, "context_parallel_size", 1) or 1) > 1:
                    flip(config, "context_parallel_size", 1)
            for dispatcher, _ in dispatchers:
                for attr, value in _DROPLESS_DISPATCHER.items():
                    if attr in vars(dispatcher):
                        setattr(dispatcher, attr, value)
            for module in self.rotary:
                if _size(getattr(module, "cp_group", None)) > 1:
                    flip(module, "cp_group", None)
            for module, saved in cp_groups:
                module.set_context_parallel_group(None, None, None, saved[-1])
            probes += [r.register_forward_hook(_dropless_probe) for r in self.routers]
            yield
        finally:
            for probe in probes:
                probe.remove()
            for module, saved in cp_groups:
                module.set_context_parallel_group(*saved)
            for obj, attr, value in reversed(flipped):
                setattr(obj, attr, value)
            for dispatcher, saved in dispatchers:
                vars(dispatcher).clear()
                vars(dispatcher).update(saved)
            with torch.no_grad():
                for buf, saved in counters:
                    buf.copy_(saved)
            if tracker is not None:
                for name in [k for k in tracker if k not in logged]:
                    del tracker[name]
                for name, entry in logged.items():
                    if name in tracker:
                        tracker[name]["values"].copy_(entry["values"])
                        tracker[name].update({k: v for k, v in entry.items() if k != "values"})
                    else:
                        tracker[name] = entry


def check_dropless(configs: list, dispatchers: list, modules: list, dropless_config: dict,
                   dispatcher_fields: dict) -> None:
    """Refuse, by name, a MoE model whose routing `applied()` could not make dropless: a MoE config without one of
    the release's `dropless_config` fields, a MoE layer without a token dispatcher, a dispatcher class nano_eval does
    not know or one without the fields `dispatcher_fields` lists for it (nano_eval.compat.megatron.Release; a class
    not listed, or a renamed field after an upgrade, is refused: switching what could be found and skipping the rest
    would bring token dropping back silently, moving log-probs by up to 1.55 in the tests' MoE model). The message
    names the installed megatron-core."""
    problems = [f"{type(c).__name__} has no {a!r}" for c in configs if getattr(c, "num_moe_experts", None)
                for a in dropless_config if not hasattr(c, a)]
    problems += [f"{type(m).__name__} has no token_dispatcher" for m in modules
                 if hasattr(m, "router") and hasattr(m, "experts") and getattr(m, "token_dispatcher", None) is None]
    for d in dispatchers:
        name = type(d).__name__
        if name not in dispatcher_fields:
            problems.append(f"{name} is a token dispatcher nano_eval does not know")
        else:
            problems += [f"{name} has no {a!r}" for a in dispatcher_fields[name] if a not in vars(d)]
    if problems:
        raise NanoEvalError(
            f"cannot score this MoE model without token dropping under megatron-core {version_string()}: "
            f"{'; '.join(problems[:3])} (nano_eval switches {', '.join(dropless_config)} on the configs and "
            f"{', '.join(_DROPLESS_DISPATCHER)} on the dispatchers). Fix: use a megatron-core release whose MoE "
            "router and dispatchers hold these (0.16.1 to 0.19.2 do), or report this message to nano_eval.")


def _dropless_probe(router, args, output) -> None:
    """A router forward hook proving routing was dropless before any token dispatcher sees it: every token's row of
    the routing map [tokens, experts] names its top-k experts (fewer means a capacity dropped it). One device sync
    per MoE layer (the alltoall dispatcher syncs there anyway, for its split sizes)."""
    routing_map = output[1] if isinstance(output, tuple) and len(output) == 2 else None
    if isinstance(routing_map, torch.Tensor) and routing_map.dim() == 2:
        short = int((routing_map.sum(dim=-1) < router.topk).sum())
        if short:
            raise NanoEvalError(f"a MoE router dropped tokens while scoring ({short} token-layer routings reached "
                                f"fewer than their top-k experts) although nano_eval switched dropless routing on "
                                f"(megatron-core {version_string()}): scores would depend on the batch. Fix: report "
                                "this message to nano_eval; until then, score with megatron-core 0.16.1 to 0.19.2.")


def _size(group) -> int:
    """Ranks in a process group (a list of groups, as hierarchical CP holds: the product); 1 for None."""
    if group is None:
        return 1
    if isinstance(group, (list, tuple)):
        return math.prod(_size(g) for g in group)
    return group.size()


def _is_rotary(module) -> bool:
    """megatron-core's rotary embeddings (RotaryEmbedding, its YaRN subclass, MultimodalRotaryEmbedding): they slice
    positions per CP rank when they hold a cp_group."""
    try:
        from megatron.core.models.common.embeddings.rotary_pos_embedding import (MultimodalRotaryEmbedding,
                                                                                  RotaryEmbedding)
    except ImportError:
        return False
    return isinstance(module, (RotaryEmbedding, MultimodalRotaryEmbedding))


def _aux_loss_tracker() -> dict | None:
    """megatron-core's MoE aux-loss logging tracker ({name: {"values": tensor [layers], ...}}), None if absent."""
    try:
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
    except ImportError:
        return None
    return get_moe_layer_wise_logging_tracker()
