"""Few-shot selection and context building, in lm-eval's format so scores match lm-eval's.

A context is `instruction + ex_1 + "\\n\\n" + ... + ex_k + "\\n\\n" + query`, where each example is its query
followed by its gold choice (choices carry their own leading space); a system prompt goes first, followed by
"\\n\\n". With a chat template the same parts become a conversation (lighteval's layout): the system prompt as the
system turn, each example as a user turn (its query) and an assistant turn (its gold choice), the instruction at the
start of the first user turn, the document's query as the last user turn; the template renders it as text. The examples chosen for a document depend only
on (task name, document index, seed): never on world size, rank, batching or the order documents are visited, so
every layout of the same run sees the same prompts.
"""

from __future__ import annotations

import hashlib
import random
from collections import defaultdict
from typing import Callable

from nano_eval.errors import NanoEvalError
from nano_eval.tasks.requests import Doc


def stable_seed(*parts: object) -> int:
    """A seed that is the same in every process and Python run (`hash()` is salted per process)."""
    digest = hashlib.sha256("|".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big")


def doc_identity(doc: Doc) -> tuple:
    """What makes two docs "the same item", so a doc is never its own few-shot example even across splits."""
    return (doc.query, tuple(doc.choices), tuple(doc.gold_indices()))


class PromptManager:
    """Builds the context of each document of one task from a pool of few-shot docs.

    `select` is the config's `few_shots_select`: "sequential" (pool order), "balanced" (round-robin over
    `fewshot_sorting_class`, pool shuffled once per seed), or "random"/None (a fresh sample per document).
    """

    def __init__(self, task_name: str, fewshot_docs: list[Doc] | None = None, select: str | None = None):
        self.task_name = task_name
        self.pool = list(fewshot_docs or [])
        self.select = select or "random"
        self._pool_ids = [doc_identity(d) for d in self.pool]
        self._balanced_orders: dict[int, list[int]] = {}

    @staticmethod
    def doc_to_text(doc: Doc) -> str:
        """The query without the instruction: the instruction is printed once, at the top of the context."""
        return doc.query.removeprefix(doc.instruction) if doc.instruction else doc.query

    @staticmethod
    def doc_to_target(doc: Doc) -> str:
        return doc.choices[doc.gold_indices()[0]]

    @classmethod
    def doc_to_fewshot_sorting_class(cls, doc: Doc) -> str:
        return doc.fewshot_sorting_class if doc.fewshot_sorting_class is not None else cls.doc_to_target(doc)

    def make_context(self, doc: Doc, doc_index: int, num_fewshot: int, seed: int = 0, system_prompt: str | None = None,
                     chat: Callable[[list[dict]], str] | None = None) -> str:
        """The full prompt for `doc`; with 0 shots and no system prompt or chat template exactly `instruction + query`.

        `chat` renders a list of {"role", "content"} messages as text (the tokenizer's chat template)."""
        examples = self.fewshot_examples(doc, doc_index, num_fewshot, seed)
        if chat is not None:
            return chat(self.chat_messages(doc, examples, system_prompt))
        shots = [self.doc_to_text(ex) + self.doc_to_target(ex) for ex in examples]
        head = f"{system_prompt}\n\n" if system_prompt else ""
        return head + (doc.instruction or "") + "".join(s + "\n\n" for s in shots) + self.doc_to_text(doc)

    def chat_messages(self, doc: Doc, examples: list[Doc], system_prompt: str | None = None) -> list[dict]:
        """The conversation of the module docstring; turns are stripped of surrounding whitespace."""
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        instruction = doc.instruction or ""
        for ex in examples:
            messages.append({"role": "user", "content": instruction + self.doc_to_text(ex).strip()})
            messages.append({"role": "assistant", "content": self.doc_to_target(ex).strip()})
            instruction = ""
        messages.append({"role": "user", "content": instruction + self.doc_to_text(doc).strip()})
        return messages

    def fewshot_examples(self, doc: Doc, doc_index: int, num_fewshot: int, seed: int = 0) -> list[Doc]:
        """`num_fewshot` pool docs for `doc` (never `doc` itself); NanoEvalError if the pool is too small."""
        if num_fewshot <= 0:
            return []
        own = doc_identity(doc)
        if self.select == "sequential":
            picked = self._first_k(range(len(self.pool)), own, num_fewshot)
        elif self.select == "balanced":
            picked = self._first_k(self._balanced_order(seed), own, num_fewshot)
        else:
            picked = self._random(own, doc_index, num_fewshot, seed)
        if len(picked) < num_fewshot:
            raise NanoEvalError(
                f"task {self.task_name!r}: {num_fewshot} few-shot examples asked for but the few-shot pool has only "
                f"{len(picked)} usable docs (the evaluated doc is excluded); lower num_fewshot or use a bigger "
                f"few_shots_split"
            )
        return [self.pool[i] for i in picked]

    def _first_k(self, order, own: tuple, k: int) -> list[int]:
        picked = []
        for i in order:
            if self._pool_ids[i] != own:
                picked.append(i)
                if len(picked) == k:
                    break
        return picked

    def _random(self, own: tuple, doc_index: int, k: int, seed: int) -> list[int]:
        """Sample k+1 and drop the doc itself (cheap for big pools); full shuffle only if duplicates of it remain."""
        rng = random.Random(stable_seed(self.task_name, doc_index, seed))
        n = len(self.pool)
        picked = self._first_k(rng.sample(range(n), min(n, k + 1)), own, k)
        if len(picked) < k < n:
            order = list(range(n))
            rng.shuffle(order)
            picked = self._first_k(order, own, k)
        return picked

    def _balanced_order(self, seed: int) -> list[int]:
        """Pool indices shuffled once per seed, then interleaved class by class (classes in sorted order)."""
        if seed not in self._balanced_orders:
            order = list(range(len(self.pool)))
            random.Random(stable_seed(self.task_name, "balanced", seed)).shuffle(order)
            by_class: dict[str, list[int]] = defaultdict(list)
            for i in order:
                by_class[str(self.doc_to_fewshot_sorting_class(self.pool[i]))].append(i)
            queues = [by_class[c] for c in sorted(by_class)]
            longest = max((len(q) for q in queues), default=0)
            self._balanced_orders[seed] = [q[r] for r in range(longest) for q in queues if r < len(q)]
        return self._balanced_orders[seed]
