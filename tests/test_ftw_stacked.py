"""An FTW file resident on a GPU is read whole and stacked per layer (`FTWExpertProvider.take_all`
into `InMemoryExpertProvider`), so its decode runs grouped GEMMs and is captured as a CUDA graph
like an HF folder's; before, FTW files dispatched expert by expert (a host sync per layer, never
captured). The stacking itself is device-agnostic and checked here on CPU against the lazy
provider (bit-equal logits); the GPU path by `-m cuda`."""

from __future__ import annotations

import pytest
import torch

from freetoken_agents.engine import Engine, InMemoryExpertProvider
from freetoken_agents.engine.loading.convert import convert_checkpoint
from freetoken_agents.engine.loading.ftw_load import load_ftw

pytestmark = pytest.mark.usefixtures("one_thread")
IDS = torch.randint(5, 400, (12,), generator=torch.Generator().manual_seed(1)).tolist()


def _logits(engine: Engine) -> list[torch.Tensor]:
    with engine.new_session() as s:
        return [s.prefill(IDS[:6]), *(s.decode(t) for t in IDS[6:])]


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3", "gpt_oss"])
def test_stacked_ftw_experts_give_the_lazy_providers_logits(arch, tiny_checkpoint, tmp_path):
    path = tmp_path / f"{arch}.ftw"
    convert_checkpoint(tiny_checkpoint(arch), path, quant="fp32", progress=False)
    lazy = Engine.from_pretrained(path)
    loaded = load_ftw(path)
    loaded.experts.get(loaded.spec.moe_layers()[0], 1)  # one already read (and cached) lazily
    experts = loaded.experts.take_all()
    assert sorted(experts) == loaded.experts.keys() and loaded.experts.loaded_keys() == []  # handed over
    stacked = InMemoryExpertProvider(experts)
    assert all(stacked.stack(layer) is not None for layer in loaded.spec.moe_layers())
    engine = Engine(loaded.spec, loaded.model, stacked, tokenizer=loaded.tokenizer)
    assert all(torch.equal(a, b) for a, b in zip(_logits(lazy), _logits(engine), strict=True))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_ftw_file_resident_on_the_gpu_is_stacked_and_graph_captured(tiny_checkpoint, tmp_path):
    folder = tiny_checkpoint("qwen3_moe")
    path = tmp_path / "qwen3_moe.ftw"
    convert_checkpoint(folder, path, quant="fp32", progress=False)
    hf = Engine.from_pretrained(folder, device="cuda", dtype=torch.bfloat16, placement="resident")
    ftw = Engine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, placement="resident")
    assert isinstance(ftw.experts, InMemoryExpertProvider) and ftw.experts.graph_safe
    want, got = _logits(hf), _logits(ftw)  # the same weights, both decoded by CUDA graph
    for a, b in zip(want, got, strict=True):
        assert float((a - b).abs().max() / a.abs().max()) < 1e-3
    graphs = ftw.decode_runner.graphs
    assert graphs is not None and graphs.replays == len(IDS) - 6
