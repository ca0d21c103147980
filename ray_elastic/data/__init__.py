"""Data for a program's `make_batch`: a Grain pipeline read by record
index, so that step k's shard s is the same records on any slice count and
after any restart (grain_batches.py), and random-access packing of
variable-length documents into fixed rows (packing.py)."""

from ray_elastic.data.grain_batches import GrainBatches, GrainEvalBatches
from ray_elastic.data.packing import PackedDocuments

__all__ = ["GrainBatches", "GrainEvalBatches", "PackedDocuments"]
