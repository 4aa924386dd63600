"""Checkpoint throughput: save and restore GB/s of a whole train state, how long a save blocks the loop, and
what integrity checksums add to both.

    python benchmarks/checkpoint.py [CONFIG] [--config.a.b=v ...] [--repeats 3] [--zstd] [--dir DIR] [--output FILE]
                                    [--saves-only] [--hash-after-commit]

The state (fp32 parameters plus AdamW moments, step, counters) of CONFIG (default: configs/llama3_1b.py,
1.24B parameters) is filled with random values on one device and saved the way the training loop saves,
synchronously and asynchronously, each with and without checksums. "blocked" is how long saving kept the
training loop waiting; "total" is until the files are complete, synced to disk and (with checksums) their
manifest written. Restores are timed cold (the page cache dropped first, when this process may) and warm
(files still in the page cache), each with and without verifying the files first; hashing the files alone is
timed too. With checksums, "during the save" is the time the watcher thread spent reading files while they
were written, and "after the commit" the reading left for ``integrity.record``; ``--hash-after-commit``
turns the watcher off (every file read after the commit, for comparison) and ``--saves-only`` times the
saves alone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from jaxtron.checkpoint import integrity
from jaxtron.checkpoint.train_state import Checkpointer
from jaxtron.config.loader import load_config, split_overrides
from jaxtron.config.schema import ConfigError
from jaxtron.metrics.flops import param_count
from jaxtron.parallel.checks import check_devices
from jaxtron.parallel.mesh import make_mesh
from jaxtron.training import state as state_lib
from jaxtron.training.loop import save_checkpoint

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                              "llama3_1b.py")


def drop_page_cache() -> bool:
    """Flushes dirty pages and drops the page cache (needs root); False where not allowed."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def random_state(abstract_state, shardings):
    """A train state of the config's shapes filled with random values, one array at a time (a model's init
    needs twice the memory). Fresh AdamW moments are zeros, which compress to nothing and would flatter every
    number; after some training they are as incompressible as the parameters."""
    def fill(i, leaf, sharding):
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            return jax.jit(lambda: jnp.zeros(leaf.shape, leaf.dtype), out_shardings=sharding)()
        make = lambda key: jnp.abs(jax.random.normal(key, leaf.shape, leaf.dtype)) * 0.02
        return jax.jit(make, out_shardings=sharding)(jax.random.key(i))

    leaves, treedef = jax.tree.flatten(abstract_state)
    sharding_leaves = jax.tree.leaves(jax.tree.map(
        lambda sh, sub: jax.tree.map(lambda _: sh, sub), shardings, abstract_state,
        is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)))
    return jax.tree.unflatten(treedef, [jax.block_until_ready(fill(i, leaf, sh))
                                        for i, (leaf, sh) in enumerate(zip(leaves, sharding_leaves, strict=True))])


def reset_peak_memory() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5\n")  # resets the peak resident set size (Linux)
    except OSError:
        pass


def peak_memory_gb() -> float | None:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 / 1e9 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None


def directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def bench(cfg, directory: str, repeats: int, compress: bool, saves_only: bool = False) -> dict:
    devices = jax.devices()[:1]
    mesh = make_mesh(check_devices(cfg, 1), devices)
    with jax.set_mesh(mesh):
        setup = state_lib.setup(cfg, "xla")
        shardings = state_lib.state_shardings(mesh, setup.abstract_state, setup.distributed_optimizer)
        start = time.perf_counter()
        state = random_state(setup.abstract_state, shardings)
        init_s = time.perf_counter() - start
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))

    saves, restores, step = [], [], 0
    hashing = []  # seconds spent in integrity.record during each save (the checksums' own share of it)
    record = integrity.record

    def timed_record(*args, **kwargs):
        start = time.perf_counter()
        try:
            return record(*args, **kwargs)
        finally:
            hashing.append(time.perf_counter() - start)

    for mode, checksums in [(m, c) for m in ("sync", "async") for c in (False, True)] * repeats:
        step += 1
        ckpt = Checkpointer(directory, keep=1, async_save=mode == "async", compress=compress, checksums=checksums)
        drop_page_cache()  # the previous save's dirty pages are not this save's work
        reset_peak_memory()
        hashing.clear()
        integrity.record = timed_record
        start = time.perf_counter()
        save_checkpoint(ckpt, step, state, cfg)  # what the loop runs
        blocked = time.perf_counter() - start
        ckpt.wait()
        os.sync()  # on disk, not only in the page cache
        total = time.perf_counter() - start
        ckpt.close()
        integrity.record = record
        # the share of this save spent hashing: paired within one save, unlike two saves' totals, whose
        # difference on a shared machine is mostly noise
        hash_share = sum(hashing) / total
        saves.append({"mode": mode, "checksums": checksums, "blocked_s": blocked, "total_s": total,
                      "hash_s": sum(hashing), "hash_share": hash_share, "watch_hash_s": ckpt.last_watch_hash_s,
                      "gb_per_s": state_bytes / total / 1e9, "peak_host_gb": peak_memory_gb()})
        print(f"save {mode}, checksums {checksums}: blocked {blocked:.3f} s, total {total:.2f} s "
              f"(hashing after the commit {sum(hashing):.2f} s, {hash_share:.1%}; during the save "
              f"{ckpt.last_watch_hash_s:.2f} s), "
              f"{state_bytes / total / 1e9:.2f} GB/s, peak host memory {saves[-1]['peak_host_gb']} GB", flush=True)
    step_dir = os.path.join(directory, "checkpoints", str(step))
    files = directory_bytes(step_dir)
    hashes = []
    for cache in ("warm", "cold") * (0 if saves_only else repeats):
        dropped = drop_page_cache() if cache == "cold" else None
        start = time.perf_counter()
        integrity.record(step_dir)
        seconds = time.perf_counter() - start
        hashes.append({"cache": cache if dropped or cache == "warm" else "cold (page cache could not be dropped)",
                       "seconds": seconds, "gb_per_s": files / seconds / 1e9})
        print(f"hash alone, {hashes[-1]['cache']}: {seconds:.2f} s, {files / seconds / 1e9:.2f} GB/s", flush=True)
    del state
    for cache, verify in [(c, v) for c in ("cold", "warm") for v in (False, True)] * (0 if saves_only else repeats):
        dropped = drop_page_cache() if cache == "cold" else None
        ckpt = Checkpointer(directory, keep=1)
        reset_peak_memory()
        start = time.perf_counter()
        restored, _ = ckpt.restore(step, setup.abstract_state, shardings, cfg, verify=verify)
        jax.block_until_ready(restored)
        seconds = time.perf_counter() - start
        ckpt.close()
        del restored
        if cache == "cold" and not dropped:
            cache = "cold (page cache could not be dropped)"
        restores.append({"cache": cache, "verify": verify, "seconds": seconds, "gb_per_s": state_bytes / seconds / 1e9,
                         "peak_host_gb": peak_memory_gb()})
        print(f"restore {cache}, verify {verify}: {seconds:.2f} s, {state_bytes / seconds / 1e9:.2f} GB/s, "
              f"peak host memory {restores[-1]['peak_host_gb']} GB", flush=True)
    return {"params": param_count(cfg.model), "state_bytes": state_bytes, "checkpoint_file_bytes": files,
            "fill_s": init_s, "saves": saves, "hashes": hashes, "restores": restores}


def summarize(rows: list[dict], key: str) -> dict:
    return {"median": float(np.median([r[key] for r in rows])), "min": min(r[key] for r in rows),
            "max": max(r[key] for r in rows)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/checkpoint.py", description=__doc__.split("\n")[0])
    parser.add_argument("config", nargs="?", default=DEFAULT_CONFIG)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--zstd", action="store_true", help="compress as orbax does by default (the loop does not)")
    parser.add_argument("--saves-only", action="store_true",
                        help="time the saves alone (no restores, no hashing alone)")
    parser.add_argument("--hash-after-commit", action="store_true",
                        help="read nothing while saving: every file is hashed after the commit (for comparison)")
    parser.add_argument("--output", default=None)
    try:
        spec, overrides, rest = split_overrides(argv)
        args = parser.parse_args(rest)
        args.config = spec or args.config
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.hash_after_commit:
        integrity.Watcher._growing = lambda self: []
    directory = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir)
    try:
        result = bench(cfg, directory, args.repeats, args.zstd, args.saves_only)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    for mode in ("sync", "async"):
        for checksums in (False, True):
            rows = [s for s in result["saves"] if s["mode"] == mode and s["checksums"] == checksums]
            result[f"save_{mode}{'_checksums' if checksums else ''}"] = {
                k: summarize(rows, k) for k in ("blocked_s", "total_s", "hash_s", "hash_share", "watch_hash_s",
                                                "gb_per_s")}
        plain, summed = (result[f"save_{mode}{x}"]["total_s"]["median"] for x in ("", "_checksums"))
        result[f"save_{mode}_checksums_added"] = summed / plain - 1
        checked = result[f"save_{mode}_checksums"]
        share = checked["hash_s"]["median"] / (checked["total_s"]["median"] - checked["hash_s"]["median"])
        result[f"save_{mode}_hashing_added"] = share  # hashing time over the rest of the same saves
    for cache in ("cold", "warm"):
        rows = [r for r in result["hashes"] if r["cache"].startswith(cache)]
        if not rows:
            continue
        result[f"hash_alone_{cache}"] = {k: summarize(rows, k) for k in ("seconds", "gb_per_s")}
        for verify in (False, True):
            rows = [r for r in result["restores"] if r["cache"].startswith(cache) and r["verify"] == verify]
            result[f"restore_{cache}{'_verified' if verify else ''}"] = {
                k: summarize(rows, k) for k in ("seconds", "gb_per_s")}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__)), check=False).stdout.strip()
    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "commit": commit,
              "config": args.config, "zstd": args.zstd,
              "hash_after_commit": args.hash_after_commit, "overrides": [f"--config.{k}={v}" for k, v in overrides],
              "jax": jax.__version__, "cpus": os.cpu_count(), "python": platform.python_version(), **result}
    print(json.dumps({k: v for k, v in report.items() if k not in ("saves", "hashes", "restores")}, indent=1))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
