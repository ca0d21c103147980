"""The driver's side of the cross-slice exchange (`exchange="reduce_scatter"`,
the default): which calls make a step's reduce-scatter and all-gather.

Every sending host cuts its gradient into one chunk per owner
(worker/chunks.py); chunk c's owner is the c-th live slice's worker of the
same host index (round robin when fewer slices are live than the step has
chunks: after a loss mid-step, survivors take over the lost owner's
chunks). The owner's `reduce_chunk` call takes chunk c of every source and
sums it; every host's apply takes every owner's sum. The refs go from call
to call; the driver never holds a value. Up to two slices a gradient is
one chunk and there is no owner: every apply takes every slice's chunk and
sums them itself. At two slices that moves what the ring moves (the other
slice's gradient: 2(n-1)/n = 1 of it) with one call fewer on the step's
path: with owners, the extra hop cost 2 slices a 0.159 s median step
against the direct hand-off's 0.140 s (`python -m bench exchange --sizes 2`).

A source is one gradient call's returns: a live slice's host, or, when a
step is finished after a loss, both a survivor's first call and its call
for the lost slice's shards (each covers other shards: the sums are keyed
by shard, so nothing is counted twice).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

from ray_elastic.dispatch.calls import Call
from ray_elastic.dispatch.exchange_plan import ExchangePlan
from ray_elastic.dispatch.tree import Part

__all__ = ["MAX_CHUNKS", "ExchangeSpec", "issue_exchange", "sources_of"]

# At most this many chunks (owners) per step. Each gradient call returns
# one ref per chunk and each owner's call takes one per slice: the driver
# handles about 3 x slices x chunks refs a step, which past a few dozen
# slices would cost it more than the bytes saved. Up to 16 slices a host
# moves the ring bound; above, the 16 owners take in (n-1)/16 of a
# gradient each and the other hosts 15/16 (group leaders, for hundreds of
# slices, keep the direct hand-off and its tree).
MAX_CHUNKS = 16


@dataclasses.dataclass(frozen=True)
class ExchangeSpec:
    """What every step's plan shares: the blocks (the configured slice
    count: one block per slice of the full membership) and the wire's dtype."""

    blocks: int
    wire_dtype: Optional[str] = None
    step_program: str = "auto"  # ElasticConfig.one_slice_program

    def plan(self, assignment: Mapping, chunks: int, fan_in: int) -> ExchangePlan:
        """The plan of a step with this `assignment` (slice -> shards), cut
        into `chunks` (at most MAX_CHUNKS; one for two slices or fewer)."""
        shards = tuple(sorted(sh for shards in assignment.values() for sh in shards))
        return ExchangePlan(chunks=1 if chunks <= 2 else min(chunks, MAX_CHUNKS), blocks=self.blocks, shards=shards, fan_in=fan_in,
                            wire_dtype=self.wire_dtype, step_program=self.step_program)

    def args(self, assignment: Mapping, fan_in: int, payload_sets: tuple, live: int = 0) -> dict:
        """The exchange over these gradient calls' returns (slice -> {host:
        chunk refs}): their `sources` and `plan`, cut as their step was
        (into `live` chunks if none holds any)."""
        cut = [len(refs) for payloads in payload_sets for hosts in payloads.values() for refs in hosts.values()]
        return {"sources": sources_of(*payload_sets), "plan": self.plan(assignment, cut[0] if cut else live, fan_in)}


def sources_of(*payload_sets: Mapping) -> list:
    """(slice, host, chunk refs) of every gradient call in the sets (slice -> {host: chunk refs})."""
    return [(s, h, refs) for payloads in payload_sets for s in sorted(payloads)
            for h, refs in sorted(payloads[s].items())]


def issue_exchange(runner, k: int, live: Mapping, sources: list, plan: ExchangePlan,
                   groups: int) -> tuple[list, dict]:
    """The reduce calls of step k's exchange on the live slices (none with
    one owner), as `runner`'s Calls, and for each sending host index (one
    per host under a sharded layout, else 1) the Parts its applies take,
    in chunk order. Under a replicated layout the non-sending hosts'
    (empty) chunks go to the owners too, so every apply waits for every
    gradient call of its step."""
    owners = sorted(live)
    calls: list = []
    tops: dict = {}
    for g in range(groups):
        mine = [refs for s, h, refs in sources if groups == 1 or h == g]
        if plan.chunks == 1:  # no owner: the applies sum the chunks
            tops[g] = [Part(0, [r for refs in mine for r in refs])]
            continue
        parts = []
        for c in range(plan.chunks):
            s = owners[c % len(owners)]
            part = Part(c, [])

            def call(w=live[s].workers[g], c=c, inputs=[refs[c] for refs in mine], part=part):
                status, summed = w.reduce_chunk.options(num_returns=2).remote(k, plan, c, inputs, runner.epoch)
                part.refs = [summed]  # a re-issue's sum replaces the first try's
                return status

            calls.append(Call(s, g, call(), call, lambda part=part: tuple(part.refs)))
            parts.append(part)
        tops[g] = parts
    return calls, tops
