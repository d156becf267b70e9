"""What LoGRA holds for one sketched weight, declared once by LoGRA: for the memory planner,
which knows shapes only (``planning/state.py``), and for the accounting of a built model
(``logra/accounting.py``). Torch-free, so that a plan imports no torch module of LoGRA.

For a weight of ``out x in`` (this rank's tensor-parallel shard) sketched at ``rank``:
- a right sketch (column-parallel and vocabulary weights) is ``out x rank``: ``G P`` with the
  projection ``P`` of ``in x rank``; a left sketch (row-parallel) is ``rank x in``: ``P^T G``
  with ``P`` of ``out x rank``. The projected dimension is never split over TP.
- a *line* is what the projection does not mix: a right sketch's row, a left sketch's column.
  Per-line state (a row-wise rule's second moment, the norm probes' samples) has one entry per line.
- the norm probes (``--logra-norm-probes k``) keep ``k`` fp32 directions of the projected
  dimension and their ``k`` samples per line (``logra/sketch.py``).
- an fp32 master (``--logra-master fp32`` over bf16 weights) is the whole weight, or under
  ZeRO-1 this data-parallel rank's contiguous range of rows (``logra/masters.py``).
- a refresh (``logra/refresh.py``) holds, through one backward, a Gaussian test matrix of the
  non-projected side x (rank + oversampling) columns and the range sample of the projected side
  x the same columns.
"""

from dataclasses import dataclass

LEFT, RIGHT = "left", "right"
"""Sketch sides: right for column-parallel (and vocabulary) weights, left for row-parallel ones."""
FP32 = 4
"""Sketches, projections, probes and masters are fp32 whatever the weights' precision."""


def row_range_size(rows: int, parts: int, part: int) -> int:
    """Rows of ``part`` among ``parts`` near-equal contiguous ranges (``logra/masters.py:
    row_ranges`` lays them out)."""
    return rows * (part + 1) // parts - rows * part // parts


@dataclass(frozen=True)
class SketchedWeight:
    """One sketched weight, as this rank holds it: ``side``, its ``out x in`` shard, its rank."""

    side: str
    out_features: int
    in_features: int
    rank: int

    @property
    def projected_dim(self) -> int:
        """In-features of a right sketch, out-features of a left one."""
        return self.in_features if self.side == RIGHT else self.out_features

    @property
    def lines(self) -> int:
        """Rows of a right sketch (the weight's output rows), columns of a left one."""
        return self.out_features if self.side == RIGHT else self.in_features

    @property
    def sketch_shape(self):
        return (self.out_features, self.rank) if self.side == RIGHT else (self.rank, self.in_features)

    @property
    def sketch_numel(self) -> int:
        return self.lines * self.rank

    @property
    def projection_numel(self) -> int:
        return self.projected_dim * self.rank

    def probe_sample_numel(self, probes: int) -> int:
        """The norm probes' samples: ``probes`` per line (accumulated like the sketch, reduced with it)."""
        return probes * self.lines

    def probe_direction_numel(self, probes: int) -> int:
        """The norm probes' fixed directions: ``probes`` of the projected dimension."""
        return probes * self.projected_dim

    def master_numel(self, parts: int = 1, part: int = 0) -> int:
        """An fp32 master of the whole weight (``parts`` 1), or of data-parallel rank ``part``'s
        rows among ``parts`` (ZeRO-1)."""
        return row_range_size(self.out_features, parts, part) * self.in_features

    def refresh_numel(self, oversampling: int) -> int:
        """The test matrix and range sample a refresh holds through its backward."""
        columns = min(self.rank + oversampling, self.projected_dim)
        other = self.out_features if self.side == RIGHT else self.in_features
        return (other + self.projected_dim) * columns
