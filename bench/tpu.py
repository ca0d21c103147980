"""python -m bench tpu: a slice's step on the accelerator JAX finds (a TPU
where there is one), against plain JAX, in one process per variant.

No Ray cluster runs here: the machine it is made for (a TPU v5e lent to
sessions) opens no socket. The SliceWorkers are driven in the variant's
process as the controller drives its actors (bench/tpu_variant.py says
how, and lists the variants). The variants run one after another, round
by round (`--runs`), so that plain and ray_elastic alternate; compiled
programs are kept in a compile cache shared by the rounds.

    python -m bench tpu [--size 341m|152m|tiny] [--variants a,b] [--steps N] [--runs R] [--out DIR]

Figures per variant (the first SKIP steps, the compile, left out): median
and mean step, ratio to the faster plain row's median, device peak (JAX's
`peak_bytes_in_use`) and its ratio to plain's, host peak (VmHWM), bytes
that left the device per step and the seconds their copies took, and the
largest relative difference of the losses from plain's. Then the two-slice
step's split (compute, copies out and in, sums, updates) against its
target (plain's step plus 1.1 times the raw copies), the steps with a
snapshot in flight against those without, and the checkpoint's save and
restore. `--size tiny` runs on CPU in a minute (the suite's smoke test).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP = 3
VARIANTS = ("plain", "plain_micro", "one_slice", "one_slice_micro", "one_slice_apart", "diloco", "two_slices",
            "snapshot", "checkpoint")


def sizes() -> dict:
    """LMConfig fields per size (a shard of 16 rows of 512 tokens)."""
    return {
        "341m": dict(seq_len=512, d_model=1536, num_layers=12, num_heads=12, mlp_dim=6144, shard_batch_size=16),
        "152m": dict(seq_len=512, d_model=1024, num_layers=12, num_heads=8, mlp_dim=4096, shard_batch_size=16),
        "tiny": dict(seq_len=64, d_model=128, num_layers=2, num_heads=4, mlp_dim=512, shard_batch_size=8),
    }


def run(size: str, variants=VARIANTS, steps: int = 20, rounds: int = 1, timeout_s: float = 900) -> dict:
    """{variant: [one result per round]} for `size`, the variants
    alternated. The compile cache is kept in the temporary folder between
    invocations (a warm machine's second call compiles nothing)."""
    config = json.dumps(sizes()[size])
    work = tempfile.mkdtemp(prefix="bench-tpu-")
    cache = os.path.join(tempfile.gettempdir(), f"bench-tpu-cache-{size}")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    if size == "tiny":
        env.setdefault("JAX_PLATFORMS", "cpu")
    results: dict = {v: [] for v in variants}
    for r in range(rounds):
        for v in variants:
            out = os.path.join(work, f"{v}-{r}.json")
            cmd = [sys.executable, "-m", "bench.tpu_variant", "--variant", v, "--config", config,
                   "--steps", str(steps), "--cache", cache, "--out", out]
            try:
                done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
                if done.returncode == 0:
                    with open(out) as f:
                        results[v].append(json.load(f))
                else:
                    results[v].append({"error": done.stderr[-2000:]})
            except subprocess.TimeoutExpired:
                results[v].append({"error": f"timed out after {timeout_s:.0f} s"})
            print(f"round {r} {v}: {_one_line(results[v][-1])}", flush=True)
    return {"size": size, "steps": steps, "rounds": rounds, "variants": results}


def merge(results: list) -> dict:
    """Several invocations' results (of one size) as one: each variant's
    runs from all of them (a run of the variants split over calls)."""
    out = {"size": results[0]["size"], "steps": results[0]["steps"], "rounds": 0, "variants": {}}
    for r in results:
        if r["size"] != out["size"]:
            raise ValueError(f"results of sizes {out['size']} and {r['size']} do not merge")
        for v, runs in r["variants"].items():
            out["variants"].setdefault(v, []).extend(runs)
    out["rounds"] = max(len(runs) for runs in out["variants"].values())
    return out


def _one_line(r: dict) -> str:
    if "error" in r:
        return ("error: " + r["error"].strip().splitlines()[-1]) if r["error"].strip() else "error"
    t = r["step_times"][SKIP:]
    return f"median {statistics.median(t) * 1e3:.1f} ms, device peak {(r.get('device_peak_bytes') or 0) / 1e9:.2f} GB"


def _steps(runs: list) -> list:
    return [t for r in runs if "error" not in r for t in r["step_times"][SKIP:]]


def _median(runs: list, key: str):
    vals = [r[key] for r in runs if "error" not in r and r.get(key) is not None]
    return statistics.median(vals) if vals else None


def table(result: dict) -> str:
    v = result["variants"]
    plains = [statistics.median(_steps(v[p])) for p in ("plain", "plain_micro") if p in v and _steps(v[p])]
    base = min(plains) if plains else None
    plain_peak = _median(v.get("plain", []), "device_peak_bytes")
    plain_losses = next((r["losses"] for r in v.get("plain", []) if "error" not in r), None)
    lines = [f"size {result['size']}, {result['steps']} steps a run (the first {SKIP} left out), "
             f"{result['rounds']} round(s), device {_device(v)}", "",
             "| variant | median step | mean step | vs plain | device peak | vs plain | host peak "
             "| bytes off device / step | copies / step | loss vs plain (max rel) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, runs in v.items():
        t = _steps(runs)
        if not t:
            err = next((r["error"] for r in runs if "error" in r), "")
            lines.append(f"| {name} | error: {err.strip().splitlines()[-1] if err.strip() else '?'} |" + " |" * 8)
            continue
        med, mean = statistics.median(t), statistics.mean(t)
        peak = _median(runs, "device_peak_bytes")
        first = next(r for r in runs if "error" not in r)
        losses = first["losses"][:first.get("round")]  # DiLoCo's: until its first outer step
        rel = (max(abs(a - b) / abs(b) for a, b in zip(losses, plain_losses)) if plain_losses else None)
        lines.append("| " + " | ".join([
            name, f"{med * 1e3:.1f} ms", f"{mean * 1e3:.1f} ms", _ratio(med, base), _gb(peak),
            _ratio(peak, plain_peak), _gb(_median(runs, "host_peak_bytes")),
            f"{(_median(runs, 'bytes_off_device') or 0) / 1e6:.1f} MB", f"{(_median(runs, 'copy_s') or 0) * 1e3:.0f} ms",
            "-" if rel is None else f"{rel:.1e}"]) + " |")
    scratch = {p: _median(v[p], "scratch_bytes") for p in ("plain", "plain_micro") if p in v}
    if any(b is not None for b in scratch.values()):
        lines += ["", "device peak: the buffers JAX counts (peak_bytes_in_use), which leave out a running program's "
                  "scratch; plain's step program reserves " + ", ".join(
                      f"{_gb(b)} ({p})" for p, b in scratch.items() if b is not None)
                  + " beside them (XLA's memory analysis)"]
    lines += _two_slices(v.get("two_slices", []), base) + _diloco(v.get("diloco", []), plain_peak) + \
        _snapshot(v.get("snapshot", [])) + \
        _checkpoint(v.get("checkpoint", [])) + _equal(v)
    return "\n".join(lines)


def _two_slices(runs: list, base) -> list:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return []
    parts = {k: statistics.median([s[k] for r in ok for s in r["split"][SKIP:]]) for k in ok[0]["split"][0]}
    compute = statistics.median([c for r in ok for c in r["grads_s"][SKIP:]])
    copies = statistics.median([r["copy_s"] for r in ok])
    med = statistics.median(_steps(ok))
    target = None if base is None else base + 1.1 * copies
    return ["", "two slices sharing the device, per step (medians): "
            f"compute {compute * 1e3:.0f} ms, copies out {parts['copy_out'] * 1e3:.0f} ms, in {parts['copy_in'] * 1e3:.0f} ms, "
            f"sums {parts['sums'] * 1e3:.0f} ms, updates {parts['update'] * 1e3:.0f} ms; raw copies of both "
            f"gradients out and in {copies * 1e3:.0f} ms; step {med * 1e3:.0f} ms against the target "
            + ("-" if target is None else f"{target * 1e3:.0f} ms (plain + 1.1 x copies): "
               + ("met" if med <= target else "not met"))]


def _diloco(runs: list, plain_peak) -> list:
    ok = [r for r in runs if "error" not in r and r.get("outer_s")]
    if not ok:
        return []
    inner = _median(ok, "inner_peak_bytes")
    return ["", f"DiLoCo: device peak over the first round's {ok[0]['round']} inner steps {_gb(inner)} "
            f"({_ratio(inner, plain_peak)} plain's), over the run with its outer steps "
            f"{_gb(_median(ok, 'device_peak_bytes'))}; an outer step (one replica: delta out, mean in, "
            f"update) {statistics.median([s for r in ok for s in r['outer_s']]):.2f} s median"]


def _snapshot(runs: list) -> list:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return []
    busy = [t for r in ok for t, b in list(zip(r["step_times"], r["snapshot_in_flight"]))[SKIP:] if b]
    free = [t for r in ok for t, b in list(zip(r["step_times"], r["snapshot_in_flight"]))[SKIP:] if not b]
    if not busy or not free:
        return ["", "snapshot: no step ran with one in flight"]
    mb, mf = statistics.median(busy), statistics.median(free)
    secs = [s for r in ok for s in r["snapshot_s"]]
    return ["", f"snapshot ({_gb(_median(ok, 'snapshot_bytes'))}, copied out in {statistics.median(secs):.2f} s): "
            f"steps with one in flight {mb * 1e3:.1f} ms median ({len(busy)} steps), without {mf * 1e3:.1f} ms "
            f"({len(free)}): {100 * (mb / mf - 1):+.1f}%"]


def _checkpoint(runs: list) -> list:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return []
    return ["", f"checkpoint (Orbax, local disk, {_gb(_median(ok, 'checkpoint_bytes'))}): save "
            f"{_median(ok, 'save_s'):.2f} s, restore into a new worker {_median(ok, 'restore_s'):.2f} s, "
            f"restored bitwise: {all(r.get('restored_equal') for r in ok)}"]


def _equal(v: dict) -> list:
    """Each one-slice variant's losses against two slices', bit for bit
    (the update-apart program is the one meant to be bitwise any slice
    count's; the one program is plain JAX's math to rounding)."""
    two = next((r["losses"] for r in v.get("two_slices", []) if "error" not in r), None)
    lines = []
    for name in ("one_slice_apart", "one_slice"):
        one = next((r["losses"] for r in v.get(name, []) if "error" not in r), None)
        if one is not None and two is not None:
            same = sum(a == b for a, b in zip(one, two))
            lines.append(f"{name} against two_slices, losses bitwise equal: {one == two} ({same} of {len(two)} steps)")
    return [""] + lines if lines else []


def _device(v: dict) -> str:
    return next((r["device"] for runs in v.values() for r in runs if "device" in r), "?")


def _ratio(a, b) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def _gb(b) -> str:
    return "-" if b is None else f"{b / 1e9:.2f} GB"
