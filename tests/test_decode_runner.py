"""The decode runner (engine/runtime/decode_runner.py): it, not the model, chooses eager vs CUDA-graph
decode, under the option `EngineOptions.cuda_graphs` (no environment variable). On CPU every
step is eager; the graph path's dispatch is checked with a stand-in for the captured step (the
captured graph itself: tests/test_cuda_decode.py, on a GPU)."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch

from freetoken_agents.engine import Engine
from freetoken_agents.engine.flags import add_engine_arguments, engine_options
from freetoken_agents.engine.model.experts import DelegatingStore
from freetoken_agents.engine.options import EngineOptions
from freetoken_agents.engine.runtime.cuda_graph import graph_unsupported

pytestmark = pytest.mark.usefixtures("one_thread")
RUNNER_LOG = "freetoken_agents.engine.runtime.decode_runner"
PROMPT = [3, 17, 5, 42, 9, 11]


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("mixtral")


class FakeGraphs:
    """Stands in for `cuda_graph.DecodeGraphs`: counts the decode steps sent to it and runs
    them eagerly (as `StaticDecode.forward` would, last token only)."""

    wanted = True

    def __init__(self, model):
        self.model, self.replays = model, 0

    def run(self, tokens, ctx):
        self.replays += 1
        return self.model.forward_layers(tokens, ctx, last_only=True)


def _eager_steps(engine: Engine) -> list[torch.Tensor]:
    """The logits of decoding 7, 8, 9 after PROMPT, eagerly: what any decode path must give."""
    with engine.new_session() as ref:
        ref.prefill(PROMPT)
        return [ref.decode(t) for t in (7, 8, 9)]


def test_the_option_defaults_on_and_is_part_of_the_key():
    on, off = EngineOptions(), EngineOptions(cuda_graphs=False)
    assert on.cuda_graphs is True and off.cuda_graphs is False
    assert on.key() != off.key()
    assert off.as_kwargs()["cuda_graphs"] is False


def test_the_flag_turns_graphs_off():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_options(parser.parse_args([])).cuda_graphs is True
    assert engine_options(parser.parse_args(["--no-cuda-graphs"])).cuda_graphs is False


def test_from_pretrained_passes_the_option_to_the_runner(path):
    assert Engine.from_pretrained(path).decode_runner.cuda_graphs is True
    engine = Engine.from_pretrained(path, cuda_graphs=False)
    assert engine.decode_runner.cuda_graphs is False
    assert engine.decode_runner.model is engine.model


def test_on_cpu_decode_is_eager_and_greedy_tokens_do_not_change(path, caplog):
    on, off = Engine.from_pretrained(path), Engine.from_pretrained(path, cuda_graphs=False)
    with caplog.at_level(logging.INFO, logger=RUNNER_LOG):
        a = on.generate(PROMPT, max_new_tokens=8, temperature=0.0, stop_token_ids=())
        b = off.generate(PROMPT, max_new_tokens=8, temperature=0.0, stop_token_ids=())
    assert a.token_ids == b.token_ids and len(a.token_ids) == 8
    assert on.decode_runner.graphs is None and off.decode_runner.graphs is None
    reasons = [r.getMessage() for r in caplog.records if r.name == RUNNER_LOG]
    # one decision per runner (one provider each), logged once
    assert reasons == [
        "decode runs eagerly (no CUDA graph): not on a CUDA device",
        "decode runs eagerly (no CUDA graph): cuda_graphs=False",
    ]


def test_graph_unsupported_names_the_option_first(path, monkeypatch):
    model = Engine.from_pretrained(path).model
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # a device name: no GPU is touched
    assert graph_unsupported(model, cpu, cuda_graphs=False) == "cuda_graphs=False"
    assert graph_unsupported(model, cuda, cuda_graphs=False) == "cuda_graphs=False"
    assert graph_unsupported(model, cpu, cuda_graphs=True) == "not on a CUDA device"
    on_cuda = graph_unsupported(model, cuda, cuda_graphs=True)
    assert on_cuda != "cuda_graphs=False"
    # the old environment switch is gone: it changes nothing
    monkeypatch.setenv("FREETOKEN_CUDA_GRAPHS", "0")
    assert graph_unsupported(model, cuda, cuda_graphs=True) == on_cuda
    monkeypatch.setenv("FREETOKEN_CUDA_GRAPHS", "1")
    assert graph_unsupported(model, cuda, cuda_graphs=False) == "cuda_graphs=False"


def test_the_runner_sends_decode_steps_to_the_graph_and_switches(path, caplog):
    engine = Engine.from_pretrained(path)
    runner = engine.decode_runner
    want = _eager_steps(engine)
    fake = FakeGraphs(engine.model)
    runner.use_graphs(fake)  # type: ignore[arg-type]
    with engine.new_session() as s:
        s.prefill(PROMPT)  # prefill is eager
        assert fake.replays == 0
        got = [s.decode(t) for t in (7, 8)]
        assert fake.replays == 2 and runner.graphs is fake
        runner.cuda_graphs = False  # switched off mid-run: decided again, eager
        assert runner.graphs is None
        with caplog.at_level(logging.INFO, logger=RUNNER_LOG):
            got.append(s.decode(9))
        assert fake.replays == 2 and runner.graphs is None
    assert "cuda_graphs=False" in caplog.text
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_new_expert_provider_is_decided_again(path, caplog):
    engine = Engine.from_pretrained(path)
    runner = engine.decode_runner
    runner.use_graphs(FakeGraphs(engine.model))  # type: ignore[arg-type]
    engine.use_expert_provider(DelegatingStore(engine.experts))
    with caplog.at_level(logging.INFO, logger=RUNNER_LOG), engine.new_session() as s:
        s.prefill(PROMPT)
        s.decode(1)
        s.decode(2)
    assert runner.graphs is None  # decided for the new provider: eager on a CPU
    assert caplog.text.count("decode runs eagerly") == 1


class WrongGraphs(FakeGraphs):
    """A replay the expert store finds wrong (`DecodeGraphs.run` returns None): garbage logits
    are computed, then None is returned; `wanted` set False: a store that declines replays."""

    def run(self, tokens, ctx):
        super().run(tokens, ctx)
        return None


def test_a_replay_found_wrong_is_recomputed_eagerly_and_an_unwanted_one_is_not_run(path):
    engine = Engine.from_pretrained(path)
    runner = engine.decode_runner
    want = _eager_steps(engine)
    wrong = WrongGraphs(engine.model)
    runner.use_graphs(wrong)  # type: ignore[arg-type]
    with engine.new_session() as s:
        s.prefill(PROMPT)
        got = [s.decode(7), s.decode(8)]
        assert wrong.replays == 2
        wrong.wanted = False
        got.append(s.decode(9))
        assert wrong.replays == 2  # not asked while the store does not want replays
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_capture_that_fails_leaves_decode_eager_and_correct(path, caplog):
    """A capture that raises (a kernel this driver or torch cannot capture) is logged once and
    decode goes on eagerly, with the eager logits; no capture is tried again."""
    from freetoken_agents.engine.runtime.cuda_graph import DecodeGraphs, StaticDecode

    class UncapturableStep(StaticDecode):
        tries = 0

        def prepare(self, tokens, ctx):
            UncapturableStep.tries += 1
            raise RuntimeError("operation not permitted when stream is capturing")

    engine = Engine.from_pretrained(path)
    want = _eager_steps(engine)
    graphs = DecodeGraphs(engine.model, UncapturableStep)
    engine.decode_runner.use_graphs(graphs)
    with (
        caplog.at_level(logging.WARNING, logger="freetoken_agents.engine.runtime.cuda_graph"),
        engine.new_session() as s,
    ):
        s.prefill(PROMPT)
        got = [s.decode(t) for t in (7, 8, 9)]
    assert UncapturableStep.tries == 1 and graphs.captures == 0 and not graphs.wanted
    assert "not permitted" in (graphs.failed or "")
    assert sum("capturing the decode step failed" in r.message for r in caplog.records) == 1
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
