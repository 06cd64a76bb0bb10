"""The tensor-parallel group of one engine: rank, world size, collectives, and the shard each rank loads.

Why process-group objects and no ``torch.distributed.init_process_group``: that call sets a process-wide default
group, and several engines must be able to live in one process. Each engine builds its own TCPStore (on a free
port of 127.0.0.1 chosen by the OS at start) and its own gloo (CPU) or NCCL (CUDA) group over it, and passes the
``TPGroup`` explicitly to the loader and the model. Every collective carries a timeout, so a peer that died or
hangs makes the surviving ranks raise instead of waiting forever (gloo notices a closed peer at once).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.errors import EngineError

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)  # a step or a load on one rank never takes this long
HOST = "127.0.0.1"


def make_store(world_size: int) -> dist.TCPStore:
    """The rendezvous store of rank 0 (the driver), on a port the OS picks; workers join it by ``store.port``."""
    return dist.TCPStore(HOST, 0, world_size, is_master=True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)


def join_store(port: int, world_size: int) -> dist.TCPStore:
    return dist.TCPStore(HOST, port, world_size, is_master=False, timeout=COLLECTIVE_TIMEOUT)


@dataclass
class TPGroup:
    """One rank's view of the tensor-parallel group. ``world_size`` 1 never builds one: the model then runs
    without collectives at all."""

    rank: int
    world_size: int
    device: torch.device
    process_group: object  # dist.ProcessGroupGloo or dist.ProcessGroupNCCL

    @staticmethod
    def create(store: dist.TCPStore, rank: int, world_size: int, device: torch.device) -> TPGroup:
        """Join the group (blocks until every rank has joined, or raises after COLLECTIVE_TIMEOUT)."""
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = COLLECTIVE_TIMEOUT
            group = dist.ProcessGroupNCCL(store, rank, world_size, options)
        else:
            group = dist.ProcessGroupGloo(store, rank, world_size, COLLECTIVE_TIMEOUT)
        return TPGroup(rank, world_size, device, group)

    @property
    def shard(self) -> TPShard:
        return TPShard(self.rank, self.world_size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it."""
        self.process_group.allreduce([x]).wait()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` [..., n] along the last dim, in rank order: [..., world_size * n]."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.process_group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)


@dataclass(frozen=True)
class TPShard:
    """What one rank loads: slice ``rank`` of ``world_size`` equal slices of each split dimension."""

    rank: int
    world_size: int

    def slice_of(self, size: int) -> tuple[int, int]:
        """[start, end) of this rank's slice of a dimension of ``size`` (which the caller checked divides)."""
        step = size // self.world_size
        return self.rank * step, (self.rank + 1) * step

    def vocab_slice(self, vocab_size: int) -> tuple[int, int]:
        """This rank's rows of the embedding and head: ceil(vocab / world) each, the last rank's possibly fewer
        (it pads its head to the common width so the gathered logits line up)."""
        step = self.vocab_width(vocab_size)
        return min(self.rank * step, vocab_size), min((self.rank + 1) * step, vocab_size)

    def vocab_width(self, vocab_size: int) -> int:
        """Rows of every rank's (padded) embedding and head slice."""
        return -(-vocab_size // self.world_size)


def check_divides(config, world_size: int) -> None:
    """Refuse, before any process starts, a model whose heads or MLP do not split ``world_size`` ways."""
    from engine.config import GEMMA3

    if config.architecture == GEMMA3:
        raise EngineError("tensor parallelism does not run Gemma 3 yet (its norms around attention and the MLP "
                          "are not split); use --tensor-parallel-size 1", param="tensor_parallel_size")
    for name, value in (("num_attention_heads", config.num_heads), ("num_key_value_heads", config.num_kv_heads),
                        ("intermediate_size", config.intermediate_size)):
        if value % world_size:
            raise EngineError(f"--tensor-parallel-size {world_size} does not divide the model's {name} ({value}): "
                              f"each rank needs an equal share; choose a size that divides {value}",
                              param="tensor_parallel_size")
