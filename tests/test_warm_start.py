"""A warm start from a recorded routing (`routing_profile=PATH`, `--routing-profile`): q*'s routing
frequencies seeded as if the engine had run the profile, tier 1 filled with its most used experts
while loading; the logits unchanged; profiles that do not fit the model refused in one line."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from freetoken_agents.engine import Engine, EngineError, MemoryBudget, TieringOptions
from freetoken_agents.engine.flags import add_engine_arguments, engine_options
from freetoken_agents.engine.loading.convert import convert_checkpoint
from freetoken_agents.engine.memory.routing import RoutingFrequency
from freetoken_agents.engine.memory.routing_trace import (
    RoutingRecord,
    RoutingTraceError,
    group_steps,
    write_trace,
)
from freetoken_agents.engine.simulate.profiles import load_profile
from freetoken_agents.engine.simulate.replay import SimulationError, TieredReplay
from freetoken_agents.engine.simulate.shapes import shape_for
from freetoken_agents.engine.simulate.simulator import simulate
from freetoken_agents.engine.simulate.synthetic import MIXTRAL_8X7B, preset_trace

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [3, 17, 5, 9, 1, 12, 30]


@pytest.fixture(scope="module")
def tiny_ftw(tiny_checkpoint, tmp_path_factory) -> Path:
    ftw = tmp_path_factory.mktemp("warm") / "mixtral.ftw"
    convert_checkpoint(tiny_checkpoint("mixtral"), ftw, quant="fp32", progress=False)
    return ftw


def profile_records(layers: list[int], hot: dict[int, tuple[int, ...]], tokens: int) -> list[RoutingRecord]:
    """A decode trace routing every token of each layer to `hot[layer]`, plus a prefill of
    expert 0 everywhere (seq 0), then the decode tokens (seq 1)."""
    out = [RoutingRecord(0, t, lay, (0,), (1.0,), "prefill") for t in range(3) for lay in layers]
    for t in range(tokens):
        out += [RoutingRecord(1, t, lay, hot[lay], (1.0,) * len(hot[lay]), "decode") for lay in layers]
    return out


def tiered(ftw: Path, **kwargs) -> Engine:
    one = Engine.from_pretrained(
        ftw, placement="qstar", tiering=TieringOptions(prefetch=False), progress=False
    )
    provider = one.experts
    key = provider.keys()[0]
    fast = provider.fast_bytes[key]
    one.close()
    return Engine.from_pretrained(
        ftw,
        memory=MemoryBudget(fast_bytes=4 * fast),  # room for 4 experts: half of one tiny layer's
        progress=False,
        **{"tiering": TieringOptions(prefetch_thread=False), **kwargs},
    )


def test_the_profile_seeds_the_frequencies_and_fills_tier1_with_its_most_used_experts(
    tiny_ftw: Path, tmp_path: Path
) -> None:
    with Engine.from_pretrained(tiny_ftw) as resident:
        layers = resident.spec.moe_layers()
    hot = {lay: ((lay + 1) % 8, (lay + 3) % 8) for lay in layers}
    records = profile_records(layers, hot, tokens=6)
    path = tmp_path / "profile.jsonl"
    with path.open("w") as f:
        write_trace(records, f)

    cold = tiered(tiny_ftw)  # no profile: an even share of every layer, filled at load
    assert cold.experts.fast.keys() == [(lay, e) for e in range(8) for lay in layers][:4]
    cold.close()
    empty = tiered(tiny_ftw, tiering=TieringOptions(prefetch_thread=False, fill_at_load=False))
    assert len(empty.experts.fast) == 0
    empty.close()
    engine = tiered(tiny_ftw, routing_profile=path)
    provider = engine.experts
    expected = RoutingFrequency(layers)
    for step in group_steps(records):
        for lay in layers:
            expected.note(lay, sorted(step.layers[lay]))
    for key in provider.keys():
        assert provider.routing.of(key) == pytest.approx(expected.of(key))
    # Tier 1 holds 4 experts: the most used ones (every decode token routed to them), the
    # hottest put last (most recently used) and pinned.
    ranked = expected.hottest()
    assert sorted(provider.fast.keys()) == sorted(ranked[:4])
    assert provider.fast.keys() == ranked[:4][::-1]
    assert provider.fast.pinned and provider.fast.pinned <= set(ranked[:4])

    with Engine.from_pretrained(tiny_ftw) as resident, resident.new_session() as a, engine.new_session() as b:
        assert torch.equal(a.prefill(PROMPT), b.prefill(PROMPT))  # the same experts compute alike
        for tok in (4, 11, 2):
            assert torch.equal(a.decode(tok), b.decode(tok))
    engine.close()


def test_a_profile_that_does_not_fit_the_model_is_refused_in_one_line(tiny_ftw: Path, tmp_path: Path) -> None:
    with Engine.from_pretrained(tiny_ftw) as resident:
        layers = resident.spec.moe_layers()
    bad_layer = tmp_path / "layer.jsonl"
    bad_layer.write_text(RoutingRecord(0, 0, max(layers) + 5, (0, 1), (0.5, 0.5), "decode").to_json() + "\n")
    with pytest.raises(RoutingTraceError, match=rf"layer {max(layers) + 5}, not a MoE layer") as e:
        tiered(tiny_ftw, routing_profile=bad_layer)
    assert "\n" not in str(e.value)
    bad_expert = tmp_path / "expert.jsonl"
    bad_expert.write_text(RoutingRecord(0, 0, layers[0], (0, 99), (0.5, 0.5), "decode").to_json() + "\n")
    with pytest.raises(RoutingTraceError, match=rf"expert 99 of layer {layers[0]}"):
        tiered(tiny_ftw, routing_profile=bad_expert)


def test_a_malformed_profile_is_refused_before_anything_loads(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"seq": 0}\n')
    # The model path does not exist: the profile is read first, so its error is the one raised.
    with pytest.raises(RoutingTraceError, match=r"bad.jsonl:1: missing token"):
        Engine.from_pretrained(tmp_path / "absent.ftw", routing_profile=bad)
    with pytest.raises(RoutingTraceError, match=r"cannot read routing trace"):
        Engine.from_pretrained(tmp_path / "absent.ftw", routing_profile=tmp_path / "none.jsonl")


def test_an_empty_profile_is_refused_before_loading_and_a_bad_later_line_names_itself(
    tiny_ftw: Path, tmp_path: Path
) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(RoutingTraceError, match=r"empty.jsonl has no records"):
        Engine.from_pretrained(tmp_path / "absent.ftw", routing_profile=empty)
    with Engine.from_pretrained(tiny_ftw) as resident:
        layer = resident.spec.moe_layers()[0]
    late = tmp_path / "late.jsonl"
    good = RoutingRecord(0, 0, layer, (0, 1), (0.5, 0.5), "decode").to_json()
    late.write_text(good + "\n" + good.replace('"decode"', '"decoding"') + "\n")
    with pytest.raises(RoutingTraceError, match=r"late.jsonl:2: phase must be prefill or decode"):
        tiered(tiny_ftw, routing_profile=late)


def test_the_engine_streams_the_profile(tiny_ftw: Path, tmp_path: Path, monkeypatch) -> None:
    """A long session's trace (100k tokens of a 48-layer model: ~5 M lines) held as steps would
    take gigabytes; the engine notes each step as it reads it, keeping only the frequencies."""
    from freetoken_agents.engine.loading import assemble

    with Engine.from_pretrained(tiny_ftw) as resident:
        layers = resident.spec.moe_layers()
    path = tmp_path / "profile.jsonl"
    with path.open("w") as f:
        write_trace(profile_records(layers, {lay: (2, 5) for lay in layers}, tokens=4), f)
    notes, notes_when_read = [0], []
    note, read = RoutingFrequency.note, assemble.read_trace

    def counted_note(self, layer, used):
        notes[0] += 1
        return note(self, layer, used)

    def spied_read(p):
        for record in read(p):
            notes_when_read.append(notes[0])
            yield record

    monkeypatch.setattr(RoutingFrequency, "note", counted_note)
    monkeypatch.setattr(assemble, "read_trace", spied_read)
    engine = tiered(tiny_ftw, routing_profile=path)
    assert notes_when_read[-1] > 0  # the last line was read after the first steps were noted
    assert set(engine.experts.fast.keys()) <= {(lay, e) for lay in layers for e in (0, 2, 5)}
    assert len(engine.experts.fast) == 4
    engine.close()


def test_the_per_layer_lru_baseline_refuses_a_profile(tiny_ftw: Path, tmp_path: Path) -> None:
    path = tmp_path / "profile.jsonl"
    path.write_text(RoutingRecord(0, 0, 1, (0, 1), (0.5, 0.5), "decode").to_json() + "\n")
    with pytest.raises(EngineError, match="placement 'qstar' only"):
        Engine.from_pretrained(
            tiny_ftw,
            placement="stream",
            memory=MemoryBudget(fast_bytes=10**9),
            tiering=TieringOptions(prefetch=False),
            routing_profile=path,
            progress=False,
        )


def test_resident_experts_ignore_a_profile_with_a_warning(tiny_ftw: Path, tmp_path: Path, caplog) -> None:
    path = tmp_path / "profile.jsonl"
    path.write_text(RoutingRecord(0, 0, 1, (0, 1), (0.5, 0.5), "decode").to_json() + "\n")
    with Engine.from_pretrained(tiny_ftw, routing_profile=path, progress=False) as engine:
        assert engine.placement.placement == "resident"
    assert "routing profile" in caplog.text and "unused" in caplog.text


def test_the_flag_reaches_the_engine_options(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    options = engine_options(parser.parse_args(["--routing-profile", str(tmp_path / "p.jsonl")]))
    assert options.routing_profile == tmp_path / "p.jsonl"
    assert engine_options(parser.parse_args([])).routing_profile is None


def test_the_replay_starts_warm_from_a_profile_and_misses_less_at_first() -> None:
    shape, profile = shape_for("mixtral-8x7b"), load_profile("rtx4090-pcie4")
    steps = group_steps(preset_trace(MIXTRAL_8X7B, tokens=80, seed=0))
    fast = shape.total_expert_bytes("mxfp4") // 2

    def first_misses(warm_start, fill_at_load: bool = False) -> int:
        replay = TieredReplay(
            shape,
            profile,
            codec="mxfp4",
            fast_bytes=fast,
            host_bytes=None,
            warm_start=warm_start,
            fill_at_load=fill_at_load,
        )
        return sum(replay._run_step(step) for step in steps[20:30])

    # Started from the first 20 tokens' routing, tier 1 is full of their most used experts; an
    # empty one fills by demand.
    assert first_misses(steps[:20]) < first_misses(())
    # With no profile, tier 1 filled at load with any half of every layer misses less at first
    # than one that fills by demand.
    assert first_misses((), fill_at_load=True) < first_misses(())
    with pytest.raises(SimulationError, match="placement 'qstar' only"):
        TieredReplay(
            shape,
            profile,
            codec="mxfp4",
            fast_bytes=fast,
            host_bytes=None,
            placement="layer-lru",
            warm_start=steps,
        )


def test_simulate_runs_qstar_from_the_static_splits_profiling_pass() -> None:
    shape = shape_for("mixtral-8x7b")
    report = simulate(
        preset_trace(MIXTRAL_8X7B, tokens=40, seed=1),
        shape,
        load_profile("rtx4090-pcie4"),
        fast_bytes=shape.total_expert_bytes("mxfp4") // 2,
        codec="mxfp4",
        policies=["qstar", "qstar-profiled"],
    )
    cold, warm = report.result("qstar"), report.result("qstar-profiled")
    assert warm.misses_per_token["fast"] < cold.misses_per_token["fast"]


def fixed_routing(layers: int, experts: tuple[int, int], tokens: int, seq: int = 0) -> list[RoutingRecord]:
    """`tokens` decode tokens routed to `experts` at every one of `layers` layers."""
    return [
        RoutingRecord(seq, t, lay, experts, (0.5, 0.5), "decode")
        for t in range(tokens)
        for lay in range(layers)
    ]


def test_a_routing_profile_places_the_static_split_and_starts_qstar_profiled() -> None:
    """`simulate(routing_profile=...)`: both start from another trace (an earlier session's), not
    from the trace's own first quarter, so both predict tokens they never saw."""
    shape, profile = shape_for("mixtral-8x7b"), load_profile("rtx4090-pcie4")
    trace = fixed_routing(32, (0, 1), tokens=12)

    def run(routing_profile):
        return simulate(
            trace,
            shape,
            profile,
            fast_bytes=shape.total_expert_bytes("mxfp4") // 4,  # 2 experts a layer: 64
            codec="mxfp4",
            policies=["qstar-profiled", "static"],
            routing_profile=routing_profile,
        )

    own, same, other = run(None), run(fixed_routing(32, (0, 1), tokens=3)), run(fixed_routing(32, (2, 3), 3))
    assert own.profile == "the trace's first 25% of decode tokens"
    assert same.profile == "a routing profile of 3 tokens"
    assert (
        own.result("static").misses_per_token["fast"] == 0 == same.result("static").misses_per_token["fast"]
    )
    assert other.result("static").misses_per_token["fast"] == 64  # placed by experts never routed
    assert (
        same.result("qstar-profiled").misses_per_token["fast"]
        < other.result("qstar-profiled").misses_per_token["fast"]
    )
    with pytest.raises(RoutingTraceError, match="layers 40 are not MoE layers of mixtral-8x7b"):
        run([RoutingRecord(0, 0, 40, (0, 1), (0.5, 0.5), "decode")])


def test_the_cli_replays_from_a_routing_profile(tmp_path: Path, capsys) -> None:
    from freetoken_agents.cli import main

    trace, profile = tmp_path / "trace.jsonl", tmp_path / "earlier.jsonl"
    for path, seed in ((trace, 0), (profile, 1)):
        with path.open("w") as f:
            write_trace(preset_trace(MIXTRAL_8X7B, tokens=8, seed=seed), f)
    args = ["simulate", "--trace", str(trace), "--model", "mixtral-8x7b", "--hardware", "rtx4090-pcie4"]
    args += ["--codec", "mxfp4", "--fast-mem", "0.5", "--policies", "qstar-profiled,static"]
    assert main([*args, "--routing-profile", str(profile)]) == 0
    assert "static and qstar-profiled start from a routing profile of 8 tokens" in capsys.readouterr().out
    assert main([*args, "--routing-profile", str(profile), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["profile"] == "a routing profile of 8 tokens"
    assert main([*args, "--routing-profile", str(tmp_path / "absent.jsonl")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("freetoken simulate: error: cannot read routing trace") and "\n" not in err
