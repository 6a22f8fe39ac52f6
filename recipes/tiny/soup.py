"""Average two models of the same architecture and tokenizer, weight by weight: a continuation that
learnt a new skill but lost some of an old one, averaged with the model it started from, keeps
most of both (weight-space ensembling; Wortsman et al., "Robust fine-tuning of zero-shot models",
CVPR 2022). The embedded model continued on the generic corpus gained 8 points of generic tool use
and lost 7 of coding first tries; averaged with the model it started from it keeps 3.5 and loses
0.4 (README, "The embedded model").

    python -m freetoken_agents.recipes.tiny.soup A.ftw B.ftw --weight 0.55 --out build/soup

writes `out/hf` (the checkpoint) and `out/model.ftw`: weight x A + (1 - weight) x B, with A's
tokenizer and metadata (the tools it was trained to call). Deterministic: the same files and weight
give the same bytes.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

from freetoken_agents.engine import FTWFormatError
from freetoken_agents.engine.ftw.reader import FTWFile

from .warm import load_ftw

logger = logging.getLogger(__name__)


class SoupError(ValueError):
    """Two FTW files that cannot be averaged (another architecture, shape or tokenizer, not
    Qwen3-MoE), or a weight outside [0, 1]. A file that is not FTW: FTWFormatError."""


def _check_pair(a: Path, b: Path) -> dict:
    """A's metadata, once A and B are known to share their configuration and tokenizer."""
    with FTWFile(a) as fa, FTWFile(b) as fb:
        if fa.model_config != fb.model_config:
            diff = sorted(
                k
                for k in {*fa.model_config, *fb.model_config}
                if fa.model_config.get(k) != fb.model_config.get(k)
            )
            raise SoupError(f"{a} and {b} are different models (config differs in {', '.join(diff)})")
        if fa.tokenizer_files != fb.tokenizer_files:
            raise SoupError(
                f"{a} and {b} have different tokenizers: their weights do not mean the same tokens"
            )
        return dict(fa.metadata)


def soup(a: Path, b: Path, weight: float, out: Path) -> Path:
    """Write `out/hf` and `out/model.ftw`, `weight` x A + (1 - weight) x B; returns the FTW path.
    SoupError for files that cannot be averaged or a weight outside [0, 1]."""
    from freetoken_agents.engine.loading.convert import convert_checkpoint

    if not 0.0 <= weight <= 1.0:
        raise SoupError(f"--weight must be between 0 and 1, got {weight}")
    metadata = _check_pair(a, b)
    try:
        model, tokenizer = load_ftw(a)
        other, _ = load_ftw(b)
    except ValueError as e:  # not a Qwen3-MoE FTW file (warm.load_ftw)
        raise SoupError(str(e)) from None
    theirs = dict(other.named_parameters())
    with torch.no_grad():
        for name, tensor in model.named_parameters():  # a tied lm_head once, not twice
            tensor.mul_(weight).add_(theirs[name], alpha=1.0 - weight)
    hf = out / "hf"
    model.save_pretrained(hf)
    tokenizer.save_pretrained(hf)
    ftw = out / "model.ftw"
    extra = {k: metadata[k] for k in ("trained_tools",) if k in metadata}
    convert_checkpoint(hf, ftw, quant="bf16", progress=False, extra_metadata=extra)
    logger.info("%s x %s + %s x %s -> %s", weight, a, 1.0 - weight, b, ftw)
    return ftw


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path, help="an FTW file (its tokenizer and metadata are kept)")
    p.add_argument("b", type=Path, help="an FTW file of the same model and tokenizer")
    p.add_argument("--weight", type=float, required=True, help="A's share, in [0, 1]")
    p.add_argument("--out", type=Path, required=True, help="output folder (hf/ and model.ftw)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        soup(args.a, args.b, args.weight, args.out)
    except (SoupError, FTWFormatError, OSError) as e:  # a file missing, unreadable or not FTW
        sys.stderr.write(f"error: {e}\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
