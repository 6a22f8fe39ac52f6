"""`freetoken simulate`: a routing trace replayed under every expert policy on a modelled machine
(issue 33), or `--profile-here` to measure this machine into a hardware profile TOML.

Every figure is SIMULATED (`engine.simulate.simulator.simulate`): predicted, never measured."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..engine.choices import QUANT_CODECS as CODEC_ALIASES
from ..engine.choices import SIMULATION_POLICIES as POLICIES
from ..engine.errors import MemoryBudgetError
from .argtypes import probability
from .common import CLIError, show_progress, write

if TYPE_CHECKING:
    from ..engine.simulate.simulator import SimulationReport

PLOT_HINT = "pip install 'freetoken-agents[plot]'"
# Built-in models with a calibrated synthetic routing preset (`engine.simulate.synthetic`), for
# --synthetic; names only here, so that `--help` imports no simulator module.
SYNTHETIC_MODELS = ("mixtral-8x7b", "qwen3-30b-a3b")
SYNTHETIC_TOKENS = 256  # decode tokens of a --synthetic trace: longer is steadier, shorter is faster
# The simulator's modules (and torch with them) are imported by the functions that use them, so
# building the parser and `--help` load neither (issue 65).


@dataclass(frozen=True)
class Budget:
    """A memory budget as given: a share of the expert bytes (`fraction`) or a size in bytes."""

    value: float
    fraction: bool

    def nbytes(self, total: int) -> int:
        return int(self.value * total) if self.fraction else int(self.value)


def budget(text: str) -> Budget:
    """argparse type: a size ("12GB", "512MiB") or a fraction of the expert bytes (0 < x <= 1)."""
    try:
        number = float(text)
    except ValueError:
        number = None
    if number is not None and number <= 1.0:
        if not number > 0:
            raise argparse.ArgumentTypeError(f"a fraction of the expert bytes must be in (0, 1], got {text}")
        return Budget(number, True)
    if number is not None and number != int(number):
        raise argparse.ArgumentTypeError(f"expected a fraction <= 1 or a size (e.g. 12GB), got {text!r}")
    from ..engine.memory.budget import parse_size

    try:
        size = parse_size(text.strip(), "size")
    except MemoryBudgetError:
        raise argparse.ArgumentTypeError(
            f"expected a size (12GB, 512MiB), a fraction of the expert bytes (0.5) or LO:HI:N, got {text!r}"
        ) from None
    if size <= 0:
        raise argparse.ArgumentTypeError(f"a size must be more than 0 bytes, got {text!r}")
    return Budget(size, False)


def budgets(text: str) -> list[Budget]:
    """argparse type for --fast-mem: one `budget`, or a sweep LO:HI:N of N fractions from LO to HI."""
    if ":" not in text:
        return [budget(text)]
    parts = text.split(":")
    try:
        lo, hi, n = float(parts[0]), float(parts[1]), int(parts[2])
        if len(parts) != 3:
            raise ValueError
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"a sweep is LO:HI:N (e.g. 0.1:0.9:9), got {text!r}") from None
    if not (0 < lo <= hi <= 1 and n >= 1) or (n == 1 and lo != hi):
        raise argparse.ArgumentTypeError(
            f"a sweep needs fractions 0 < LO <= HI <= 1 and N >= 1 (N = 1 only with LO = HI), got {text!r}"
        )
    return [Budget(lo + (hi - lo) * i / (n - 1) if n > 1 else lo, True) for i in range(n)]


def policies(text: str) -> tuple[str, ...]:
    """argparse type: a comma-separated list of `POLICIES`."""
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = [p for p in names if p not in POLICIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    return names


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="predict decode speed of every expert policy from a routing trace (simulated)",
        description="Replay a routing trace under every expert policy on a modelled machine and print "
        "the SIMULATED decode tok/s, misses and traffic per token, and the bound no policy can beat. "
        "Or measure this machine into a hardware profile with --profile-here.",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--trace", metavar="PATH", help="routing trace (JSON lines)")
    mode.add_argument(
        "--synthetic",
        choices=SYNTHETIC_MODELS,
        metavar="MODEL",
        help=f"replay a synthetic trace from MODEL's calibrated routing preset instead of a trace file "
        f"(one of: {', '.join(SYNTHETIC_MODELS)}; --model defaults to MODEL)",
    )
    mode.add_argument(
        "--profile-here", action="store_true", help="measure this machine and print its profile TOML"
    )
    p.add_argument(
        "--model",
        metavar="SHAPE",
        help="built-in model name, a config.json path, a checkpoint folder or an .ftw file "
        "(with --profile-here: measure for its shapes)",
    )
    p.add_argument(
        "--tokens",
        type=int,
        metavar="N",
        help=f"--synthetic: decode tokens of the trace (default: {SYNTHETIC_TOKENS})",
    )
    p.add_argument("--hardware", metavar="PROFILE", help="built-in hardware profile or a TOML file")
    p.add_argument(
        "--fast-mem",
        type=budgets,
        metavar="SIZE",
        help="tier-1 budget for experts: a size (12GB), a fraction of the expert bytes (0.5), "
        "or a sweep of fractions LO:HI:N (0.1:0.9:9)",
    )
    p.add_argument(
        "--host-mem", type=budget, metavar="SIZE", help="tier-2 budget, size or fraction (default: unbounded)"
    )
    codecs = ", ".join(CODEC_ALIASES)
    p.add_argument(
        "--codec", choices=CODEC_ALIASES, default="bf16", metavar="CODEC", help=f"{codecs} (default: bf16)"
    )
    p.add_argument(
        "--policies",
        type=policies,
        default=POLICIES,
        metavar="P,P",
        help=f"policies to run, of: {', '.join(POLICIES)} (default: all)",
    )
    p.add_argument(
        "--routing-profile",
        metavar="PATH",
        help="another trace of the model (an earlier session's) that places the static split and starts "
        "qstar-profiled, as the engine's --routing-profile (default: the trace's own first 25%%)",
    )
    p.add_argument("--recall", type=probability, default=0.8, help="q*'s predictor recall (default: 0.8)")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of q*'s predictor and of a --synthetic trace (default: 0)"
    )
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    p.add_argument("--plot", metavar="OUT.png", help="plot tok/s and misses against the fast budget")
    p.add_argument("--out", metavar="FILE.toml", help="--profile-here: write the profile here")
    p.add_argument("--quick", action="store_true", help="--profile-here: small sizes (seconds)")
    p.add_argument("--scratch-dir", metavar="DIR", help="--profile-here: where the disk test writes")
    p.set_defaults(run=run_simulate)


def run_simulate(args: argparse.Namespace) -> int:
    if args.profile_here:
        return _profile_here(args)
    if args.out or args.quick or args.scratch_dir:
        raise CLIError("--out, --quick and --scratch-dir go with --profile-here")
    if args.tokens is not None and not args.synthetic:
        raise CLIError("--tokens goes with --synthetic")
    if args.tokens is not None and args.tokens < 1:
        raise CLIError(f"--tokens must be at least 1, got {args.tokens}")
    if args.synthetic and not args.model:
        args.model = args.synthetic
    missing = [
        f"--{k.replace('_', '-')}" for k in ("trace", "model", "hardware", "fast_mem") if not getattr(args, k)
    ]
    if missing and args.synthetic:
        missing.remove("--trace")
    if missing:
        missing = [m if m != "--trace" else "--trace (or --synthetic MODEL)" for m in missing]
        raise CLIError(f"missing {', '.join(missing)} (or use --profile-here)")
    if args.plot:  # before minutes of replays, not after them
        _plot_backend()
        _check_writable(args.plot, "--plot")
    from ..engine.simulate.profiles import load_profile
    from ..engine.simulate.replay import SimulationError
    from ..engine.simulate.shapes import shape_for
    from ..engine.simulate.simulator import simulate
    from ..engine.simulate.source import TraceSource

    shape, profile = shape_for(args.model), load_profile(args.hardware)
    # Streamed: each pass re-reads the file a line at a time, never holding it (`source`); a
    # --synthetic trace is held (a few MB at the default length).
    trace = _synthetic(args.synthetic, args.tokens, args.seed) if args.synthetic else args.trace
    records = TraceSource(trace)
    routing_profile = TraceSource(args.routing_profile) if args.routing_profile else None
    from ..engine.simulate.machine import tier1_codec
    from ..engine.simulate.shapes import codec_name

    # A share of fast memory is of the bytes tier 1 holds (a GPU holds int8 or fp8 experts as
    # bf16); a share of host memory of the stored bytes.
    total = shape.total_expert_bytes(tier1_codec(codec_name(args.codec), profile.device))
    host = args.host_mem.nbytes(shape.total_expert_bytes(args.codec)) if args.host_mem else None
    from tqdm.auto import tqdm

    sweep = len(args.fast_mem) > 1
    bar = sweep and show_progress()  # a bar on a terminal; else a line per budget as it finishes
    opts: dict[str, Any] = dict(
        host_bytes=host,
        codec=args.codec,
        policies=args.policies,
        seed=args.seed,
        routing_profile=routing_profile,
    )
    # A budget below one layer's top-k is refused; a policy that needs more (layer-lru: every
    # layer's top-k) is reported infeasible at that budget by `simulate`.
    reports, skipped, errors = [], [], []  # a sweep skips the budgets below the minimum working set
    n = len(args.fast_mem)
    for i, b in enumerate(
        tqdm(args.fast_mem, desc="simulate", unit="budget", file=sys.stderr, leave=False, disable=not bar)
    ):
        try:
            reports.append(
                simulate(records, shape, profile, fast_bytes=b.nbytes(total), recall=args.recall, **opts)
            )
        except SimulationError as e:
            skipped.append(b.nbytes(total))
            errors.append(e)
            continue  # said after the loop (and where none fits, only the error is)
        if sweep and not bar:
            _progress_line(i + 1, n, b.nbytes(total), total)
    if errors and (len(args.fast_mem) == 1 or not reports):
        raise errors[0]
    for e in errors:
        sys.stderr.write(f"freetoken simulate: skipped a budget: {e}\n")
    if args.json:
        docs = [dict(r.to_dict(), fast_fraction=r.fast_bytes / total) for r in reports]
        one = len(args.fast_mem) == 1
        doc = docs[0] if one else {"simulated": True, "reports": docs, "skipped": skipped}
        write(json.dumps(doc, indent=2) + "\n")
    else:
        write(format_reports(reports, total))
    if args.plot:
        plot(reports, total, args.plot)
        if not args.json:
            write(f"plot: {args.plot}\n")
    return 0


def _synthetic(model: str, tokens: int | None, seed: int) -> list[Any]:
    """A synthetic decode trace of `model` from its calibrated preset (`synthetic.preset_trace`)."""
    from ..engine.simulate.synthetic import MIXTRAL_8X7B, QWEN3_30B_A3B, preset_trace

    presets = {"mixtral-8x7b": MIXTRAL_8X7B, "qwen3-30b-a3b": QWEN3_30B_A3B}
    return preset_trace(presets[model], tokens=tokens or SYNTHETIC_TOKENS, seed=seed)


def _progress_line(i: int, n: int, fast: int, total: int) -> None:
    """One line on stderr for a sweep's budget `i` of `n` as it finishes (stderr not a terminal)."""
    from ..engine.memory.budget import format_size

    sys.stderr.write(
        f"freetoken simulate: budget {i}/{n} done: fast memory {format_size(fast)} ({fast / total:.0%})\n"
    )
    sys.stderr.flush()


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    return "\n".join(line.rstrip() for line in lines) + "\n"


