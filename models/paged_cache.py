"""A paged KV cache's bookkeeping, on the host: a pool of fixed-size pages and the page table of each slot.

The cache itself lives on the device as one array per layer and per K / V, `[pages * page_size, kv_heads,
head_dim]`; a row's token at logical position `pos` sits at `table[slot, pos // page_size] * page_size + pos %
page_size`. This module decides which pages a slot holds; the compiled programs (models/stream.py) only read the
table. Page 0 is the scratch page: it is never handed out, and every write that must go nowhere (an idle slot, a
row that has finished, a prompt's left padding) lands there, so no program needs a data-dependent shape.
"""
from __future__ import annotations

import numpy as np

SCRATCH_PAGE = 0


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold `tokens` tokens."""
    return -(-int(tokens) // int(page_size))


class PagePool:
    """The free list of a pool of `pages` pages (page 0, the scratch page, excluded) and each slot's pages.

    `table` ([slots, pages_per_row] int32) is what the device programs read: a slot's pages in logical order,
    padded with the scratch page. Pages are handed out lowest first, so a run's placement is a pure function of
    its schedule (reproducible), and returned when a slot is released.
    """

    def __init__(self, pages: int, page_size: int, slots: int, pages_per_row: int):
        if pages < 2:
            raise ValueError(f"a page pool needs at least 2 pages (one is the scratch page), got {pages}")
        if page_size < 1 or slots < 1 or pages_per_row < 1:
            raise ValueError(f"page_size, slots and pages_per_row must be >= 1, got {page_size}, {slots}, "
                             f"{pages_per_row}")
        self.pages, self.page_size, self.pages_per_row = int(pages), int(page_size), int(pages_per_row)
        self._free = list(range(self.pages - 1, SCRATCH_PAGE, -1))  # a stack: pop() gives the lowest page
        self._held: list[list[int]] = [[] for _ in range(slots)]
        self.table = np.full((slots, self.pages_per_row), SCRATCH_PAGE, np.int32)

    @property
    def free(self) -> int:
        """Pages not held by any slot (the scratch page not counted)."""
        return len(self._free)

    @property
    def usable(self) -> int:
        """Pages that can be handed out: all but the scratch page."""
        return self.pages - 1

    def held(self, slot: int) -> int:
        """Pages slot `slot` holds."""
        return len(self._held[slot])

    def grow(self, slot: int, tokens: int) -> bool:
        """Make slot `slot` hold pages for its first `tokens` tokens. False (nothing taken) when the pool has too
        few free pages; ValueError when a row that long exceeds pages_per_row."""
        need = pages_for(tokens, self.page_size) - len(self._held[slot])
        if pages_for(tokens, self.page_size) > self.pages_per_row:
            raise ValueError(f"a row of {tokens} tokens needs more than pages_per_row={self.pages_per_row} pages")
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        for _ in range(need):
            page = self._free.pop()
            self.table[slot, len(self._held[slot])] = page
            self._held[slot].append(page)
        return True

    def release(self, slot: int) -> None:
        """Return every page of slot `slot` to the pool."""
        pages = self._held[slot]
        self._free.extend(pages)
        self._free.sort(reverse=True)
        self._held[slot] = []
        self.table[slot] = SCRATCH_PAGE
