"""Fuzz the model-config checks with mutated config.json files of every supported architecture
(issue 59, items 5 and 8).

    python bench/fuzz_config.py --minutes 2 --seed 0       # the run the issue asks for
    python bench/fuzz_config.py --replay 0:17               # one case again, in-process, traceback

A tiny random checkpoint of each architecture (`tests/tiny_models.build_tiny_model`) is written
once; case ``i`` of seed ``s`` (always the same mutation) copies one of them with its config.json
mutated by a seeded RNG: hyper-parameters (top level and inside ``rope_parameters``) set to ints
(0, -1, 2**31, 2**63, off-by-one...), floats (NaN, inf, negative, 1e300...), wrong types (strings,
bools, null, lists, objects), nested lists up to 100k deep, keys deleted, or the whole file
replaced (invalid or truncated JSON, a non-object, bad UTF-8, a 5000-digit number, 100k-deep
nesting). Each case is loaded through the entry point, ``Engine.from_pretrained(folder)``, then
prefilled with four tokens, in a worker process with a per-case watchdog (a hung worker is killed
and replaced). The report: cases, outcomes by type, every case that raised something other than
an `EngineError` subclass, every load that gave non-finite logits, every case over 2 s and every
hang or crash. Exit status 1 when any of those but the slow list (a loaded machine inflates
times) is non-empty.

`run_case` / `build_corpus` are the in-process flavour tests/test_config_hostile.py runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import selectors
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SLOW_S = 2.0
IDS = [1, 2, 3, 4]

INTS = (0, 1, -1, 2, 3, 5, 7, 9, 16, 63, 65, 2**31 - 1, 2**31, 2**32, 2**63, -(2**31), 10**30)
FLOATS = (math.nan, math.inf, -math.inf, 0.0, -0.0, -1.0, 1e-300, 1e300, 0.5, 1.0, 3.0, 1e-7)
WRONG = ("eight", "", "3", True, False, None, [], [1, 2], {}, {"a": 1}, [[[]]])
DEPTHS = (50, 1000, 100_000)
_DEEP = "__FUZZ_DEEP__"
# hyper-parameters the adapters read, tried even where the tiny config leaves them to defaults
EXTRA_KEYS = (
    "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "num_experts_per_tok", "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling",
    "max_position_embeddings", "tie_word_embeddings", "sliding_window", "layer_types",
)  # fmt: skip
ROPE_KEYS = (
    "rope_type",
    "rope_theta",
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
)


@dataclass
class Outcome:
    case: str  # "seed:i"
    arch: str
    mutation: str
    result: str  # "ok", "nonfinite", an exception type name, "hang", "crash"
    engine_error: bool  # an EngineError subclass (or "ok")
    message: str
    seconds: float


def _archs() -> tuple[str, ...]:
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_models import ARCHS

    return ARCHS


def build_corpus(folder: Path) -> dict[str, Path]:
    """A tiny checkpoint (no tokenizer) per architecture under `folder`: arch -> folder."""
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_models import build_tiny_model

    out = {}
    for arch in _archs():
        path = folder / arch
        if not (path / "config.json").is_file():
            build_tiny_model(arch, path, with_tokenizer=False)
        out[arch] = path
    return out


def _value(old: Any, rng: random.Random) -> Any:
    pick = rng.random()
    if pick < 0.3:
        return rng.choice(INTS)
    if pick < 0.5:
        return rng.choice(FLOATS)
    if pick < 0.7:
        return rng.choice(WRONG)
    if pick < 0.8:
        return _DEEP + str(rng.choice(DEPTHS))
    if isinstance(old, int) and not isinstance(old, bool):  # near the valid value: relations
        return rng.choice((old - 1, old + 1, old * 2, old // 2, 0))
    if isinstance(old, float):
        return rng.choice((-old, old * 1e30, old / 1e30, 0.0))
    return rng.choice(INTS + FLOATS)


def _whole_file(text: str, rng: random.Random) -> tuple[bytes, str]:
    kind = rng.choice(("deep", "truncated", "list", "number", "utf8", "digits", "empty"))
    if kind == "deep":
        depth = rng.choice(DEPTHS)
        return ('{"model_type": ' + "[" * depth + "]" * depth + "}").encode(), "file: nested"
    data = {
        "truncated": text[: rng.randrange(len(text))],
        "list": "[" + text + "]",
        "number": "12345",
        "digits": text[:-2] + ', "x": ' + "9" * 5000 + "}",
        "empty": "",
    }.get(kind)
    if kind == "utf8":
        raw = bytearray(text.encode())
        raw[rng.randrange(len(raw))] = 0xFF
        return bytes(raw), "file: bad utf-8"
    return str(data).encode(), f"file: {kind}"


def mutate(config: dict[str, Any], rng: random.Random) -> tuple[bytes, str]:
    """The bytes of a mutated config.json and a label saying what changed."""
    text = json.dumps(config)
    if rng.random() < 0.08:
        return _whole_file(text, rng)
    cfg = json.loads(text)
    labels = []
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        rope = cfg.get("rope_parameters")
        if isinstance(rope, dict) and rng.random() < 0.2:
            key = rng.choice(ROPE_KEYS)
            rope[key] = _value(rope.get(key), rng)
            labels.append(f"rope_parameters.{key}={_label(rope[key])}")
            continue
        key = rng.choice(sorted(set(cfg) - {"model_type"}) + list(EXTRA_KEYS))
        if key in cfg and rng.random() < 0.1:
            del cfg[key]
            labels.append(f"del {key}")
        else:
            cfg[key] = _value(cfg.get(key), rng)
            labels.append(f"{key}={_label(cfg[key])}")
    out = json.dumps(cfg)
    for depth in DEPTHS:  # deep nesting spliced in as text: json.dumps would recurse itself
        out = out.replace(f'"{_DEEP}{depth}"', "[" * depth + "]" * depth)
    return out.encode(), "; ".join(labels)


def _label(value: Any) -> str:
    if isinstance(value, str) and value.startswith(_DEEP):
        return f"<{value[len(_DEEP) :]} deep>"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def case_folder(corpus: dict[str, Path], seed: int, i: int, work: Path) -> tuple[Path, str, str]:
    """(folder, arch, mutation) of case `i` of `seed`: the weights linked, config.json mutated."""
    archs = sorted(corpus)
    rng = random.Random(f"config:{seed}:{i}")
    arch = archs[i % len(archs)]
    src = corpus[arch]
    folder = work / f"case-{seed}-{i}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "config.json":
            (folder / f.name).symlink_to(f.resolve())
    data, label = mutate(json.loads((src / "config.json").read_text()), rng)
    (folder / "config.json").write_bytes(data)
    return folder, arch, label


def run_case(corpus: dict[str, Path], seed: int, i: int, work: Path) -> Outcome:
    """Load case `i` of `seed` in this process and classify what happened."""
    from freetoken_agents.engine import Engine
    from freetoken_agents.engine.errors import EngineError

    folder, arch, label = case_folder(corpus, seed, i, work)
    t0 = time.perf_counter()
    result, engine_error, message = "ok", True, ""
    try:
        engine = Engine.from_pretrained(folder)
        try:
            with engine.new_session() as s:
                logits = s.prefill(IDS)
            if not bool(logits.isfinite().all()):
                result, engine_error, message = "nonfinite", False, "non-finite logits"
        finally:
            engine.close()
    except Exception as e:  # noqa: BLE001 - classifying every failure is the point
        result, engine_error = type(e).__name__, isinstance(e, EngineError)
        message = " ".join(str(e).split())[:200] if engine_error else _where(e)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return Outcome(f"{seed}:{i}", arch, label, result, engine_error, message, time.perf_counter() - t0)


def _where(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    last = frames[-1] if frames else None
    at = f" at {Path(last.filename).name}:{last.lineno}" if last else ""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:160]}{at}"


# ---- worker pool with a watchdog -------------------------------------------------------------
def _worker(corpus_dir: Path, work: Path) -> None:
    import torch

    torch.set_num_threads(1)
    logging.disable(logging.WARNING)
    corpus = {p.name: p for p in corpus_dir.iterdir() if (p / "config.json").is_file()}
    from freetoken_agents.engine import Engine

    for folder in corpus.values():  # first loads import lazily: not the cases' time
        Engine.from_pretrained(folder).close()
    for line in sys.stdin:
        seed, i = (int(x) for x in line.split(":"))
        print(json.dumps(asdict(run_case(corpus, seed, i, work))), flush=True)


class _Worker:
    def __init__(self, corpus_dir: Path, work: Path) -> None:
        cmd = [sys.executable, __file__, "--worker", "--corpus", str(corpus_dir), "--work", str(work)]
        env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore"}
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
        )
        self.warmup_s = 120.0  # the first answer waits for the imports and a warm-up load per arch

    def run(self, case: str, hang_s: float) -> dict[str, Any] | None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(case + "\n")
        self.proc.stdin.flush()
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        ready = sel.select(timeout=hang_s + self.warmup_s)
        self.warmup_s = 0.0
        sel.close()
        line = self.proc.stdout.readline() if ready else ""
        return json.loads(line) if line else None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def fuzz(minutes: float, seed: int, hang_s: float, work: Path) -> list[Outcome]:
    corpus_dir = work / "corpus"
    build_corpus(corpus_dir)
    deadline = time.monotonic() + minutes * 60
    outcomes: list[Outcome] = []
    worker = _Worker(corpus_dir, work)
    i = 0
    while time.monotonic() < deadline:
        case, t0 = f"{seed}:{i}", time.perf_counter()
        got = worker.run(case, hang_s)
        if got is None:  # hung past the watchdog, or died (a signal, the OOM killer)
            alive = worker.proc.poll() is None
            worker.kill()
            _, arch, label = case_folder(build_corpus(corpus_dir), seed, i, work / "replay")
            result = "hang" if alive else f"crash (exit {worker.proc.returncode})"
            outcomes.append(Outcome(case, arch, label, result, False, "", time.perf_counter() - t0))
            worker = _Worker(corpus_dir, work)
        else:
            outcomes.append(Outcome(**got))
        i += 1
    worker.kill()
    return outcomes


def report(outcomes: list[Outcome]) -> bool:
    """Print the figures; True when nothing but engine errors and clean loads happened."""
    print(f"cases: {len(outcomes)}")
    print(
        "by architecture: "
        + ", ".join(f"{a} {n}" for a, n in sorted(Counter(o.arch for o in outcomes).items()))
    )
    print("outcomes:")
    for result, n in Counter(o.result for o in outcomes).most_common():
        print(f"  {result:28s} {n}")
    bad = [o for o in outcomes if not o.engine_error]
    slow = [o for o in outcomes if o.seconds > SLOW_S]
    print(f"not an EngineError (incl. non-finite logits, hangs, crashes): {len(bad)}")
    for o in bad:
        print(f"  {o.case} {o.arch} [{o.mutation}] {o.result}: {o.message}")
    print(f"over {SLOW_S:g} s: {len(slow)}")
    for o in sorted(slow, key=lambda o: -o.seconds)[:20]:
        print(f"  {o.case} {o.arch} [{o.mutation}] {o.result} {o.seconds:.2f} s")
    return not bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hang-s", type=float, default=30.0, help="wall-clock watchdog per case")
    ap.add_argument("--replay", metavar="SEED:I", help="run one case in-process and show its traceback")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO / "tests"))
    if args.worker:
        _worker(args.corpus, args.work)
        return 0
    with tempfile.TemporaryDirectory(prefix="fuzz-config-") as tmp:
        work = Path(tmp)
        os.environ["FREETOKEN_CACHE"] = str(work / "cache")  # never the user's cache
        if args.replay:
            seed, i = (int(x) for x in args.replay.split(":"))
            folder, arch, label = case_folder(build_corpus(work / "corpus"), seed, i, work)
            print(f"{args.replay} {arch} [{label}]")
            from freetoken_agents.engine import Engine

            with Engine.from_pretrained(folder).new_session() as s:
                print(s.prefill(IDS)[-1, :8])
            return 0
        t0 = time.perf_counter()
        outcomes = fuzz(args.minutes, args.seed, args.hang_s, work)
        print(f"seed {args.seed}, {time.perf_counter() - t0:.0f} s")
        return 0 if report(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