def format_reports(reports: Sequence[SimulationReport], total: int) -> str:
    """The plain-text tables: a SIMULATED header, then per fast budget every policy and the bound."""
    from ..engine.memory.budget import format_size

    r0 = reports[0]
    host = "unbounded" if r0.host_bytes is None else format_size(r0.host_bytes)
    out = [
        f"SIMULATED figures (predicted on a modelled machine, not measured): model {r0.model}, "
        f"hardware {r0.hardware}, codec {r0.codec}, {r0.decode_tokens} decode tokens\n",
        f"experts: {format_size(total)} in all, as tier 1 holds them; host memory for experts: {host}\n",
        f"static and qstar-profiled start from {r0.profile}\n",
        r0.costs_line(),
    ]
    for r in reports:
        links = sorted({link for res in r.results for link in res.bytes_per_token})
        rows = [["policy", "tok/s", "miss/tok fast", "miss/tok host", "cpu experts/tok"]]
        rows[0] += [f"GB/tok {link}" for link in links] + ["% of bound", "overlapped tok/s"]
        for res in r.results:
            if res.tokens_per_s is None:
                rows.append([res.policy, "-", "-", "-", "-"] + ["-" for _ in links] + ["-", "-"])
                continue
            own = res.overlapped_tokens_per_s
            rows.append(
                [res.policy, f"{res.tokens_per_s:.2f}", f"{res.misses_per_token['fast']:.2f}"]
                + [f"{res.misses_per_token['host']:.2f}", f"{res.cpu_experts_per_token:.2f}"]
                + [f"{res.bytes_per_token.get(link, 0.0) / 1e9:.3f}" for link in links]
                + [f"{100 * res.tokens_per_s / r.bound.tokens_per_s:.0f}%"]
                + ["-" if own is None else f"{own:.2f}"]
            )
        b = r.bound
        out.append(
            f"\nfast memory {format_size(r.fast_bytes)} ({r.fast_bytes / total:.0%} of the expert bytes)\n"
        )
        out.append(_table(rows))
        for res in r.results:
            if res.infeasible:
                out.append(f"{res.policy}: not run: {res.infeasible}\n")
        out.append(
            f"bound: {b.tokens_per_s:.2f} tok/s, limited by {b.limited_by} "
            f"(Belady misses/token: fast {b.misses_per_token['fast']:.2f}, "
            f"host {b.misses_per_token['host']:.2f})\n"
        )
        o = r.online_bound
        out.append(
            f"online bound (an LRU cache, link and CPU perfectly overlapped): {o.tokens_per_s:.2f} tok/s "
            f"(LRU misses/token: fast {o.misses_per_token['fast']:.2f})\n"
        )
        if any(res.overlapped_tokens_per_s is not None for res in r.results):
            out.append("overlapped tok/s: a policy's own misses served as the bound serves Belady's\n")
    return "".join(out)


