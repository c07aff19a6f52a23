"""The records of an epoch's update: the `UpdateBatch` an algorithm's `prepare` returns, the `MicroBatch` its
`terms` sees, and how the update scheduler (`flowrl.run.scheduler`) cuts one into the other: the epoch's plan
(`_Plan`: each row's elements and which process holds it) and a process's share of a mini-batch (`_Own`), from
which the micro-batches and their fully masked padding rows are made.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class UpdateBatch:
    """What an epoch's update trains on: an algorithm's `prepare` returns it.

    `N` rows make the epoch's batch over every process; `data` holds this process's (`rows` are their positions in
    the batch) or, with `rows` None, all of them (every process holds the same: a replay buffer).
    """

    data: object
    """A `Record` of rows (`DiffusionRollout`, `TokenRollout`, `ControlRollout`, `Transitions`, ...)."""
    rows: torch.Tensor | None
    """`[B]` the position of each row of `data` in the batch of every process; None: `data` is every row."""
    size: int
    """N, the rows of the batch over every process."""
    advantages: torch.Tensor
    """`[N]` (or `[N, K]`, per element) advantages of every row."""
    trainable: torch.Tensor
    """`[N]` bool: the rows that train (valid rewards, informative groups)."""
    group_ids: torch.Tensor | None = None
    """`[N]` the group of each row (its prompt; whole groups stay together when the algorithm updates groups)."""
    rewards: torch.Tensor | None = None
    """`[N]` the combined reward of each row (pairwise losses read it)."""
    mini_batches: list[torch.Tensor] | None = None
    """Rows of each optimizer step, given by the algorithm (DPOK's replay draws); None: the trainable rows shuffled
    every inner epoch and cut into `batch.mini_batch_size`."""


@dataclasses.dataclass
class MicroBatch:
    """One call's rows, as an algorithm's `terms` sees them (`[b]` and `[b, k]` tensors)."""

    data: object
    """The rows (`UpdateBatch.data.select(...)`)."""
    rows: torch.Tensor
    """`[b]` their positions in the batch."""
    index: torch.Tensor
    """`[b, k]` the element each row trains in each column."""
    valid: torch.Tensor
    """`[b, k]` bool: False for padding elements (text after the end of sequence; a padding row's)."""
    advantages: torch.Tensor
    """`[b]` or `[b, K]`."""
    rewards: torch.Tensor | None = None
    """`[b]` combined rewards."""
    group_ids: torch.Tensor | None = None
    """`[b]` groups."""
    row_valid: torch.Tensor | None = None
    """`[b]` bool: False for a padding row."""

    def __len__(self) -> int:
        return len(self.rows)


@dataclasses.dataclass
class _Plan:
    """An epoch's update batch with its elements and where its rows live (`UpdateScheduler.plan`)."""

    batch: UpdateBatch
    index: torch.Tensor
    valid: torch.Tensor
    lookup: torch.Tensor | None
    num_elements: int
    probe: bool = False


class _Own:
    """This process's rows of one mini-batch: their data rows, global rows, advantages, elements."""

    def __init__(self, batch: UpdateBatch, local, rows, advantages, index, valid):
        self.batch, self.local, self.rows, self.advantages = batch, local, rows, advantages
        self.index, self.valid = index, valid

    def __len__(self) -> int:
        return len(self.local)

    def micro_batch(self, chunk: torch.Tensor, pad: int = 0) -> MicroBatch:
        """The micro-batch of positions `chunk` and `pad` fully masked padding rows (they add nothing: a copy of
        this process's first row with no valid element and advantage 0)."""
        batch = self.batch
        local, rows, adv = self.local[chunk], self.rows[chunk], self.advantages[chunk]
        valid, row_valid = self.valid[local], torch.ones(len(chunk), dtype=torch.bool)
        if pad:
            first = torch.zeros(pad, dtype=torch.long)
            local = torch.cat([local, first])
            rows = torch.cat([rows, batch.rows[first] if batch.rows is not None else first])
            adv = torch.cat([adv, torch.zeros((pad, *adv.shape[1:]), dtype=adv.dtype)])
            valid = torch.cat([valid, torch.zeros_like(self.valid[first])])
            row_valid = torch.cat([row_valid, torch.zeros(pad, dtype=torch.bool)])
        pick = lambda t: None if t is None else t[rows]  # noqa: E731
        return MicroBatch(
            data=batch.data.select(local),
            rows=rows,
            index=self.index[local],
            valid=valid,
            advantages=adv,
            rewards=pick(batch.rewards),
            group_ids=pick(batch.group_ids),
            row_valid=row_valid,
        )


def _cat_micro(micro: list[MicroBatch]) -> MicroBatch:
    """The rows of several micro-batches as one (index, masks, advantages; no data)."""
    return MicroBatch(
        data=None,
        rows=torch.cat([m.rows for m in micro]),
        index=torch.cat([m.index for m in micro]),
        valid=torch.cat([m.valid for m in micro]),
        advantages=torch.cat([m.advantages for m in micro]),
        row_valid=torch.cat([m.row_valid for m in micro]),
    )
