"""ForwardBatch: everything one model forward needs about a ragged batch of new tokens over paged KV."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """A flat batch of ``num_tokens`` new tokens from ``num_seqs`` sequences (see kernels/reference.py).

    Sequence i owns rows ``query_start_loc[i]:query_start_loc[i+1]``; they are the last tokens of its
    context of ``context_lens[i]`` tokens. ``logits_indices`` picks the rows whose next token is sampled.
    """

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 for padding
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    context_lens: torch.Tensor  # [num_seqs] int32
    logits_indices: torch.Tensor  # [num_sampled] int64
    is_decode: bool  # every sequence has exactly one new token

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]
