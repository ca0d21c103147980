"""The warm pool (worker/warm_pool.py): the workers' set-up hook, and on a real
cluster, a replacement for a SIGKILLed worker starting in the idle process
its predecessor asked for, with the program's modules already imported."""

from __future__ import annotations

import functools
import os
import signal
import sys
import time

import pytest

from ray_elastic import ConfigError, ElasticConfig
from ray_elastic.paths import work_path
from ray_elastic.worker.warm_pool import PRELOAD_ENV, STAMP_ENV, hook_env, preload


def test_hook_env_preloads_the_factorys_module_through_partials():
    import examples.lm as lm

    env = hook_env(functools.partial(functools.partial(lm.make_program), lm.LMConfig()))
    modules = env[PRELOAD_ENV].split(",")
    assert modules[-1] == "examples.lm" and "jax" in modules and "ray_elastic.worker.actor" in modules
    (hook,) = [v for k, v in env.items() if k not in (PRELOAD_ENV, STAMP_ENV)]
    assert hook == "ray_elastic.worker.warm_pool.preload"


def test_hook_env_preloads_no_user_module_where_accelerators_are_assigned_later():
    import examples.lm as lm

    cpu, accel = hook_env(lm.make_program), hook_env(lm.make_program, program_module=False)
    assert "examples.lm" in cpu[PRELOAD_ENV] and "examples.lm" not in accel[PRELOAD_ENV]
    # The module file's size and time: an edited module gets new processes.
    st = os.stat(lm.__file__)
    assert cpu[STAMP_ENV] == f"{st.st_size}-{st.st_mtime_ns}" and STAMP_ENV not in accel


def test_a_gpu_slices_workers_preload_only_the_base_modules():
    from ray_elastic.config import GpuSlice
    from ray_elastic.cluster.slice_group import RaySlices
    import examples.lm as lm

    env = RaySlices(GpuSlice(), lm.make_program, 0, 1, "t", warm_workers=1)._env
    assert "examples.lm" not in env[PRELOAD_ENV] and "jax" in env[PRELOAD_ENV]
    assert PRELOAD_ENV not in RaySlices(GpuSlice(), lm.make_program, 0, 1, "t", warm_workers=0)._env


def test_hook_env_leaves_out_main_and_yields_to_the_jobs_own_hook(monkeypatch):
    def factory():
        pass

    factory.__module__ = "__main__"  # a notebook's or script's function: shipped by value
    assert "__main__" not in hook_env(factory)[PRELOAD_ENV]
    (var,) = [k for k in hook_env(factory) if k not in (PRELOAD_ENV, STAMP_ENV)]
    monkeypatch.setenv(var, "user_module.their_hook")  # the job set a hook: an actor's would replace it
    assert hook_env(factory) == {}


