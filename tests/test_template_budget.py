"""Hostile chat templates (issue 59, item 7) end in a one-line ChatTemplateError naming the budget
they broke, never a hang, a raw MemoryError or a gigabyte string: nested loops and endless
recursion meet the deadline, and every way of building a large value from a small template is
refused before the value is built. A real-sized prompt still renders."""

from __future__ import annotations

import tracemalloc
from typing import Any

import pytest
import transformers
from tokenizers import Tokenizer, models

from freetoken_agents.engine import DEFAULT_CHAT_TEMPLATE, ChatTemplateError, render_chat
from freetoken_agents.engine.template import budget as tb
from freetoken_agents.engine.template.budget import TemplateBudget

HI = [{"role": "user", "content": "hi"}]
FAST = TemplateBudget(seconds=0.3)  # the deadline tests need not wait for the default


def tokenizer(template: str | None) -> Any:
    """A transformers tokenizer (a word-level vocabulary: rendering reads only the template and
    the named special tokens) with `template`."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|im_end|>": 3}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=words, bos_token="<s>", eos_token="</s>")
    tok.chat_template = template
    return tok


def refused(template: str, budget: TemplateBudget | None = None, messages: Any = HI) -> str:
    kwargs = {"budget": budget} if budget is not None else {}
    with pytest.raises(ChatTemplateError) as caught:
        render_chat(tokenizer(template), messages, **kwargs)
    message = str(caught.value)
    assert message and "\n" not in message and "Traceback" not in message
    return message


NS = "{% set ns = namespace(s='x', a=[1], b=[1], l=[]) %}"
ENDLESS = [  # each would run for hours (or for ever) in transformers' own sandbox
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% set s = 'ab' * 50000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    "{% for i in range(100000) %}{% for m in messages %}{{ m.role|length }}{% endfor %}{% endfor %}"
    "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}",
]


@pytest.mark.parametrize("template", ENDLESS, ids=["nested-range", "nested-strings", "macro-2^60", "loops"])
def test_endless_templates_stop_at_the_deadline(template):
    assert "TEMPLATE_RENDER_SECONDS" in refused(template, FAST)


def test_the_deadline_defaults_to_the_module_constant(monkeypatch):
    monkeypatch.setattr(tb, "TEMPLATE_RENDER_SECONDS", 0.3)
    assert "time budget of 0.3 s (TEMPLATE_RENDER_SECONDS)" in refused(ENDLESS[0])


HUGE = {  # a small template, a value of gigabytes
    "str-repeat": "{{ 'x' * 10**9 }}",
    "list-repeat": "{{ ([1] * 1000) * 10000000 }}",
    "concat-doubling": NS + "{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "plus-doubling": NS + "{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "shared-lists": NS + "{% for i in range(64) %}{% set ns.a = [ns.a, ns.a] %}{% set ns.b = [ns.b, ns.b] %}"
    "{% endfor %}{{ ns.a == ns.b }}",  # comparing them would take 2**64 steps
    "format-width": "{{ '{:>1000000000}'.format(1) }}",
    "format-repeat": "{{ ('{0}' * 1000000).format('y' * 1000) }}",
    "percent-width": "{{ '%1000000000d' % 1 }}",
    "percent-star": "{{ '%*d' % (1000000000, 1) }}",
    "percent-filter": "{{ '%.1000000000f'|format(1.5) }}",
    "center": "{{ 'x'|center(1000000000) }}",
    "ljust": "{{ 'x'.ljust(1000000000) }}",
    "zfill": "{{ '1'.zfill(1000000000) }}",
    "expandtabs": "{{ ('\t' * 100000).expandtabs(100000) }}",
    "join-filter": "{{ ('x' * 100000)|join('y' * 100000) }}",
    "join-method": "{{ ('y' * 100000).join('x' * 100000) }}",
    "replace": "{{ ('x' * 4000000).replace('', 'yyyy') }}",
    "replace-filter": "{{ ('x' * 4000000)|replace('', 'yyyy') }}",
    "indent": "{{ ('\n' * 100000)|indent(100000) }}",
    "tojson-indent": "{% set ns = namespace(d=[1]) %}"
    "{% for i in range(500) %}{% set ns.d = [ns.d] %}{% endfor %}{{ ([ns.d] * 100)|tojson(indent=1000) }}",
    "to-bytes": "{{ (1).to_bytes(1000000000, 'big')|length }}",
    "lipsum": "{{ lipsum(100000000) }}",
    "dict-fromkeys": "{{ dict.fromkeys(range(100000), 'x' * 100000) }}",
    "batch-fill": "{{ [1]|batch(100000, 'x' * 100000)|list }}",
    "output": "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}",
}


@pytest.mark.parametrize("template", HUGE.values(), ids=HUGE.keys())
def test_a_huge_value_is_refused_before_it_is_built(template):
    tracemalloc.start()
    try:
        message = refused(template)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "TEMPLATE_MAX_CHARS" in message
    assert peak < 64 * 2**20, f"{peak} bytes allocated"  # the budget's own cap is 8 Mi characters


@pytest.mark.parametrize(
    ("template", "says"),
    [
        ("{{ 2 ** 100000000 }}", "TEMPLATE_MAX_INT_BITS"),
        ("{{ (10 ** 15000) * (10 ** 15000) }}", "TEMPLATE_MAX_INT_BITS"),
        ("{{ [1]|batch(1000000000, 0)|list }}", "MAX_RANGE"),
        ("{{ range(10**9)|list }}", "MAX_RANGE"),
        ("{% for i in range(9999) %}{% set x = 'x' * 4000000 %}{% endfor %}", "TEMPLATE_MAX_ALLOCATED_CHARS"),
        (  # what a macro writes is kept until it returns: counted as it is written
            "{% macro m() %}{% for i in range(100000) %}{{ ('y' * 1000000).upper() }}{% endfor %}"
            "{% endmacro %}{{ m()|length }}",
            "TEMPLATE_MAX_ALLOCATED_CHARS",
        ),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursion"),
        ("{% for x in [1] recursive %}{{ loop([1]) }}{% endfor %}", "recursion"),
        ("{{ raise_exception('no system role') }}", "no system role"),
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
        ("{% set ns = namespace() %}{% set ns._x = 1 %}", "underscore"),
        ("{% for %}", "refused"),
    ],
)
def test_other_breaches_and_failures_name_their_cause(template, says):
    assert says in refused(template)


def test_a_long_template_is_refused_before_compiling():
    assert "TEMPLATE_MAX_SOURCE_CHARS" in refused("x" * (tb.TEMPLATE_MAX_SOURCE_CHARS + 1))


def test_a_render_can_be_cancelled():
    polls = []

    def cancelled() -> bool:
        polls.append(1)
        return len(polls) >= 3

    budget = TemplateBudget(seconds=600, cancelled=cancelled)  # the deadline never comes into it
    assert "cancelled" in refused(ENDLESS[0], budget)
    assert len(polls) == 3


def test_a_real_sized_prompt_still_renders():
    """A 4 MB conversation (the server's default body limit) in the default template."""
    messages = [{"role": "system", "content": "s"}]
    messages += [{"role": r, "content": "word " * 4000} for _ in range(100) for r in ("user", "assistant")]
    tok = tokenizer(None)
    want = tok.apply_chat_template(messages, chat_template=DEFAULT_CHAT_TEMPLATE, tokenize=False)
    assert render_chat(tok, messages, add_generation_prompt=False) == want
