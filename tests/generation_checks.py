"""Greedy generation through a backend's KV-cache decoder and through the re-run path, on the same model, for the
multi-process backend tests (tests/megatron_worker.py, tests/nanotron_worker.py): generations and the number of
tokens each path puts through the model's embedding."""

from __future__ import annotations

GEN_TOKENS = 24
GEN_BATCH_TOKENS = 100  # generate()'s --batch-tokens: 2-3 rows of prompt + GEN_TOKENS, so finished rows' slots are
# refilled (continuous batching) in every layout
GEN_PROMPTS = [f"Question: {i} plus {3 * i}\nAnswer:" + " so" * (i % 5) for i in range(6)]  # mixed lengths


class Rerunning:
    """A backend without `incremental_decoder`: generation re-runs the prompt for every new token (in lockstep
    where the backend is)."""

    def __init__(self, backend):
        self.forward, self.layout, self.module = backend.forward, backend.layout, backend.module
        self.lockstep = getattr(backend, "lockstep", False)
        self.tokenizer, self.max_length = backend.tokenizer, backend.max_length


NEAR_TIE = 0.25  # bf16: two tokens whose log-probs are this close may come out in either order (see divergences)


def _requests(stop: list[str]):
    from nano_eval.tasks.requests import GreedyUntilRequest

    return [GreedyUntilRequest("t", i, 0, p, stop_sequence=stop, generation_size=GEN_TOKENS)
            for i, p in enumerate(GEN_PROMPTS)]


def generate(backend, stop: list[str]) -> dict:
    """{request key: (generated tokens, text, prompt length)} for GEN_PROMPTS, GEN_TOKENS new tokens at most."""
    from nano_eval.engine import BatchingConfig, Engine

    requests = _requests(stop)
    engine = Engine(backend, BatchingConfig(max_batch_tokens=GEN_BATCH_TOKENS), progress=False)
    results = engine.run_greedy(engine.prepare_greedy(requests))
    return {k: (r.tokens, r.text, len(r.input_tokens)) for k, r in sorted(results.items())}


def stop_from(generations: dict) -> list[str]:
    """A stop sequence that rows of this model hit at different steps: the 6th character of the first text."""
    return [next(iter(generations.values()))[1][5]]


def divergences(backend, stop: list[str], cached: dict, rerun: dict) -> dict:
    """{request key: (step, margin)} for the rows whose two generations (generate() results) differ: at the first
    step where they do, margin = log-prob of the re-run path's token - log-prob of the cached path's token, both from
    the backend's scoring forward after the prompt + the re-run path's tokens so far (None where one path ended
    there). In bf16 the two paths round differently (logits 0.05-0.08 apart on the toy models), so a row may part
    at a near-tie (|margin| <= NEAR_TIE) and then run on differently; anything else is a decoding error. Every rank
    of the replica calls it with the same arguments."""
    from nano_eval.data import LoglikelihoodDataset
    from nano_eval.engine import Engine
    from nano_eval.rows import plain_row

    engine = Engine(backend, progress=False)
    dataset = engine.prepare_greedy(_requests(stop))
    prompts = {row.segments[0].choices[0].key: row.segments[0].context for row in dataset.sorted_items}
    rows, steps = [], {}
    for key, (c, _, _) in cached.items():
        r = rerun[key][0]
        if c == r:
            continue
        step = next((i for i, (a, b) in enumerate(zip(c, r)) if a != b), min(len(c), len(r)))
        steps[key] = step
        if step < min(len(c), len(r)):
            context = prompts[key] + r[:step]
            rows += [plain_row((key, "rerun"), context, [r[step]]), plain_row((key, "cached"), context, [c[step]])]
    scores = engine.run_loglikelihood(LoglikelihoodDataset(rows)) if rows else {}
    return {key: (step, scores[(key, "rerun")].logprob - scores[(key, "cached")].logprob
                  if (key, "rerun") in scores else None) for key, step in steps.items()}


def assert_equal_up_to_near_ties(gen: dict, what: str) -> None:
    """A bf16 cached_and_rerun result: every row the same tokens on both paths, or parting at a near-tie."""
    for run in ("", "_stop"):
        for key, (step, margin) in gen["divergences" + run].items():
            assert margin is not None and abs(margin) <= NEAR_TIE, f"{what}{run} {key}: parts at step {step} ({margin})"
    assert len(gen["divergences"]) < len(gen["cached"]) / 2, f"{what}: most rows part"


def cached_and_rerun(backend, embedding) -> dict:
    """Generations of the backend's decoder and of the re-run path, under evaluation_mode: a run without stop
    sequences and one with `stop_from` (rows leave the batch at different steps), and their `divergences`; tokens
    through `embedding` (the input stage's embedding module, None on other stages) per path in the first run. Only
    where the backend has a decoder (else both paths would re-run the prompt)."""
    import time

    from nano_eval.backends.base import evaluation_mode

    embedded = []

    def count(module, args, kwargs, output):
        embedded.append((args[0] if args else kwargs["input_ids"]).numel())

    def counted(model_backend, stop):
        embedded.clear()
        return generate(model_backend, stop), sum(embedded)

    handle = embedding.register_forward_hook(count, with_kwargs=True) if embedding is not None else None
    out = {"decoder": backend.incremental_decoder() is not None, "tp_rank": backend.layout.tp_rank,
           "first_stage": handle is not None}
    start = time.perf_counter()
    try:
        with evaluation_mode(backend.module):
            if out["decoder"]:
                out["cached"], out["cached_tokens"] = counted(backend, [])
                out["rerun"], out["rerun_tokens"] = counted(Rerunning(backend), [])
                stop = stop_from(out["cached"])
                out["cached_stop"], out["rerun_stop"] = generate(backend, stop), generate(Rerunning(backend), stop)
                out["divergences"] = divergences(backend, [], out["cached"], out["rerun"])
                out["divergences_stop"] = divergences(backend, stop, out["cached_stop"], out["rerun_stop"])
    finally:
        if handle is not None:
            handle.remove()
    out["seconds"] = time.perf_counter() - start
    return out


def check_cost(gens: list[dict], row_multiple: int = 1) -> tuple[int, int]:
    """Assert the decoder's token count grows with prompt + answer and the re-run path's with their product;
    `gens`: cached_and_rerun of every rank; row_multiple: the decoder tops its batch up to a multiple of this
    many rows (the Megatron decoder under an interleaved pipeline). Each prompt runs once (its refill's prefill
    left-padded to at most the longest prompt), then one token per step, plus one filler token in the slot it refills.
    Returns (decoder tokens, re-run tokens) summed over DP."""
    gens = [g for g in gens if g["first_stage"] and g["tp_rank"] == 0]  # TP ranks embed the same tokens
    cached, rerun = sum(g["cached_tokens"] for g in gens), sum(g["rerun_tokens"] for g in gens)
    requests = gens[0]["cached"].values()  # (tokens, text, prompt length), gathered over DP
    longest, dp = max(n for _, _, n in requests), len(gens)
    per_rank = -(-len(requests) // dp)  # the DP sampler repeats requests to give every rank as many
    rows = dp * -(-per_rank // row_multiple) * row_multiple
    assert cached <= rows * (longest + GEN_TOKENS)  # each prompt once (left-padded), then one token per step
    assert rerun >= sum(n + t for tokens, _, n in requests for t in range(len(tokens)))  # prompt + answer so far
    assert rerun > 5 * cached
    return cached, rerun
