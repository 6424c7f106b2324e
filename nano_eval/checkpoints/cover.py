"""Does a set of saved pieces cover a tensor exactly once? Sharded checkpoints (nanotron's slice pairs, megatron-core's
torch_dist chunks) describe each piece as a box (offsets, sizes) of the full tensor; a loader copies the pieces into
a tensor that starts as uninitialised memory or as the new model's random values. A gap leaves those values in the
weights (plausible scores of a model nobody trained, different from one load to the next), and two pieces writing
one element make the result depend on the read order: both are refused before anything is read."""

from __future__ import annotations

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes), one entry per dimension


def _numel(sizes) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def cover_problem(size: tuple[int, ...], boxes: list[Box]) -> str | None:
    """None when `boxes` cover every element of a tensor of `size` exactly once; otherwise what is wrong, in words.

    Counting elements first: with as many elements as the tensor, a gap implies an overlap. Overlaps are looked for
    among boxes sorted by their first offset, comparing each only with the boxes that start before it ends on the
    first dimension (the usual layouts split one dimension: about linear)."""
    for offsets, sizes in boxes:
        if len(offsets) != len(size) or len(sizes) != len(size) or any(
                o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, sizes, size)):
            return f"a piece at {list(offsets)} of size {list(sizes)} lies outside the tensor's {list(size)}"
    boxes = sorted(b for b in boxes if _numel(b[1]) > 0)
    held, total = sum(_numel(sizes) for _, sizes in boxes), _numel(size)
    if held != total:
        return f"its pieces hold {held:,} elements, its size {list(size)} has {total:,}"
    for i, (offsets, sizes) in enumerate(boxes):
        for other, other_sizes in boxes[i + 1:]:
            if other and other[0] >= offsets[0] + sizes[0]:
                break
            if all(b < a + n and a < b + m for a, n, b, m in zip(offsets, sizes, other, other_sizes)):
                return f"its pieces at {list(offsets)} and {list(other)} overlap"
    return None
