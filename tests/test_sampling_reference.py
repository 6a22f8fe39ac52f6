"""The engine's sampling against reference implementations on the same logits: transformers'
logits processors (temperature, min_p, top_k, top_p, repetition penalty) and OpenAI's documented
formula for presence and frequency penalties (logit -= count * frequency + (count > 0) * presence,
counting the output tokens only, as vLLM does); logprobs against log_softmax of the raw logits;
the decode loop (`stream_tokens`) against a hand-written loop over the same model."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from freetoken_agents.engine import Engine, SamplingParams
from freetoken_agents.engine.runtime.sampling import Sampler, token_logprob, warp

V = 1000
PROMPT = [3, 17, 17, 250, 999, 4]
OUTPUT = [17, 42, 42, 42, 7, 250]


def logits_for(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, generator=g) * 3  # a spread like a model's: a few likely tokens


def reference(processors: list, logits: torch.Tensor, ids: list[int] = PROMPT) -> torch.Tensor:
    return LogitsProcessorList(processors)(torch.tensor([ids]), logits[None].clone())[0]


def same(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)  # bit for bit, -inf where dropped


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(
    ("params", "processors"),
    [
        (dict(temperature=0.7), [TemperatureLogitsWarper(0.7)]),
        (dict(temperature=1.0, top_k=1), [TopKLogitsWarper(1)]),
        (dict(temperature=1.0, top_k=40), [TopKLogitsWarper(40)]),
        (dict(temperature=1.0, top_p=0.9), [TopPLogitsWarper(0.9)]),
        (dict(temperature=1.0, top_p=0.3), [TopPLogitsWarper(0.3)]),
        (dict(temperature=1.0, min_p=0.1), [MinPLogitsWarper(0.1)]),
        (dict(temperature=1.0, min_p=0.6), [MinPLogitsWarper(0.6)]),
    ],
    ids=["temperature", "top_k_1", "top_k_40", "top_p_0.9", "top_p_0.3", "min_p_0.1", "min_p_0.6"],
)
def test_each_warper_matches_transformers(seed, params, processors):
    logits = logits_for(seed)
    same(warp(logits.clone(), SamplingParams(**params)), reference(processors, logits))


@pytest.mark.parametrize("seed", range(5))
def test_the_warpers_chain_in_vllm_order(seed):
    """Temperature, then min_p, top_k, top_p (vLLM v1's sampler), as transformers' warpers chained
    in that order."""
    logits = logits_for(seed)
    params = SamplingParams(temperature=0.8, min_p=0.02, top_k=50, top_p=0.8)
    ref = reference(
        [TemperatureLogitsWarper(0.8), MinPLogitsWarper(0.02), TopKLogitsWarper(50), TopPLogitsWarper(0.8)],
        logits,
    )
    same(Sampler(params).process(logits), ref)


def observed(params: SamplingParams) -> Sampler:
    sampler = Sampler(params, PROMPT)
    for token in OUTPUT:
        sampler.observe(token)
    return sampler


def openai_penalties(logits: torch.Tensor, presence: float, frequency: float) -> torch.Tensor:
    counts = torch.bincount(torch.tensor(OUTPUT), minlength=V).float()  # the output only
    out = logits - counts * frequency
    return out - (counts > 0).float() * presence


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_transformers_over_prompt_and_output(penalty):
    logits = logits_for(1)
    ours = observed(SamplingParams(repetition_penalty=penalty)).penalize(logits)
    same(ours, reference([RepetitionPenaltyLogitsProcessor(penalty)], logits, PROMPT + OUTPUT))
    assert not torch.equal(ours, logits)


@pytest.mark.parametrize(("presence", "frequency"), [(0.0, 0.7), (1.5, 0.0), (-0.5, 2.0)])
def test_presence_and_frequency_follow_openai_over_the_output_only(presence, frequency):
    logits = logits_for(2)
    ours = observed(SamplingParams(presence_penalty=presence, frequency_penalty=frequency)).penalize(logits)
    same(ours, openai_penalties(logits, presence, frequency))
    assert ours[3] == logits[3] and ours[999] == logits[999]  # prompt-only tokens: untouched
    assert ours[42] == logits[42] - 3 * frequency - presence


def test_all_penalties_then_warpers_in_vllm_order():
    logits = logits_for(3)
    params = SamplingParams(
        temperature=0.9, top_k=20, repetition_penalty=1.2, presence_penalty=0.4, frequency_penalty=0.3
    )
    penalised = openai_penalties(
        reference([RepetitionPenaltyLogitsProcessor(1.2)], logits, PROMPT + OUTPUT), 0.4, 0.3
    )
    ref = reference([TemperatureLogitsWarper(0.9), TopKLogitsWarper(20)], penalised)
    same(observed(params).process(logits), ref)


def test_greedy_ignores_the_warpers_but_not_the_penalties():
    logits = logits_for(4)
    best = int(torch.argmax(logits))
    warped = SamplingParams(top_k=1, top_p=0.01, min_p=1.0)  # temperature 0: all off
    assert Sampler(warped)(logits) == best
    bf16 = logits.to(torch.bfloat16)
    assert Sampler(SamplingParams())(bf16) == int(torch.argmax(bf16))  # the plain path: as before
    sampler = Sampler(SamplingParams(frequency_penalty=2.0))
    for _ in range(10):
        sampler.observe(best)
    assert sampler(logits) == int(torch.argmax(openai_penalties_of(logits, {best: 10}, 0.0, 2.0)))
    assert sampler(logits) != best


def openai_penalties_of(logits: torch.Tensor, counts: dict[int, int], presence: float, frequency: float):
    out = logits.clone()
    for token, n in counts.items():
        out[token] -= n * frequency + (n > 0) * presence
    return out


def test_draws_stay_inside_what_the_warpers_keep():
    logits = logits_for(5)
    params = dict(temperature=1.5, top_k=8, min_p=0.05)
    kept = torch.isfinite(Sampler(SamplingParams(**params)).process(logits)).nonzero().flatten().tolist()
    picks = {Sampler(SamplingParams(**params, seed=s))(logits) for s in range(200)}
    assert picks <= set(kept) and len(picks) > 1
    assert {Sampler(SamplingParams(temperature=1.0, top_k=1, seed=s))(logits) for s in range(20)} == {
        int(torch.argmax(logits))
    }


def test_forget_takes_an_output_token_back():
    logits = logits_for(6)
    sampler = Sampler(SamplingParams(presence_penalty=1.0, repetition_penalty=1.5), PROMPT)
    sampler.penalize(logits)  # the counts exist from here on
    sampler.observe(42)
    sampler.forget([42])
    same(
        sampler.penalize(logits),
        Sampler(SamplingParams(presence_penalty=1.0, repetition_penalty=1.5), PROMPT).penalize(logits),
    )


def test_token_logprob_is_log_softmax_of_the_raw_logits():
    logits = logits_for(7)
    ref = torch.log_softmax(logits, dim=-1)
    entry = token_logprob(logits, 5, top_n=4)
    assert entry.token_id == 5 and entry.logprob == pytest.approx(float(ref[5]), abs=1e-6)
    values, ids = torch.topk(ref, 4)
    assert [t for t, _ in entry.top] == ids.tolist()
    assert [lp for _, lp in entry.top] == pytest.approx(values.tolist(), abs=1e-6)
    assert token_logprob(logits, 5).top == ()


def test_bounds_are_checked():
    for bad in (
        dict(presence_penalty=2.5),
        dict(frequency_penalty=-3),
        dict(repetition_penalty=0),
        dict(min_p=1.5),
        dict(top_k=0),
        dict(logprobs=21),
    ):
        with pytest.raises(ValidationError):
            SamplingParams(**bad)


# ---- the decode loop on a real tiny model ----------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_checkpoint) -> Engine:
    return Engine.from_pretrained(tiny_checkpoint("qwen3_moe"))


def test_stream_logprobs_are_the_raw_model_distribution(engine):
    """With temperature and penalties on, each event's logprob is still log_softmax of the model's
    own logits for that prefix (recomputed here by one prefill of the prompt and the output)."""
    prompt = [5, 6, 7, 8]
    events = list(
        engine.stream(
            prompt,
            max_new_tokens=8,
            temperature=1.7,
            presence_penalty=2.0,
            seed=3,
            logprobs=3,
            stop_token_ids=(),
        )
    )
    ids = [e.token_id for e in events]
    with engine.new_session() as session:
        logits = session.prefill(prompt + ids[:-1])[len(prompt) - 1 :]
    ref = torch.log_softmax(logits.float(), dim=-1)
    for row, event in zip(ref, events, strict=True):
        lp = event.logprob
        assert lp is not None and lp.token_id == event.token_id
        assert lp.logprob == pytest.approx(float(row[event.token_id]), abs=1e-4)
        assert [t for t, _ in lp.top] == torch.topk(row, 3).indices.tolist()
    assert all(e.logprob is None for e in engine.stream(prompt, max_new_tokens=2, stop_token_ids=()))


@pytest.mark.parametrize(
    "params",
    [dict(frequency_penalty=1.5), dict(presence_penalty=2.0), dict(repetition_penalty=1.8)],
    ids=["frequency", "presence", "repetition"],
)
def test_stream_penalties_match_a_reference_loop(engine, params):
    """Greedy with a penalty: the engine's tokens are those of a loop that applies transformers'
    RepetitionPenaltyLogitsProcessor (prompt + output) or OpenAI's formula (output only) to the
    same model's logits; and they differ from plain greedy (the penalty took effect)."""
    prompt = [5, 6, 7, 8, 9]
    n = 16
    got = engine.generate(prompt, max_new_tokens=n, stop_token_ids=(), **params).token_ids
    plain = engine.generate(prompt, max_new_tokens=n, stop_token_ids=()).token_ids
    out: list[int] = []
    with engine.new_session() as session:
        logits = session.prefill(prompt, last_only=True)[-1].float()
        for _ in range(n):
            scores = logits.clone()
            if "repetition_penalty" in params:
                scores = reference(
                    [RepetitionPenaltyLogitsProcessor(params["repetition_penalty"])], scores, prompt + out
                )
            counts = {t: out.count(t) for t in set(out)}
            scores = openai_penalties_of(
                scores, counts, params.get("presence_penalty", 0.0), params.get("frequency_penalty", 0.0)
            )
            out.append(int(torch.argmax(scores)))
            logits = session.decode(out[-1]).float()
    assert got == out
    assert got != plain
