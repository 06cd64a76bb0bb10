"""Host block-table rows updated by deltas give the same tables as rebuilding them every step."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine.block_table import BlockTableRows
from engine.cuda_graph import capture_sizes


def test_deltas_reproduce_full_tables_through_growth_cow_preemption_and_reuse():
    rng = random.Random(0)
    rows = BlockTableRows(max_blocks=40, initial_rows=2)  # forces the row array to grow
    block_size = 4
    tables: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    next_block = 0
    for step in range(400):
        request_id = f"r{rng.randrange(12)}"
        action = rng.random()
        if action < 0.1 and request_id in tables:  # preempted or finished: the row is dropped
            rows.free(request_id)
            del tables[request_id], computed[request_id]
            continue
        table = tables.setdefault(request_id, [])
        done = computed.setdefault(request_id, 0)
        new_tokens = rng.choice([1, 1, 1, 5, 13])
        if (done + new_tokens + block_size - 1) // block_size > 40:
            continue
        if done % block_size and action < 0.3:  # copy-on-write replaces the partly filled block written next
            table[done // block_size] = next_block
            next_block += 1
        while len(table) * block_size < done + new_tokens:
            table.append(next_block)
            next_block += 1
        row = rows.update(request_id, list(table), done // block_size)
        computed[request_id] = done + new_tokens
        np.testing.assert_array_equal(rows.gather([row], len(table))[0], table)
    live = list(tables)
    gathered = rows.gather([rows.update(r, tables[r], computed[r] // block_size) for r in live], 40)
    for request_id, got in zip(live, gathered):
        np.testing.assert_array_equal(got[:len(tables[request_id])], tables[request_id])
    assert len(rows) == len(live)


def test_row_width_is_enforced():
    rows = BlockTableRows(max_blocks=3)
    with pytest.raises(ValueError, match="exceeds the row width"):
        rows.update("a", [1, 2, 3, 4], 0)


@pytest.mark.parametrize("max_batch", [1, 3, 8, 9, 64, 256])
def test_capture_sizes_cover_every_batch(max_batch):
    sizes = capture_sizes(max_batch)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1
    for n in range(1, max_batch + 1):
        padded = next(s for s in sizes if s >= n)
        assert padded - n < max(8, n // 2)  # small batches pad to powers of two, large ones by < 1/3


def _step(ids, positions, slots, starts, ctx, tables, logits, decode):
    from engine.cuda_graph import StepInputs

    return StepInputs(np.array(ids, np.int64), np.array(positions, np.int64), np.array(slots, np.int64),
                      np.array(starts, np.int32), np.array(ctx, np.int32), np.array(tables, np.int32),
                      np.array(logits, np.int64), decode)


def test_graph_buffers_pad_a_ragged_step_so_padding_touches_nothing():
    """What a ragged graph reads: real rows as given, padding tokens in no sequence and written nowhere."""
    import torch

    from engine.cuda_graph import StaticBuffers

    buffers = StaticBuffers(max_tokens=16, max_seqs=4, max_blocks=3, device=torch.device("cpu"))
    # a 3-token prefill chunk (context 5) and a decode (context 9), padded to 8 tokens and 4 sequences
    step = _step([7, 8, 9, 4], [2, 3, 4, 8], [18, 19, 20, 40], [0, 3, 4], [5, 9], [[4, 5, 0], [2, 10, 11]],
                 [2, 3], False)
    buffers.load(step, num_tokens=8, num_seqs=4)
    batch = buffers.batch(8, 4, is_decode=False)
    assert batch.input_ids.tolist() == [7, 8, 9, 4, 0, 0, 0, 0]
    assert batch.slot_mapping.tolist() == [18, 19, 20, 40, -1, -1, -1, -1]  # -1: the cache kernel skips them
    assert batch.query_start_loc.tolist() == [0, 3, 4, 4, 4]  # padding sequences own no rows
    assert batch.block_tables[:2].tolist() == [[4, 5, 0], [2, 10, 11]]
    assert batch.logits_indices.tolist()[:2] == [2, 3]
    # a smaller decode step afterwards: its padding rows are one-token sequences of their own
    buffers.load(_step([3], [6], [22], [0, 1], [7], [[4, 5]], [0], True), num_tokens=2, num_seqs=2)
    decode = buffers.batch(2, 2, is_decode=True)
    assert decode.slot_mapping.tolist() == [22, -1] and decode.context_lens.tolist() == [7, 1]
    assert decode.query_start_loc.tolist() == [0, 1, 2]
    assert decode.block_tables[0, :2].tolist() == [4, 5] and decode.block_tables[1, 0] == 0  # pad: 1 token, block 0