def test_hook_env_before_ray_is_connected_starts_no_ray():
    """Asked before the driver connects (a test run's first tests), the
    job's own hook is looked for without starting a local Ray, which the
    driver's later ray.init(address) would then not replace."""
    import subprocess

    code = ("import ray\nfrom ray_elastic.worker.warm_pool import hook_env\n"
            "def factory(): pass\nassert hook_env(factory)\nprint(ray.is_initialized())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "RAY_ADDRESS": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_preload_imports_what_it_can_and_never_raises(monkeypatch, tmp_path):
    sys.modules.pop("colorsys", None)
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(PRELOAD_ENV, "no_such_module_xyz,exits_on_import,colorsys,,")
    preload()  # Ray ends a worker whose set-up hook raises
    assert "colorsys" in sys.modules


@pytest.mark.parametrize("bad", [-1, 2, 1.5, "1", None])
def test_warm_workers_must_be_a_count(bad):
    with pytest.raises(ConfigError, match="warm_workers"):
        ElasticConfig(warm_workers=bad)
    assert ElasticConfig().warm_workers == 1 and ElasticConfig(warm_workers=0).warm_workers == 0


def _warm_processes(exclude=(), tag: str = PRELOAD_ENV) -> dict:
    """pid -> whether JAX's native library is loaded, for every process with
    `tag` in its environment (default: the warm pool's hook; the idle ones
    and the live worker alike), but `exclude`."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
            if PRELOAD_ENV.encode() not in env or tag.encode() not in env:
                continue
            with open(f"/proc/{pid}/maps") as f:
                out[int(pid)] = "jaxlib" in f.read()
        except OSError:  # gone, or not ours
            continue
    return {p: v for p, v in out.items() if p not in exclude}


_IDLE = """
import time
print("up", flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not os.path.exists("/proc"), reason="reads /proc")
def test_end_idle_ends_only_this_jobs_idle_warm_processes_of_another_environment():
    """Real processes titled as Ray titles them: only the idle one of this
    job, with the pool's variable and another environment, is ended."""
    import subprocess

    from ray_elastic.failures.process_state import end_idle
    from ray_elastic.worker.warm_pool import usable_by

    run_env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", PRELOAD_ENV: "jax,examples.lm"}
    base = {k: v for k, v in os.environ.items() if k not in (PRELOAD_ENV, STAMP_ENV, "RAY_JOB_ID", "XLA_FLAGS")}
    job = f"{os.getpid() % 0xFFFFFF:06x}ff"  # no job of a real Ray here
    other_env = {**run_env, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    cases = {  # name: (title, environment), and whether it is ended
        "stale": ("ray::IDLE", {**other_env, "RAY_JOB_ID": job}, True),
        "stamped": ("ray::IDLE", {**run_env, STAMP_ENV: "1-2", "RAY_JOB_ID": job}, True),
        "usable": ("ray::IDLE", {**run_env, "RAY_JOB_ID": job}, False),
        "other job": ("ray::IDLE", {**other_env, "RAY_JOB_ID": "0a000000"}, False),
        "not the pool's": ("ray::IDLE", {"XLA_FLAGS": "x", "RAY_JOB_ID": job}, False),
        "busy": ("ray::SliceWorker", {**other_env, "RAY_JOB_ID": job}, False),
    }
    procs = {}
    try:
        for name, (title, env, _) in cases.items():
            procs[name] = subprocess.Popen([title, "-c", _IDLE], executable=sys.executable, env={**base, **env},
                                           stdout=subprocess.PIPE, text=True)
        for p in procs.values():
            assert p.stdout.readline().strip() == "up"
        ended = end_idle(job, PRELOAD_ENV, usable_by(run_env))
        assert sorted(ended) == sorted(procs[n].pid for n, c in cases.items() if c[2])
        for name, (_, _, gone) in cases.items():
            if gone:
                assert procs[name].wait(timeout=10) == -signal.SIGKILL, name
            else:
                assert procs[name].poll() is None, name
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def _settled(pid: int) -> bool:
    """Whether the process has gone idle (its preload done): no CPU time
    used over half a second."""
    import psutil

    try:
        proc = psutil.Process(pid)
        a = sum(proc.cpu_times()[:2])
        time.sleep(0.5)
        return sum(proc.cpu_times()[:2]) == a
    except psutil.Error:
        return False


def _wait(cond, timeout_s=90.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError("timed out")


def _up(slices, timeout_s=180.0):
    p = slices.start(0)
    return _wait(lambda: slices.poll(p), timeout_s)


@pytest.mark.skipif(not os.path.exists("/proc"), reason="reads /proc")
def test_a_replacement_starts_in_the_warm_process_its_predecessor_asked_for(nodes, lm_factory):
    from ray_elastic.config import CpuSlice
    from ray_elastic.cluster.slice_group import RaySlices

    tag = f"RAY_ELASTIC_TEST_POOL=warm-{os.getpid()}-{time.time()}"

    class OwnPool(CpuSlice):
        # Its own runtime environment, so its own pool: the processes other
        # tests' workers left warm (the same job) are neither used nor counted.
        def worker_env(self):
            return {**super().worker_env(), tag.split("=")[0]: tag.split("=")[1]}

    nodes(1)
    slices = RaySlices(OwnPool(), lm_factory, seed=0, num_shards=1, run_name=f"test-warm-{os.getpid()}",
                       compile_cache_dir=work_path("xla-cache"),
                       warm_workers=1)
    try:
        live = _up(slices)
        worker_pid = live.infos[0]["pid"]
        # Its node's watcher, as a run makes for every node its slices go
        # live on (ray_backend.py): through it a later run ends what it cannot use.
        import ray

        from ray_elastic.failures import process_state

        ray.get(process_state.watcher_for(live.infos[0]["node_id"]).state.remote(0), timeout=60)
        # The worker's set-up asked its raylet for one idle process, which
        # imports JAX at its start (its native library mapped), then idles.
        warm = _wait(lambda: [p for p, jax in _warm_processes({worker_pid}, tag).items() if jax])
        _wait(lambda: _settled(warm[0]))
        assert len(warm) == 1
        os.kill(worker_pid, signal.SIGKILL)
        _wait(lambda: not os.path.exists(f"/proc/{worker_pid}"), 30)
        replacement = _up(slices)
        # The replacement is that process, started before its creation:
        # its readiness names the warm process's taking, and every phase
        # is a duration (no negative start from the process's age).
        assert replacement.infos[0]["pid"] == warm[0]
        assert "warm_process" in replacement.phases, replacement.phases
        assert not {"process_start", "actor_load", "args_load"} & set(replacement.phases), replacement.phases
        assert all(v >= 0 for v in replacement.phases.values()), replacement.phases
        # The first worker started cold, in a process of its own.
        assert "process_start" in live.phases and "warm_process" not in live.phases, live.phases
        assert all(v >= 0 for v in live.phases.values()), live.phases
        # ... and it asked for the next one: one idle process again, not two.
        nxt = _wait(lambda: [p for p, jax in _warm_processes({worker_pid, warm[0]}, tag).items() if jax])
        time.sleep(1.0)
        assert len(nxt) == 1 and set(_warm_processes({worker_pid}, tag)) == {warm[0], nxt[0]}
        slices.kill(replacement.workers)
    finally:
        slices.shutdown()
    # A later run of this driver in another environment cannot start in
    # that idle process: it is ended as that run starts, not left idling.
    other = f"RAY_ELASTIC_TEST_POOL=other-{os.getpid()}-{time.time()}"

    class OtherPool(CpuSlice):
        def worker_env(self):
            return {**super().worker_env(), other.split("=")[0]: other.split("=")[1]}

    later = RaySlices(OtherPool(), lm_factory, seed=0, num_shards=1, run_name=f"test-warm-other-{os.getpid()}",
                      compile_cache_dir=work_path("xla-cache"), warm_workers=1)
    try:
        p = later.start(0)
        _wait(lambda: not os.path.exists(f"/proc/{nxt[0]}"), 30)
        _wait(lambda: later.poll(p), 180)
    finally:
        later.shutdown()
