"""Where a GPU decode token goes: torch.profiler over the engine's resident decode (CUDA graph
and eager) on bench/gpu_decode.py's Qwen3-30B-A3B-shaped model. One command, prints the top CUDA
kernels and CPU ops by total time per decoded token.

    python bench/_gpu_profile.py [--layers 4] [--tokens 16]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/_gpu_profile.py needs a CUDA GPU; none is available here")
        return 1
    from gpu_decode import build

    from freetoken_agents.engine import Engine

    base = Path(os.environ.get("FT_BENCH_DIR", tempfile.gettempdir()))
    folder = Path(tempfile.mkdtemp(dir=base))
    model, _ = build(folder, args.layers)
    del model
    torch.cuda.empty_cache()
    prompt = list(range(100, 116))
    forced = list(range(200, 200 + args.tokens))
    from torch.profiler import ProfilerActivity, profile

    for mode in ("graph", "eager"):
        cuda_graphs = mode == "graph"
        engine = Engine.from_pretrained(folder, device="cuda", dtype=torch.bfloat16, cuda_graphs=cuda_graphs)
        with engine.new_session() as s:
            s.prefill(prompt, last_only=True)
            for t in forced:  # warm-up (capture)
                s.decode(t)
            s.truncate(len(prompt))
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for t in forced:
                    s.decode(t)
                torch.cuda.synchronize()
        print(f"\n===== {mode}: {args.layers} layers, {args.tokens} tokens; sorted by CUDA time =====")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
        print(f"===== {mode}: sorted by CPU time =====")
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=60))
        del engine
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
