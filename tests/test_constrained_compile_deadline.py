"""Grammar compiles with a deadline, on one compile thread (issue 59, item 2): the server compiles a
request's schemas there before queueing it, so a slow compile delays its own request only. Each
compile here is a function gated on an Event: it ends when the test says, whatever the machine's
speed, and the deadlines only decide who gives up while it is held."""

from __future__ import annotations

import threading

import pytest

from freetoken_agents import SchemaRejected
from freetoken_agents.errors import GrammarCompilerBusy
from freetoken_agents.grammar_cache import CompiledGrammar, GrammarCache

SAFETY = 60.0  # only against a hang: every wait below ends when its Event is set


class Gate:
    """A compile that waits for `release`; `calls` counts the compiles, `threads` where they ran."""

    def __init__(self, result: object = "grammar") -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.result, self.calls, self.threads = result, 0, []

    def __call__(self) -> object:
        self.calls += 1
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        assert self.release.wait(SAFETY)
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


def in_thread(fn, *args, **kwargs) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn(*args, **kwargs)
        except Exception as e:
            out["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_a_timed_compile_runs_on_the_compile_thread_and_is_cached():
    cache, gate = GrammarCache(4), Gate()
    gate.release.set()
    assert cache.get("k", gate, timeout=SAFETY) == "grammar"
    assert cache.get("k", gate, timeout=SAFETY) == "grammar"
    assert gate.calls == 1 and gate.threads == ["freetoken-grammar"]


def test_an_untimed_compile_runs_where_it_is_asked_for():
    cache, gate = GrammarCache(4), Gate()
    gate.release.set()
    assert cache.get("k", gate) == "grammar"
    assert gate.threads == [threading.current_thread().name]


def test_a_compile_past_its_deadline_is_refused_and_still_fills_the_cache():
    cache, gate = GrammarCache(4), Gate()
    with pytest.raises(SchemaRejected, match="did not compile within 0.05 s"):
        cache.get("slow", gate, timeout=0.05)
    assert gate.entered.is_set() and "slow" not in cache
    gate.release.set()
    assert cache.get("slow", gate, timeout=SAFETY) == "grammar"  # joins, or finds it cached
    assert gate.calls == 1


def test_a_compile_waiting_behind_a_slow_one_is_busy_and_dropped():
    cache, slow, other, later = GrammarCache(4), Gate(), Gate("other"), Gate("later")
    thread, _ = in_thread(cache.get, "slow", slow, timeout=SAFETY)
    assert slow.entered.wait(SAFETY)
    with pytest.raises(GrammarCompilerBusy, match="busy"):
        cache.get("other", other, timeout=0.05)
    slow.release.set()
    later.release.set()
    thread.join(SAFETY)
    # queued after the dropped one: once it is done, the dropped one was passed over
    assert cache.get("later", later, timeout=SAFETY) == "later"
    assert other.calls == 0  # nobody waited for it any more: never compiled
    other.release.set()
    assert cache.get("other", other, timeout=SAFETY) == "other"  # a new request compiles it


def test_requests_for_one_schema_share_its_compile():
    cache, gate = GrammarCache(4), Gate()
    first, out1 = in_thread(cache.get, "k", gate, timeout=SAFETY)
    assert gate.entered.wait(SAFETY)
    second, out2 = in_thread(cache.get, "k", gate, timeout=SAFETY)
    untimed, out3 = in_thread(cache.get, "k", gate)  # an Agent's inline compile joins it too
    gate.release.set()
    for thread in (first, second, untimed):
        thread.join(SAFETY)
    assert out1 == out2 == out3 == {"value": "grammar"} and gate.calls == 1


def test_the_compilers_refusal_reaches_the_caller_and_is_not_cached():
    cache, gate = GrammarCache(4), Gate(RuntimeError("bad schema"))
    gate.release.set()
    with pytest.raises(RuntimeError, match="bad schema"):
        cache.get("k", gate, timeout=SAFETY)
    assert "k" not in cache and len(cache) == 0


def test_kept_grammars_come_back_and_the_cache_stays_bounded():
    cache = GrammarCache(2)
    for key in ("a", "b", "c"):
        cache.keep(CompiledGrammar(key, key.upper()))
    assert len(cache) == 2 and "a" not in cache
    cache.keep(CompiledGrammar("a", "A"))  # a request's own grammar, pushed out while it waited
    assert "a" in cache and "b" not in cache
    assert cache.get("a", lambda: pytest.fail("compiled again")) == "A"


@pytest.mark.parametrize("body_format", ["json", "xml_parameters"])
def test_a_precompiled_grammar_is_the_one_decoding_uses(body_format):
    pytest.importorskip("xgrammar")
    from tiny_models import make_tiny_tokenizer

    from freetoken_agents.constrained import GrammarFactory

    tok = make_tiny_tokenizer()
    factory = GrammarFactory(tok, len(tok), (tok.eos_token_id or 0,))
    compiles: list[str] = []
    for name in ("compile_json_schema", "compile_structural_tag"):
        real = getattr(factory.compiler, name)
        setattr(factory.compiler, name, lambda *a, _real=real, **k: compiles.append(a[0]) or _real(*a, **k))
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    handle = factory.precompile(schema, body_format=body_format, timeout=SAFETY)
    factory._cache = GrammarCache(4)  # everything else pushed it out while the request waited
    factory.keep(handle)
    constraint = (
        factory.xml_parameters(schema) if body_format == "xml_parameters" else factory.json_schema(schema)
    )
    assert len(compiles) == 1 and not constraint.complete  # compiled once: by precompile
