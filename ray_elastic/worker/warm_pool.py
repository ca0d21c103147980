"""A warm pool: idle worker processes kept on each host, with Ray up and the
program's modules imported, for the next replacement worker to start in.

A replacement worker used to spend ~2.7 s of its ~4.3 s to ready here on
what no training state depends on: Ray starting a Python process and
loading the actor's class (~1.5 s), then unpickling the program factory,
which imports JAX, Flax and Optax (~1.2 s). Ray's raylet keeps a pool of
idle worker processes per (job, runtime environment) and hands a new actor
one of them when it has one; it can also start them ahead of demand
(`PrestartWorkers`, kept alive for a set time). So each worker, once set
up, asks its own raylet for one such process in its own runtime
environment, and that environment names a set-up hook (Ray's
`worker_process_setup_hook`) that imports JAX, Optax, this package's worker
and, on CPU slices, the program's module in every worker process at its
start, before any task reaches it. A replacement on
that host then finds a process with everything imported: creation to its
constructor takes ~0.01 s instead of ~2.7 s (`python -m bench ready`).

Only the imports run ahead: JAX's backend is not started, so the process
sees the accelerators Ray assigns it when the actor lands, like any other.

What it costs: one idle Python process per host with JAX imported (224 MB
resident, 107 MB of it its own, for the example), ~2 s of one core on each
start, then ~1% of a core while idle (Ray's own threads, as any idle
worker). `ElasticConfig.warm_workers=0` turns it off.

Two Ray internals are used, each behind one function here, and each
degrades to "no warm process" if a Ray release changes it: the raylet's
PrestartWorkers call (not exposed in Ray's Python API), and the variable
through which Ray passes a job's set-up hook to its workers (Ray honours
`worker_process_setup_hook` only in the job's runtime environment, not an
actor's).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
from typing import Callable, Optional

__all__ = ["KEEP_ALIVE_S", "PRELOAD_ENV", "STAMP_ENV", "hook_env", "keep_warm", "preload", "usable_by"]

log = logging.getLogger("ray_elastic")

PRELOAD_ENV = "RAY_ELASTIC_PRELOAD"
STAMP_ENV = "RAY_ELASTIC_PRELOAD_STAMP"
# How long an unused warm process is kept from Ray's idle-worker reaper
# (which otherwise keeps only as many idle processes as the node has free
# CPUs). A day: a run's failures are minutes to hours apart, and every
# replacement that takes one asks for the next.
KEEP_ALIVE_S = 24 * 3600
# Imported ahead in every worker process: what set-up imports anyway.
BASE_MODULES = ("numpy", "jax", "optax", "ray_elastic.worker.actor")


def _hook_var() -> Optional[str]:
    try:
        from ray._private import ray_constants

        return ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR
    except (ImportError, AttributeError):
        return None


def hook_env(program_factory: Callable, program_module: bool = True) -> dict[str, str]:
    """The workers' environment variables that run `preload` at the start
    of every worker process: the base modules and, with `program_module`,
    the program factory's module (unpickling the factory imports it, with
    its JAX, Flax, Optax). That module is the user's: it may touch JAX's
    backend at import, so it is preloaded only where no accelerator is
    assigned (CPU slices): Ray makes a worker's GPUs or TPU chips visible
    only when the actor lands, after the hook. Its file's size and time
    are part of the environment, so an edited module (a notebook's next
    run in the same job) gets new processes, never stale ones.
    Empty where this Ray has no such variable, or where the job already
    has its own set-up hook (an actor's variable would replace it)."""
    var = _hook_var()
    if var is None or os.environ.get(var) or _job_has_hook():
        return {}
    modules = list(BASE_MODULES)
    while isinstance(program_factory, functools.partial):
        program_factory = program_factory.func
    mod = getattr(program_factory, "__module__", None)
    env = {var: f"{__name__}.preload"}
    if program_module and mod and mod != "__main__" and mod not in modules:
        modules.append(mod)
        env[STAMP_ENV] = _stamp(mod)
    env[PRELOAD_ENV] = ",".join(modules)
    return env


def usable_by(env: dict[str, str]) -> dict[str, str]:
    """The variables a warm process must have (unset: "") for a worker of
    environment `env` (a run's: worker_env and hook_env) to start in it.
    A driver's earlier runs leave warm processes of other environments
    (another program, module edit or device count): Ray hands them to no
    worker of this run, and each would idle for its keep-alive (a day) at
    224 MB, so a run ends them as it starts (process_state.end_idle), as it
    releases slices kept for another program (cluster/kept_workers.py)."""
    return {PRELOAD_ENV: "", STAMP_ENV: "", **env}


def _stamp(module: str) -> str:
    """The module's file as the driver sees it: size and modification time."""
    try:
        spec = importlib.util.find_spec(module)
        st = os.stat(spec.origin) if spec and spec.origin else None
        return f"{st.st_size}-{st.st_mtime_ns}" if st else ""
    except (ImportError, ValueError, OSError):
        return ""


def _job_has_hook() -> bool:
    try:
        import ray

        if not ray.is_initialized():  # asking the runtime context would start a Ray of its own
            return False
        env = ray.get_runtime_context().runtime_env or {}
        return bool(env.get("worker_process_setup_hook")
                    or (env.get("env_vars") or {}).get(_hook_var() or ""))
    except Exception:  # not connected yet: nothing set
        return False


def preload() -> None:
    """Ray's set-up hook in each worker process: import what a worker's
    set-up will import. Never raises: Ray ends a worker whose hook fails,
    and a module that cannot be imported here is imported (and its error
    raised) where it is needed."""
    for name in filter(None, os.environ.get(PRELOAD_ENV, "").split(",")):
        try:
            importlib.import_module(name)
        except BaseException as e:  # noqa: BLE001 (see above; a module may even call sys.exit)
            log.debug("warm pool: could not preload %s: %s", name, e)


def keep_warm(num: int, keep_alive_s: float = KEEP_ALIVE_S) -> bool:
    """From inside a worker: ask this host's raylet to start `num` idle
    worker processes of this job, in this worker's runtime environment (so
    a replacement actor with the same options can be given one), kept
    alive for `keep_alive_s`. Returns whether the raylet took the request;
    never raises (a warm process only saves time)."""
    if num <= 0:
        return False
    try:
        import ray
        from ray._private.grpc_utils import init_grpc_channel
        from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc

        w = ray._private.worker.global_worker
        request = node_manager_pb2.PrestartWorkersRequest(
            language=common_pb2.PYTHON,
            job_id=w.current_job_id.binary(),
            runtime_env_info={"serialized_runtime_env": w.core_worker.get_current_runtime_env()},
            num_workers=num,
            keep_alive_duration_secs=int(keep_alive_s),
        )
        channel = init_grpc_channel(f"{w.node.node_ip_address}:{w.node.node_manager_port}")
        try:
            node_manager_pb2_grpc.NodeManagerServiceStub(channel).PrestartWorkers(request, timeout=10)
        finally:
            channel.close()
        return True
    except Exception as e:  # noqa: BLE001 (see above)
        log.warning("warm pool: could not ask the raylet for a warm worker process: %s", e)
        return False
