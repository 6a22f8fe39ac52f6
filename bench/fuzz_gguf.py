"""Fuzz the GGUF reader and the model-config checks with mutated tiny GGUF files (issue 59).

    python bench/fuzz_gguf.py --minutes 10 --seed 0            # the Done-when run
    python bench/fuzz_gguf.py --replay 0:123                    # one case again, in-process, traceback

Valid tiny GGUFs (`tests/gguf_models.write_gguf`: qwen3moe Q8_0, llama/Mixtral Q4_0, gpt-oss MXFP4,
deepseek2 Q8_0) are mutated with a seeded RNG (case ``i`` of seed ``s`` always yields the same file):
header counts, metadata array counts and item types, string lengths, value types, tensor
directory fields (dims, types, offsets), tensor data, truncations, bit flips, swapped fields and
metadata values (the hyper-parameters the config checks guard). Each case is loaded through the
entry point, ``Engine.from_pretrained(file, cache_dir=<fresh>)``, in a pool of worker processes
with a per-case watchdog (wall-clock limit, resident-memory limit; a killed or crashed worker is
replaced). The report lists: cases per mutation, outcomes, errors by type, every case that raised
something other than the engine's named errors (`EngineError` subclasses) with where it was
raised, every case over 2 s of CPU or wall time, every crash (a signal such as SIGBUS) or kill,
and every partial file the cache kept (a ``.tmp``, or an entry after a failed load). Exit status 1
when any of those (but the wall-time list, which a loaded machine inflates) is non-empty.

The mutations, and `read_cases`, the in-process reader-only flavour the test suite runs, are in
`bench/_gguf_mutations.py`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import resource
import selectors
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SLOW_S = 2.0
CORPUS = (("qwen3_moe", "Q8_0"), ("mixtral", "Q4_0"), ("gpt_oss", "MXFP4"), ("deepseek_v3", "Q8_0"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gguf_mutations import KINDS, Outcome, classify, mutate  # noqa: E402  (bench/, beside this file)


def case_file(
    corpus: list[bytes], seed: int, i: int, kinds: tuple[str, ...] = KINDS
) -> tuple[bytes, str, str]:
    """(bytes, kind, description) of case `i` of `seed` (deterministic)."""
    rng = random.Random(f"{seed}:{i}")
    base = rng.randrange(len(corpus))
    kind = rng.choice(kinds)
    data, detail = mutate(corpus[base], kind, rng)
    return data, kind, f"{CORPUS[base][0] if len(corpus) == len(CORPUS) else base}: {detail}"


# ---- the worker: one case at a time, through the engine's entry point -----------------------------


def _load(path: Path, cache: Path) -> None:
    from freetoken_agents.engine import Engine

    Engine.from_pretrained(path, cache_dir=cache)


def _worker(warmup: Path) -> None:
    results = os.fdopen(os.dup(1), "w")  # the parent reads JSON lines here; stray prints go to stderr
    os.dup2(2, 1)
    import torch

    torch.set_num_threads(1)
    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="fuzz-warmup-") as tmp:
        _load(warmup, Path(tmp))  # every lazy import done before the first timed case
    results.write("ready\n")
    results.flush()
    for line in sys.stdin:
        job = json.loads(line)
        o = Outcome(job["case"], job["kind"], job["detail"], "ok")
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            _load(Path(job["path"]), Path(job["cache"]))
        except Exception as e:
            o.status, o.error, o.message, o.where = classify(e)
        o.wall_s, o.cpu_s = time.perf_counter() - t0, time.process_time() - c0
        results.write(json.dumps(asdict(o)) + "\n")
        results.flush()


class _Pool:
    """Worker processes fed one case each; a case over `hang_s` or `mem_gb` kills its worker."""

    def __init__(self, n: int, hang_s: float, mem_gb: float, warmup: Path) -> None:
        self.n, self.hang_s, self.mem, self.warmup = n, hang_s, mem_gb * 2**30, warmup
        self.sel = selectors.DefaultSelector()
        self.idle: list[subprocess.Popen] = [self._spawn() for _ in range(n)]
        self.busy: dict[int, tuple[subprocess.Popen, dict, float]] = {}

    def _spawn(self) -> subprocess.Popen:
        env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONPATH": str(REPO / "tests")}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(self.warmup)]
        pipe, quiet = subprocess.PIPE, subprocess.DEVNULL  # a case's details: --replay
        p = subprocess.Popen(cmd, stdin=pipe, stdout=pipe, stderr=quiet, text=True, env=env, cwd=REPO)
        if p.stdout.readline().strip() != "ready":  # imports and a warm-up load, untimed
            raise RuntimeError(f"a fuzz worker failed to start (exit status {p.wait()})")
        return p

    def submit(self, job: dict) -> None:
        p = self.idle.pop()
        p.stdin.write(json.dumps(job) + "\n")
        p.stdin.flush()
        self.busy[p.pid] = (p, job, time.perf_counter())
        self.sel.register(p.stdout, selectors.EVENT_READ, p.pid)

    def _finish(self, pid: int, outcome: Outcome, *, replace: bool) -> Outcome:
        p, _, _ = self.busy.pop(pid)
        self.sel.unregister(p.stdout)
        if replace:
            if p.poll() is None:
                p.kill()  # our own worker, by its handle
            p.wait()
            self.idle.append(self._spawn())
        else:
            self.idle.append(p)
        return outcome

    def wait(self) -> list[Outcome]:
        """Outcomes of the cases that ended within about 0.1 s."""
        done = []
        for key, _ in self.sel.select(timeout=0.1):
            pid = key.data
            p, job, _ = self.busy[pid]
            line = p.stdout.readline()
            if line:
                done.append(self._finish(pid, Outcome(**json.loads(line)), replace=False))
            else:
                rc = p.wait()
                o = Outcome(job["case"], job["kind"], job["detail"], "crash", f"exit status {rc}")
                done.append(self._finish(pid, o, replace=True))
        now = time.perf_counter()
        for pid, (_, job, t0) in list(self.busy.items()):
            rss = _rss(pid)
            if now - t0 > self.hang_s or rss > self.mem:
                status = "hang" if now - t0 > self.hang_s else "memory"
                o = Outcome(job["case"], job["kind"], job["detail"], status, wall_s=now - t0)
                o.message = f"killed after {now - t0:.1f} s at {rss / 2**20:.0f} MiB resident"
                done.append(self._finish(pid, o, replace=True))
        return done

    def close(self) -> None:
        for p in self.idle + [b[0] for b in self.busy.values()]:
            p.stdin.close()
            if p.poll() is None:
                p.kill()
            p.wait()


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _partial(case_dir: Path, outcome: Outcome) -> str:
    """The partial files the load left: any .tmp, and any cache entry after a failed load."""
    cache = case_dir / "cache"
    left = [p.name for p in cache.rglob("*.tmp")] if cache.exists() else []
    if outcome.status != "ok" and cache.exists():
        left += [p.name for p in cache.rglob("*.ftw")]
    return ", ".join(sorted(left))


def build_corpus(folder: Path) -> list[bytes]:
    """The valid tiny GGUFs the mutations start from (CORPUS)."""
    sys.path.insert(0, str(REPO / "tests"))
    from gguf_models import write_gguf

    return [write_gguf(arch, folder / arch, expert_type=q).path.read_bytes() for arch, q in CORPUS]


def fuzz(minutes: float, seed: int, workers: int, hang_s: float, mem_gb: float) -> list[Outcome]:
    """Cases of `seed` (0, 1, 2, ...) through the worker pool until `minutes` have passed."""
    work = Path(tempfile.mkdtemp(prefix="fuzz-gguf-"))
    outcomes: list[Outcome] = []
    try:
        corpus = build_corpus(work / "corpus")
        (work / "warmup.gguf").write_bytes(corpus[0])
        pool = _Pool(workers, hang_s, mem_gb, work / "warmup.gguf")
        deadline, i, dirs = time.perf_counter() + minutes * 60, 0, {}
        try:
            while time.perf_counter() < deadline or pool.busy:
                while pool.idle and time.perf_counter() < deadline:
                    data, kind, detail = case_file(corpus, seed, i)
                    case_dir = work / f"case{i}"
                    case_dir.mkdir()
                    (case_dir / "model.gguf").write_bytes(data)
                    dirs[f"{seed}:{i}"] = case_dir
                    job = {"case": f"{seed}:{i}", "kind": kind, "detail": detail}
                    pool.submit(
                        {**job, "path": str(case_dir / "model.gguf"), "cache": str(case_dir / "cache")}
                    )
                    i += 1
                for o in pool.wait():
                    case_dir = dirs.pop(o.case)
                    o.partial = _partial(case_dir, o)
                    shutil.rmtree(case_dir, ignore_errors=True)
                    outcomes.append(o)
        finally:
            pool.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return outcomes


def report(outcomes: list[Outcome]) -> bool:
    """Print the figures; True when nothing was found (see the module doc)."""
    by_status = Counter(o.status for o in outcomes)
    print(f"cases: {len(outcomes)}  outcomes: {dict(sorted(by_status.items()))}")
    print(f"mutations: {dict(sorted(Counter(o.kind for o in outcomes).items()))}")
    print(f"named errors: {dict(Counter(o.error for o in outcomes if o.status == 'named').most_common())}")
    cpu = [o for o in outcomes if o.cpu_s > SLOW_S]
    wall = [o for o in outcomes if o.wall_s > SLOW_S and o.status not in ("hang", "memory")]
    sections = {
        "raised something else than an EngineError": [o for o in outcomes if o.status == "raw"],
        "hung (killed) or grew past the memory limit": [
            o for o in outcomes if o.status in ("hang", "memory")
        ],
        "crashed (a signal or an exit)": [o for o in outcomes if o.status == "crash"],
        f"over {SLOW_S:.0f} s of CPU": cpu,
        "left a partial file in the cache": [o for o in outcomes if o.partial],
    }
    for title, found in sections.items():
        print(f"{title}: {len(found)}")
        for o in found[:15]:
            what = o.partial or f"{o.error} {o.message}"[:160]
            print(f"  --replay {o.case}  [{o.kind}] {o.detail[:90]} | {what} {o.where} ({o.cpu_s:.2f} s cpu)")
    print(f"over {SLOW_S:.0f} s of wall time (informational, a loaded machine inflates it): {len(wall)}")
    for o in wall[:5]:
        print(f"  --replay {o.case}  {o.wall_s:.2f} s wall, {o.cpu_s:.2f} s cpu")
    return not any(sections.values())


def replay(case: str) -> None:
    """Case ``seed:i`` again, in this process, with the whole traceback."""
    seed, i = (int(x) for x in case.split(":"))
    with tempfile.TemporaryDirectory(prefix="fuzz-gguf-") as tmp:
        corpus = build_corpus(Path(tmp) / "corpus")
        data, kind, detail = case_file(corpus, seed, i)
        print(f"case {case}: [{kind}] {detail}")
        path = Path(tmp) / "model.gguf"
        path.write_bytes(data)
        t0 = time.process_time()
        try:
            _load(path, Path(tmp) / "cache")
            print("loaded")
        except Exception:
            traceback.print_exc()
        print(f"{time.process_time() - t0:.2f} s cpu")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=max(1, min(4, (os.cpu_count() or 2) - 1)))
    ap.add_argument("--hang-s", type=float, default=30.0, help="wall-clock watchdog per case")
    ap.add_argument("--mem-gb", type=float, default=4.0, help="resident-memory watchdog per worker")
    ap.add_argument("--replay", metavar="SEED:I", help="run one case in-process and show its traceback")
    ap.add_argument("--worker", metavar="WARMUP", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args.worker)
        return 0
    sys.path.insert(0, str(REPO / "tests"))
    if args.replay:
        replay(args.replay)
        return 0
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # crashed workers leave no core files
    t0 = time.perf_counter()
    outcomes = fuzz(args.minutes, args.seed, args.workers, args.hang_s, args.mem_gb)
    print(f"fuzz_gguf: seed {args.seed}, {args.workers} workers, {time.perf_counter() - t0:.0f} s")
    return 0 if report(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
