"""`freetoken convert HF_DIR|MODEL.gguf OUT.ftw` and `freetoken inspect OUT.ftw [--verify]`."""

from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

from ..engine.choices import CODECS, QUANTS
from ..engine.choices import GGUF_SOURCE as SOURCE
from ..engine.text.tokenizer_files import TOKENIZER_MARKERS
from .common import CLIError

if TYPE_CHECKING:
    from ..engine.ftw import ExpertInfo, FTWFile

# The parsers take their choices from the light `engine.choices`; the converter, the FTW reader
# and their torch load inside the functions that run a command, never for `--help` (issue 65).


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert", help="convert a Hugging Face checkpoint folder or a GGUF file into one .ftw file"
    )
    p.add_argument(
        "hf_dir",
        metavar="SOURCE",
        help="Hugging Face checkpoint folder (config.json + *.safetensors), a GGUF file (llama.cpp), "
        "or a Hub id org/name[@revision][:QUANT]",
    )
    p.add_argument("out", help="output .ftw file")
    p.add_argument(
        "--quant",
        choices=(*QUANTS, SOURCE),
        default=None,
        help="expert codec (default: bf16 for a folder; 'source' for a GGUF file, which keeps each "
        "expert weight's precision: Q8_0 -> int8_b32, Q4_* -> uint4_b32, MXFP4 -> mxfp4); 'auto' "
        "(folders) keeps the most-routed experts in --hot-codec, the rest in --cold-codec",
    )
    p.add_argument("--compress", action="store_true", help="zstd-compress every expert block")
    p.add_argument("--hot-fraction", type=float, default=0.25, help="auto: share of hot experts per layer")
    p.add_argument("--hot-codec", choices=CODECS, default="bf16", help="auto: codec of hot experts")
    p.add_argument("--cold-codec", choices=CODECS, default="mxfp4", help="auto: codec of cold experts")
    p.add_argument(
        "--device", default="cpu", help="auto: where the model runs to measure routing (cpu, cuda, cuda:N)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run_convert)

    p = sub.add_parser("inspect", help="print an .ftw file's header, codecs and sizes per layer")
    p.add_argument("file", help=".ftw file")
    p.add_argument("--verify", action="store_true", help="check every dense tensor and expert block")
    p.add_argument("--no-progress", action="store_true", help="no progress bar while verifying")
    p.set_defaults(run=run_inspect)


def _progress(args: argparse.Namespace) -> bool:
    return not args.no_progress and sys.stderr.isatty()


def check_tokenizer(folder: Path) -> None:
    """CLIError unless `folder` has a tokenizer file. `freetoken generate` and `chat` need the
    .ftw's tokenizer, and the loaders build one only from these markers (`TOKENIZER_MARKERS`):
    without one the file runs on token ids only, which `generate` refused only after the whole
    conversion (issue 65). The Python `convert_checkpoint` still converts such a folder."""
    if not any((folder / name).is_file() for name in TOKENIZER_MARKERS):
        raise CLIError(
            f"{folder} has no tokenizer files (none of {', '.join(TOKENIZER_MARKERS)}), so "
            "`freetoken generate` and `chat` could not use the converted file; copy the model's "
            "tokenizer files into the folder and convert again"
        )


def run_convert(args: argparse.Namespace) -> int:
    from ..engine import Engine, check_device, resolve_model
    from ..engine.loading.calibrate import AutoPolicy
    from ..engine.loading.convert import convert_checkpoint
    from ..engine.loading.gguf import convert_gguf, is_gguf_path

    check_device(args.device)  # a bad --device fails before any work, with or without --quant auto
    source = resolve_model(args.hf_dir, progress=_progress(args))  # a Hub id: its files, fetched
    if is_gguf_path(source):
        report = convert_gguf(
            source,
            args.out,
            quant=args.quant or SOURCE,
            compress=args.compress,
            progress=_progress(args),
        )
        print(report.summary())  # noqa: T201
        return 0
    if args.quant == SOURCE:
        raise ValueError(f"--quant {SOURCE} is for GGUF files; pick a codec for {args.hf_dir}")
    if (source / "config.json").is_file():  # a checkpoint folder (else the converter says what is
        check_tokenizer(source)  # wrong with it), checked before any work, calibration included
    policy = AutoPolicy(hot_fraction=args.hot_fraction, hot_codec=args.hot_codec, cold_codec=args.cold_codec)
    report = convert_checkpoint(
        source,
        args.out,
        quant=args.quant or "bf16",
        compress=args.compress,
        progress=_progress(args),
        auto_policy=policy,
        calibration_device=args.device,
        open_model=Engine.for_calibration,
    )
    print(report.summary())  # noqa: T201
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    from ..engine.ftw import FTWFile

    with FTWFile(args.file) as f:
        for line in describe(f):
            print(line)  # noqa: T201
        if args.verify:
            f.verify(progress=_progress(args))
            print(  # noqa: T201
                f"verify: OK ({len(f.dense_names())} dense tensors, {len(f.expert_keys())} expert blocks)"
            )
    return 0


def describe(f: FTWFile) -> list[str]:
    """Human-readable lines about an open FTW file, from its header and manifest only."""
    from ..engine.ftw.layout import ALIGNMENT

    cfg = f.model_config if isinstance(f.model_config, dict) else {}
    infos = [f.expert_info(*k) for k in f.expert_keys()]
    dense = [f.dense_info(n) for n in f.dense_names()]
    compression = Counter(i.compression for i in infos)
    dense_dtypes = Counter(d.dtype for d in dense)
    lines = [
        f"file: {f.path} ({f.file_size:,} bytes)",
        f"format: FTW {f.version[0]}.{f.version[1]}, alignment {ALIGNMENT}, flags {f.flags}",
        f"model: {cfg.get('model_type', '?')}, {cfg.get('num_hidden_layers', '?')} layers, "
        f"hidden {cfg.get('hidden_size', '?')}, vocab {cfg.get('vocab_size', '?')}",
        f"tokenizer files: {', '.join(sorted(f.tokenizer_files)) or 'none'}",
        f"dense: {len(dense)} tensors, {sum(d.nbytes for d in dense):,} bytes ({_counts(dense_dtypes)})",
        f"experts: {len(infos)} blocks, {sum(i.stored_length for i in infos):,} bytes stored"
        f" ({sum(i.raw_length for i in infos):,} raw); compression {_counts(compression)}",
        f"codecs: weights {_counts(_codecs(infos, bias=False))}; biases {_counts(_codecs(infos, bias=True))}",
    ]
    per_layer: dict[int, list[ExpertInfo]] = defaultdict(list)
    for i in infos:
        per_layer[i.layer].append(i)
    if per_layer:
        lines.append(f"{'layer':>5}  {'experts':>7}  {'stored bytes':>12}  weight codecs")
    for layer, items in sorted(per_layer.items()):
        lines.append(
            f"{layer:>5}  {len(items):>7}  {sum(i.stored_length for i in items):>12,}  "
            + _counts(_codecs(items, bias=False))
        )
    meta = f.metadata if isinstance(f.metadata, dict) else {}
    if "quant" in meta:
        lines.append(f"converted with quant {meta['quant']} from {meta.get('source', '?')}")
    auto = meta.get("auto")
    if isinstance(auto, dict) and isinstance(auto.get("hot_experts"), dict):
        hot = "; ".join(f"{k}: {v}" for k, v in auto["hot_experts"].items())
        lines.append(f"auto: {auto.get('calibration_tokens', '?')} calibration tokens, hot experts {hot}")
    return lines


def _codecs(infos: list[ExpertInfo], *, bias: bool) -> Counter[str]:
    """Codec -> number of projections, over expert weights (``bias=False``) or biases."""
    return Counter(t.codec for i in infos for n, t in i.tensors.items() if n.endswith("_bias") == bias)


def _counts(c: Counter[str]) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(c.items())) or "none"
