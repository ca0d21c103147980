"""Durable checkpoints of a DiLoCo run (control/diloco.py), with Orbax
through the same CheckpointStore as every run's (commit, checksums, keep,
GCS), at any step, mid-round included.

One step holds everything a round needs to go on exactly: the global
params and the outer optimizer state, every live replica's inner params
and optimizer state, and (under pause, mid-round) each replica's inner
optimizer state of the round's start, from which a replacement recomputes
the round (its params then were the global params; under Streaming
DiLoCo, where a round starts at each fragment's synchronization and the
replicas' other leaves are their own, its params too). The meta records the
round's start and the replicas, beside the run facts a resumed run must
share (seed, batch_shards, the replica count).

The driver gathers the replicas' states and writes the step itself, with
the run waiting: a state is whole in its memory for the write (a sharded
one too, put together from its hosts' blocks). It answers the controller
as the ordinary saves do (saves.py: after_step, at_end, now, ...).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

from ray_elastic.checkpoint.config import CheckpointConfig
from ray_elastic.checkpoint.state_forms import FlatState, WholeState, final_state, whole_state
from ray_elastic.checkpoint.store import CheckpointStore, unflatten
from ray_elastic.errors import ConfigError

__all__ = ["DilocoCheckpoints"]

log = logging.getLogger("ray_elastic")


def _key(replica: int) -> str:
    return f"r{replica}"


class DilocoCheckpoints:
    """The saves and the cold start of a DiLoCo run's `rounds`."""

    def __init__(self, config: CheckpointConfig, facts: dict, spec: Any, steps: int, policy: str,
                 emit: Callable[..., None]):
        self._config = config
        self._store = CheckpointStore(config.path, keep=config.keep, retries=config.storage_retries,
                                      backoff_s=config.retry_backoff_s)
        self._facts, self._spec, self._steps, self._policy, self._emit = facts, spec, steps, policy, emit
        self._last_saved: Optional[int] = None
        self.rounds: Any = None  # control/diloco.py's Rounds, and the run's membership: set by `bind`
        self.members: Any = None

    def bind(self, rounds: Any, members: Any) -> "DilocoCheckpoints":
        self.rounds, self.members = rounds, members
        return self

    # -- before any slice ---------------------------------------------------

    def preflight(self) -> Optional[int]:
        """The storage checked writable; the step a new run resumes from
        (None: none committed), its facts checked against this run's."""
        self._store.preflight()
        step = self._store.latest_committed()
        if step is None:
            return None
        meta = self._store.read_meta(step)
        if "diloco" not in meta:
            raise ConfigError("checkpoint.path", f"{self._config.path} holds step {step} of a run without DiLoCo; "
                              "point checkpoint.path elsewhere, or set enable_diloco=False to resume it")
        for name, value in self._facts.items():
            have = meta["diloco"].get(name, meta.get(name))
            if have is not None and have != value:
                setting = {"num_replicas": "num_slices"}.get(name, name)
                raise ConfigError(setting, f"the checkpoint at {self._config.path} (step {step}) was written with "
                                  f"{name}={have}; this run has {value}. Set {setting}={have} to resume it")
        return step

    def latest(self) -> Optional[int]:
        """The newest committed step (None: none)."""
        return self._store.latest_committed()

    # -- what the controller calls (as saves.py's) ------------------------------

    def due(self, step: int) -> bool:
        every = self._config.save_every
        return bool(every) and step > 0 and step % every == 0

    def after_step(self, step: int) -> None:
        if self.due(step):
            self.now(step, self._config.save_timeout_s)

    def at_end(self, step: int) -> None:
        if self._config.save_at_end and self._last_saved != step:
            self.now(step, self._config.save_timeout_s)

    def now(self, step: int, timeout_s: float) -> bool:
        """Save the step held now; False (reported as `checkpoint_failed`)
        if a slice or the storage failed meanwhile: the run goes on, a
        lost slice is found at the next step, the next save tries again."""
        try:
            self.save(step, timeout_s)
            return True
        except Exception as e:
            log.warning("DiLoCo checkpoint of step %d failed: %s", step, e)
            self._emit("checkpoint_failed", step=step, reason=f"{type(e).__name__}: {e}")
            return False

    def before_preemption(self, step: int, slice_id: int, noticed_at: float, timeout_s: float) -> None:
        if self._last_saved != step:
            self.now(step, timeout_s)

    def settle(self) -> None:
        pass  # every save is done when `save` returns

    def finish(self, timeout_s: float = 60.0) -> None:
        pass

    def keep_before_error(self, step: int, error: BaseException, keep_final: bool, emit: Callable) -> None:
        return None

    # -- the step's contents -----------------------------------------------------

    def _templates(self) -> tuple[dict, dict]:
        """(the inner state's template, the outer one's: global params as
        params, the outer optimizer state as opt_state)."""
        import jax

        backend = self.members.backend
        inner = backend.template(min(self.members.live))
        return inner, {"params": inner["params"], "opt_state": jax.eval_shape(self._spec.optimizer().init, inner["params"])}

    def _whole(self, copy: Any, template: dict) -> dict:
        """{"params", "opt_state"} whole host arrays of a copy in any form."""
        if isinstance(copy, FlatState):
            return unflatten(copy.flat, template)
        out = whole_state(final_state(copy), template)
        return {"params": out["params"], "opt_state": out["opt_state"]}

    def save(self, step: int, timeout_s: float = 600.0) -> None:
        t0 = time.perf_counter()
        rounds, backend = self.rounds, self.members.backend
        # A synchronization in flight is in first: the global params are a boundary's.
        if not rounds.settle(step, timeout_s, whole=True):
            raise RuntimeError("a replica was lost while its synchronization moved; the step is saved once its "
                               "replacement has joined")
        live = sorted(self.members.live)
        inner_t, outer_t = self._templates()

        def fetch(ref):
            return backend.fetch(ref, timeout_s=max(1.0, timeout_s - (time.perf_counter() - t0)))
        replicas = {}
        for s in live:
            replicas[_key(rounds.replicas[s])] = self._whole(fetch(backend.state(s)), inner_t)
        outer = self._whole(fetch(backend.outer_copy(live[0])), outer_t)
        state = {"global": outer["params"], "outer": outer["opt_state"], "replicas": replicas}
        starts = rounds.round_state_refs(backend.node_alive) if step != rounds.round_start else {}
        if starts:
            whole = {r: self._whole(fetch(ref), inner_t) for r, ref in starts.items()}
            state["round_start_opt"] = {_key(r): w["opt_state"] for r, w in whole.items()}
            if self._spec.streaming:
                state["round_start_params"] = {_key(r): w["params"] for r, w in whole.items()}
        meta = {**self._facts, "step": step, "diloco": {
            "round_start": rounds.round_start, "replicas": sorted(rounds.replicas[s] for s in live),
            "num_replicas": self._facts["num_replicas"], "round_start_states": sorted(starts)}}
        info = self._store.save(step, state, meta)
        self._last_saved = step
        self._emit("checkpoint_saved", step=step, bytes=info.get("bytes"), seconds=round(time.perf_counter() - t0, 3),
                   diloco=True)

    def cold_start(self, step: int, timeout_s: float, load: Callable = None) -> int:
        """Load the step into the live slices: each its replica's inner
        state, every host the global params and outer state; the round's
        start and its replicas' round-start states as they were."""
        rounds, backend = self.rounds, self.members.backend
        live = sorted(self.members.live)
        meta = self._store.read_meta(step)["diloco"]
        inner_t, outer_t = self._templates()
        saved = [int(r) for r in meta["replicas"]]
        template = {"global": outer_t["params"], "outer": outer_t["opt_state"],
                    "replicas": {_key(r): inner_t for r in saved}}
        if meta.get("round_start_states"):
            template["round_start_opt"] = {_key(r): inner_t["opt_state"] for r in meta["round_start_states"]}
            if self._spec.streaming:
                template["round_start_params"] = {_key(r): inner_t["params"] for r in meta["round_start_states"]}
        state, _ = self._store.restore(step, template)
        rounds.round_start = int(meta["round_start"])
        replicas = rounds.replica_map(live)
        for s in live:
            if replicas[s] not in saved:
                # The checkpoint has no state of this replica (it had left
                # its round): it joins as a replacement would, ready again.
                self.members.live.discard(s)
                self.members.ready.add(s)
                continue
            mine = state["replicas"][_key(replicas[s])]
            backend.load([s], WholeState(step, mine["params"], mine["opt_state"]), timeout_s)
        live = sorted(self.members.live)
        backend.load_outer(live, WholeState(rounds.round_start, state["global"], state["outer"]), timeout_s)
        if step == rounds.round_start:
            rounds.keep_round_states({replicas[s]: c for s, c in backend.round_states(live).items()})
        elif "round_start_opt" in state:
            params = state.get("round_start_params", {})
            rounds.keep_round_states({int(k[1:]): [(backend.put(WholeState(rounds.round_start, params.get(k, state["global"]),
                                                                           opt)), ())]
                                      for k, opt in state["round_start_opt"].items()})
        self._last_saved = step
        return step
