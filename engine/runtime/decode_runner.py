"""The decode runner: runs a session's forward passes, choosing per decode step between the
model's eager forward and a CUDA-graph replay (`cuda_graph.DecodeGraphs`).

The model (`transformer.MoETransformer.forward`) is the eager forward only; the engine builds one
`DecodeRunner` over it with the option `EngineOptions.cuda_graphs`, and its sessions call the
runner (`session.SessionHost.decode_runner`). Prefill and a step that already carries static
buffers run eagerly; a decode step replays the captured graph when `cuda_graph.graph_unsupported`
finds no reason against it and the expert store wants one (`DecodeGraphs.wanted`); a replay the
store finds wrong (tiered: a routed expert not in tier 1) is recomputed eagerly. The decision is
taken at the first decode step, taken again when the expert provider changes
(`Engine.use_expert_provider`) or `cuda_graphs` is switched, and a reason against is logged once
per decision.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from ..model.layers import StepContext
from .cuda_graph import DecodeGraphs, expert_provider, graph_unsupported

if TYPE_CHECKING:
    from ..model.transformer import MoETransformer

logger = logging.getLogger(__name__)

_UNDECIDED = object()


class DecodeRunner:
    """Runs `model`'s forward passes: eager, or a decode step by CUDA graph when `cuda_graphs`
    is on and the model allows it. `graphs` is the captured decode step in use (None: eager;
    its `captures` and `replays` count for tests and benchmarks)."""

    def __init__(self, model: MoETransformer, *, cuda_graphs: bool = True) -> None:
        self.model = model
        self._cuda_graphs = bool(cuda_graphs)
        self.graphs: DecodeGraphs | None = None
        self._decided_for: object = _UNDECIDED  # the expert provider `graphs` was decided for

    @property
    def cuda_graphs(self) -> bool:
        """Whether decode steps may replay a CUDA graph (`EngineOptions.cuda_graphs`)."""
        return self._cuda_graphs

    @cuda_graphs.setter
    def cuda_graphs(self, on: bool) -> None:
        """Switch graphs on or off; the next decode step decides again (a graph is recaptured)."""
        self._cuda_graphs = bool(on)
        self.graphs = None
        self._decided_for = _UNDECIDED

    def use_graphs(self, graphs: DecodeGraphs) -> None:
        """Decode by `graphs` from now on, for the current expert provider, whatever
        `graph_unsupported` says (tests: `DecodeGraphs(model, StaticDecode)` runs the static
        step uncaptured on a CPU)."""
        self.graphs, self._decided_for = graphs, expert_provider(self.model)

    def __call__(self, tokens: torch.Tensor, ctx: StepContext, *, last_only: bool = False) -> torch.Tensor:
        """tokens [T] -> logits [T, V] (or [1, V] with last_only), as `model.forward`."""
        if ctx.is_decode and ctx.static is None:
            graphs = self.decode_graphs(tokens.device)
            if graphs is not None and graphs.wanted:
                logits = graphs.run(tokens, ctx)
                if logits is not None:
                    return logits
                # The replay was wrong (a routed expert not in tier 1): recompute eagerly; its
                # K/V writes go to the same slots.
        return self.model(tokens, ctx, last_only=last_only)

    def decode_graphs(self, device: torch.device) -> DecodeGraphs | None:
        """The captured decode step, or None when decode runs eagerly (`graph_unsupported`,
        re-evaluated when the expert provider changes; the reason is logged once)."""
        provider = expert_provider(self.model)
        if self._decided_for is not provider:
            self._decided_for = provider
            reason = graph_unsupported(self.model, device, cuda_graphs=self._cuda_graphs)
            self.graphs = None if reason else DecodeGraphs(self.model)
            if reason:
                logger.info("decode runs eagerly (no CUDA graph): %s", reason)
        return self.graphs