def plot(reports: Sequence[SimulationReport], total: int, out: str) -> None:
    """Predicted tok/s and tier-1 misses per token against the fast budget (a share of the expert
    bytes) for every policy, the bound dashed; written to `out` with matplotlib's Agg canvas."""
    FigureCanvasAgg, Figure = _plot_backend()
    xs = [r.fast_bytes / total for r in reports]
    style = "o-" if len(reports) > 1 else "o"
    fig = Figure(figsize=(11, 4.5))
    FigureCanvasAgg(fig)
    speed, misses = fig.subplots(1, 2)
    for i, policy in enumerate(res.policy for res in reports[0].results):
        ran = [(x, r.results[i]) for x, r in zip(xs, reports, strict=True) if r.results[i].tokens_per_s]
        px = [x for x, _ in ran]
        speed.plot(px, [res.tokens_per_s for _, res in ran], style, label=policy)
        misses.plot(px, [res.misses_per_token["fast"] for _, res in ran], style, label=policy)
    bounds = [r.bound.tokens_per_s for r in reports]
    if len(reports) > 1:
        speed.plot(xs, bounds, "k--", label="bound")
    else:
        speed.axhline(bounds[0], color="k", linestyle="--", label="bound")
    speed.set(ylabel="predicted decode tok/s", ylim=(0, None))
    misses.set(ylabel="tier-1 misses per token", ylim=(0, None))
    for ax in (speed, misses):
        ax.set_xlabel("fast memory (share of the expert bytes)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    r0 = reports[0]
    fig.suptitle(f"simulated: {r0.model} on {r0.hardware}, {r0.codec} ({r0.decode_tokens} decode tokens)")
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=120)
    except OSError as e:
        raise CLIError(f"cannot write the plot {out}: {e.strerror or e}") from None


