"""Tiles measured fastest on one card, per kernel, weight shape and row bucket (``tuned/<kernel>.json``).

Why: a rule of thumb picks one tile for every shape, and on the H200 the transposed W4A16 kernel ran some
shapes up to 1.3x faster with another (7B gate/up at 128 rows: 78.8 us with the rule's 128-column tile, 60.6
with 64 columns; BENCHMARKS.md issue 16, session 16). Choosing at run time (Triton's autotuner) made the
choice depend on the first row count that reached a bucket, so the choices are measured offline instead
(``bench/kernels.py --sweep-mma``, graph replays over rotating weights) and kept per card, as vLLM keeps its
tuned MoE configs: a card or shape not in the table gets the rule.

A table maps the card's name (``torch.cuda.get_device_name``) to "KxN" (the weight's input and output sizes) to
the swept row count (as a string) to the tile. The sweep doubles its row counts (16, 32, ... 256), so a tile
chosen at R rows serves R / 2 < M <= R. A count where the sweep's best did not beat the rule has no entry, and
its rows get the rule, not a neighbour's tile (a 128-row tile at 32 rows ran the 7B gate/up 1.4x slower).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

TUNED_DIR = Path(__file__).with_name("tuned")


@functools.cache
def load_table(kernel: str) -> dict:
    """The whole table of ``kernel`` ({} when there is none): card -> "KxN" -> swept rows -> tile."""
    path = TUNED_DIR / f"{kernel}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def shape_key(k: int, n: int) -> str:
    return f"{k}x{n}"


@dataclass(frozen=True)
class TunedEntry:
    """One tile of a table: for a [k, n] weight on ``device``, it serves ``lower`` < M <= ``rows``."""

    device: str
    k: int
    n: int
    lower: int
    rows: int
    tile: dict


def _buckets(by_rows: dict) -> list[tuple[int, int]]:
    """(lower, rows) of each tabled row count of one shape, ascending: R serves R / 2 < M <= R."""
    return [(rows // 2, rows) for rows in sorted(int(rows) for rows in by_rows)]


def tuned_entries(kernel: str) -> list[TunedEntry]:
    """Every tile of ``kernel``'s table, each with the row counts it serves."""
    return [TunedEntry(device, int(shape.split("x")[0]), int(shape.split("x")[1]), lower, rows, by_rows[str(rows)])
            for device, shapes in load_table(kernel).items() for shape, by_rows in shapes.items()
            for lower, rows in _buckets(by_rows)]


def tuned_tile(kernel: str, device_name: str, k: int, n: int, m: int) -> dict | None:
    """The tile measured fastest for a [k, n] weight on ``device_name`` at the row bucket of ``m``, or None
    (no table, card or shape, or ``m`` outside the swept buckets)."""
    by_rows = load_table(kernel).get(device_name, {}).get(shape_key(k, n))
    if not by_rows:
        return None
    for lower, rows in _buckets(by_rows):
        if lower < m <= rows:
            return dict(by_rows[str(rows)])
    return None
