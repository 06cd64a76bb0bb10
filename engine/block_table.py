"""Host-side block tables, one numpy row per running request, updated by deltas between steps.

Rebuilding a [num_seqs, max_blocks] table from Python lists every step costs O(context) per request (a
4k-token context is 256 entries; 128 such requests make a step's input preparation milliseconds of Python).
A request's table only changes at its tail between steps (new blocks appended, the block being written
replaced by copy-on-write), so each step rewrites the entries from the first block the step writes into, and a
gather of the batch's rows (numpy, C speed) yields the step's table. A preempted or finished request's row is
dropped (``free``): when it comes back, its table is written whole once, as its prefill is.
"""

from __future__ import annotations

import numpy as np


class BlockTableRows:
    """Rows of block ids keyed by request id; row width ``max_blocks`` covers ``max_model_len`` tokens."""

    def __init__(self, max_blocks: int, initial_rows: int = 16):
        self.max_blocks = max_blocks
        self.table = np.zeros((initial_rows, max_blocks), dtype=np.int32)  # [rows, max_blocks]
        self._row_of: dict[str, int] = {}
        self._free_rows = list(range(initial_rows - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._row_of)

    def update(self, request_id: str, block_table: list[int], first_written_block: int) -> int:
        """Write ``block_table[first_written_block:]`` (all of it for a new row); returns the request's row."""
        if len(block_table) > self.max_blocks:
            raise ValueError(f"block table of {len(block_table)} blocks exceeds the row width {self.max_blocks}")
        row = self._row_of.get(request_id)
        start = max(0, first_written_block)
        if row is None:
            row = self._new_row(request_id)
            start = 0
        self.table[row, start:len(block_table)] = block_table[start:]
        return row

    def gather(self, rows: list[int], width: int) -> np.ndarray:
        """The step's table [len(rows), width]; entries past a request's blocks are stale and never read."""
        return self.table[rows, :width]

    def free(self, request_id: str) -> None:
        row = self._row_of.pop(request_id, None)
        if row is not None:
            self._free_rows.append(row)

    def _new_row(self, request_id: str) -> int:
        if not self._free_rows:
            old = self.table.shape[0]
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        row = self._free_rows.pop()
        self._row_of[request_id] = row
        return row
