"""`ElasticTrainer`: what a user makes and calls `fit()` on. Its arguments
are what a user sets; the control loop itself is control/controller.py."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from ray_elastic.callbacks import Callback, FunctionCallback
from ray_elastic.checkpoint.config import CheckpointConfig
from ray_elastic.checkpoint.state_forms import whole_state
from ray_elastic.config import ElasticConfig
from ray_elastic.control.controller import Controller
from ray_elastic.errors import ConfigError
from ray_elastic.failures.faults import Fault
from ray_elastic.program import TrainProgram

__all__ = ["ElasticTrainer"]


class ElasticTrainer(Controller):
    """Train `steps` steps of the program on `config.num_slices` slices,
    surviving failures by `config.policy`. `fit()` runs the training in
    this process (the Ray driver) and returns the RunReport.

    program_factory: a picklable zero-argument callable returning the
        TrainProgram; it runs inside each worker.
    callbacks: `Callback` objects (progress, metrics, event logs).
    checkpoint: durable Orbax checkpoints (CheckpointConfig); with one, a
        new run on the same path resumes from its newest committed step.
    keep_final_state: fetch the final training state (host numpy arrays)
        into `self.final_state` before the workers are torn down: under a
        replicated layout {"step", "params", "opt_state"} (the program's
        model state, if any, is in opt_state); under a sharded one a tuple
        with one {"step", "blocks", "host"} per host of a slice (each
        host's own blocks). `final_params()` gives the whole params tree
        either way.
    on_step: called in the driver after every completed step with
        (step, loss, live slice count); steps count from 1: `step` is the
        number of steps done, so a plain loop's `for i in range(n)` prints
        its i where this prints i + 1.
    on_event: called in the driver's main thread with each timeline event
        (a dict with "t" and "event"), e.g. to add a replacement node.
    faults: failures to inject (`Fault`), to see recovery for oneself;
        remove_node and freeze_node carry out the node faults on a local
        cluster (LocalCluster.remove_node / freeze_node).
    """

    def __init__(
        self,
        program_factory: Callable[[], TrainProgram],
        config: ElasticConfig,
        steps: int,
        *,
        callbacks: Sequence[Callback] = (),
        checkpoint: Optional[CheckpointConfig] = None,
        keep_final_state: bool = False,
        on_step: Optional[Callable[[int, float, int], None]] = None,
        on_event: Optional[Callable[[dict], None]] = None,
        faults: Sequence[Fault] = (),
        remove_node: Optional[Callable[[str], None]] = None,
        freeze_node: Optional[Callable[[str], None]] = None,
    ):
        if any((f.phase in ("grads", "sync")) != config.enable_diloco and f.phase != "grads" for f in faults):
            raise ConfigError("faults", "DiLoCo runs take faults at phase 'grads' (an inner step) or 'sync' (a "
                              "synchronization); other runs at 'grads', 'reduce' or 'apply'")
        if on_step is not None or on_event is not None:
            callbacks = [*callbacks, FunctionCallback(on_step, on_event)]
        super().__init__(
            program_factory, config, steps, callbacks=callbacks, checkpoint=checkpoint,
            keep_final_state=keep_final_state, faults=faults, remove_node=remove_node, freeze_node=freeze_node,
        )

    def whole_final_state(self) -> dict:
        """{"step", "params", "opt_state"} of whole host arrays after
        `fit()` with keep_final_state=True, whatever the layout (a sharded
        state's blocks are put together here, in the driver's memory)."""
        if self.final_state is None:
            raise ValueError("no final state: pass keep_final_state=True to ElasticTrainer and call fit() first")
        return whole_state(self.final_state, self._final_template)

    def final_params(self):
        """The final params tree of whole host arrays (see whole_final_state)."""
        return self.whole_final_state()["params"]