def _plot_backend() -> tuple[Any, Any]:
    """matplotlib's Agg canvas and Figure, or CLIError saying how to install it."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise CLIError(f"--plot needs matplotlib: {PLOT_HINT}") from None
    return FigureCanvasAgg, Figure


def _check_writable(path: str, option: str) -> None:
    """CLIError, before any work, where `path` cannot be written: its folder is missing or not a
    folder, or `path` is a folder."""
    target = Path(path)
    folder = target.parent
    if not folder.is_dir():
        raise CLIError(f"{option} {path}: no such folder {folder}")
    if target.is_dir():
        raise CLIError(f"{option} {path}: is a folder")


def _profile_here(args: argparse.Namespace) -> int:
    """Measure this machine (`measure_profile`) and print its TOML, or write it to --out."""
    given = [k for k in ("trace", "tokens", "hardware", "fast_mem", "host_mem", "plot") if getattr(args, k)]
    if given:
        raise CLIError(f"--profile-here measures this machine; drop --{given[0].replace('_', '-')}")
    if args.out is not None:  # before minutes of measuring
        _check_writable(args.out, "--out")
    from ..engine.simulate.measure import measure_profile
    from ..engine.simulate.shapes import shape_for

    # With --model, memory is read as that model's decode reads it (rows of its hidden size), and
    # the tiered overheads measured with its experts per layer and top-k.
    k: dict[str, int] = {}
    if args.model:
        shape = shape_for(args.model)
        top_k = min(shape.top_k, max(1, shape.num_experts // 2))  # misses need 2 x top-k experts
        k = {"matmul_k": shape.hidden, "moe_experts": shape.num_experts, "moe_top_k": top_k}
    toml = measure_profile(quick=args.quick, scratch_dir=args.scratch_dir, **k).to_toml()
    if args.out is None:
        write(toml)
    else:
        try:
            Path(args.out).write_text(toml, encoding="utf-8")
        except OSError as e:  # what it measured is not lost: on stdout
            write(toml)
            raise CLIError(f"cannot write {args.out}: {e.strerror or e} (the profile is above)") from None
        write(f"wrote the measured profile to {args.out} (use it with --hardware {args.out})\n")
    return 0
