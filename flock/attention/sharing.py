"""Find, from a step's block tables, groups of requests whose tables begin with the same physical blocks."""

from dataclasses import dataclass

import numpy as np


@dataclass
class SharingGroup:
    members: list[int]  # request indices in the step
    num_blocks: int  # shared leading blocks, all computed before this step


def find_prefix_groups(
    block_tables: list[np.ndarray], usable_blocks: np.ndarray, min_blocks: int = 2
) -> list[SharingGroup]:
    """Groups that maximise the prefix reads saved, sum over groups of (members - 1) * shared blocks.

    `usable_blocks[i]` caps request i's sharable blocks (those fully computed before the step, so that every
    query of the group sits after the prefix and the prefix needs no mask). Requests are sorted by their
    tables, so a group is a run of neighbours; each run is either kept whole, at the depth all its members
    share, or split where that depth is reached and its parts grouped deeper (the best of the two, found
    recursively). A request is in at most one group: sharing is read at one level, like the kernel's.
    """
    rows = [i for i in range(len(block_tables)) if usable_blocks[i] >= min_blocks]
    if len(rows) < 2:
        return []
    # big-endian bytes of non-negative ids sort as the id sequences do (a sequence's own prefix first)
    keys = {i: block_tables[i][: usable_blocks[i]].astype(">i8").tobytes() for i in rows}
    rows.sort(key=keys.__getitem__)
    _, groups = _best(rows, _neighbour_lcp(block_tables, usable_blocks, rows), 0, len(rows) - 1, min_blocks)
    return groups


def _neighbour_lcp(block_tables: list[np.ndarray], usable_blocks: np.ndarray, rows: list[int]) -> list[int]:
    """Shared leading blocks of each pair of neighbours in `rows`."""
    lens = np.asarray(usable_blocks)[rows].astype(np.int64)
    table = np.full((len(rows), int(lens.max())), -1, dtype=np.int64)
    for j, i in enumerate(rows):
        table[j, : lens[j]] = block_tables[i][: lens[j]]
    differ = table[1:] != table[:-1]
    first = np.where(differ.any(axis=1), differ.argmax(axis=1), table.shape[1])
    return np.minimum(first, np.minimum(lens[1:], lens[:-1])).tolist()


def _best(rows: list[int], lcp: list[int], lo: int, hi: int, min_blocks: int) -> tuple[int, list[SharingGroup]]:
    """Best grouping of rows[lo..hi]; lcp[j] is the shared depth of rows[j] and rows[j + 1]."""
    if lo >= hi:
        return 0, []
    depth = min(lcp[lo:hi])
    whole = (hi - lo) * depth if depth >= min_blocks else 0
    saved, groups, start = 0, [], lo
    for j in range(lo, hi + 1):
        if j == hi or lcp[j] == depth:
            s, g = _best(rows, lcp, start, j, min_blocks)
            saved, groups, start = saved + s, groups + g, j + 1
    if whole > 0 and whole >= saved:
        return whole, [SharingGroup(rows[lo : hi + 1], depth)]
    return saved, groups
