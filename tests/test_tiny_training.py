"""The embedded model's world, corpus and training script (a smoke run through the real engine)."""

from __future__ import annotations

import random
import shutil
import warnings

import pytest
import torch
from tiny_models import load_reference
from transformers import DynamicCache

from freetoken_agents.engine import DEFAULT_CHAT_TEMPLATE, Engine, render_chat
from freetoken_agents.recipes._coding_format import extract_code
from freetoken_agents.recipes.tiny import coding, corpus, generic, world
from freetoken_agents.recipes.tiny.examples import batches, encode, encode_all, render
from freetoken_agents.recipes.tiny.forward import (
    cache_argument,
    distillation_loss,
    distilled_blocks,
    shared_block_forward,
)
from freetoken_agents.recipes.tiny.train import train


def test_heldout_values_are_never_training_values():
    rng = random.Random(0)
    train_names = {world.place_name(rng, "train") for _ in range(500)}
    held_names = {world.place_name(rng, "heldout") for _ in range(500)}
    assert not train_names & held_names
    assert all(world.in_split(n, "heldout") for n in held_names)


def test_heldout_questions_use_an_unseen_phrasing_or_frame():
    rng = random.Random(1)
    for _ in range(200):
        q = world.tool_question(rng, "heldout")
        seen = {
            frame.format(q=template.format(**q.arguments))
            for frame in world.FRAMES[:-1]
            for template in world.PHRASINGS[q.tool][:-1]
        }
        assert q.question not in seen
        assert all(world.in_split(str(v), "heldout") for v in q.arguments.values())


def test_training_questions_open_with_many_words_and_keep_the_argument():
    rng = random.Random(4)
    questions = [world.tool_question(rng, "train", "get_weather") for _ in range(400)]
    openers = {q.question.split()[0].strip(".,!:") for q in questions}
    assert len(openers) > 25  # not just the phrasings' own few opening words
    for q in questions:
        assert q.arguments["city"] in q.question
        assert not q.question.startswith("Quick question.")  # the held-out frame


def test_training_code_requests_use_more_framings_than_the_heldout_ones():
    rng = random.Random(5)
    tasks = [coding.code_task(rng, "train") for _ in range(300)]
    assert any(t.prompt.startswith("Program `") for t in tasks)
    for t in tasks:
        assert not t.prompt.startswith("Define ")
        assert t.function in t.prompt and t.solution.startswith(f"def {t.function}(")


def test_tool_backends_are_deterministic_and_answer_any_name():
    assert world.call_tool("add", {"a": 2, "b": 40}) == 42
    assert world.call_tool("multiply", {"a": 6, "b": 7}) == 42
    first = world.call_tool("get_weather", {"city": "Zorvath"})
    assert first == world.call_tool("get_weather", {"city": "Zorvath"})
    assert first["condition"] in world.CONDITIONS
    assert world.call_tool("lookup_capital", {"country": "Blum"})["capital"]


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_every_code_template_solution_passes_its_tests(split):
    rng = random.Random(2)
    for template in coding.TEMPLATES:
        task = coding.code_task(rng, split, template)
        scope: dict = {}
        exec(task.solution, scope)  # our own reference code
        for test in task.tests:
            exec(test, scope)


def test_heldout_code_tasks_use_unseen_names_and_wording():
    rng = random.Random(3)
    for _ in range(100):
        task = coding.code_task(rng, "heldout")
        assert world.in_split(task.function, "heldout")
        template = next(t for t in coding.TEMPLATES if t.key == task.template)
        unseen_desc = template.descriptions[-1].split("{")[0] in task.prompt
        assert unseen_desc or task.prompt.startswith("Define ")


def test_extract_code_takes_the_first_block():
    assert extract_code("Sure:\n```python\ndef f():\n    return 1\n```\nmore") == "def f():\n    return 1\n"
    assert extract_code("no code") is None
    assert extract_code("```python\ndef f(): pass") == "def f(): pass"


def test_render_chat_falls_back_to_the_default_template(tiny_checkpoint):
    engine = Engine.from_pretrained(tiny_checkpoint("qwen3_moe"))
    tok = engine.tokenizer
    messages = [{"role": "user", "content": "hi"}]
    text = render_chat(tok, messages, add_generation_prompt=True)
    expected = tok.apply_chat_template(
        messages,
        chat_template=tok.chat_template or DEFAULT_CHAT_TEMPLATE,
        add_generation_prompt=True,
        tokenize=False,
    )
    assert text == expected
    assert engine.apply_chat_template(messages) == tok.encode(text, add_special_tokens=False)


def test_loss_mask_covers_the_conversation_but_not_the_system_block():
    from transformers import PreTrainedTokenizerFast

    from freetoken_agents.recipes.tiny.tokenizer import character_tokenizer, train_tokenizer

    rng = random.Random(4)
    dialogues = [corpus.dialogue(rng) for _ in range(60)]
    bootstrap = PreTrainedTokenizerFast(
        tokenizer_object=character_tokenizer(), chat_template=DEFAULT_CHAT_TEMPLATE
    )
    rendered = [render(bootstrap, d) for d in dialogues]
    tok = train_tokenizer([t for t, _ in rendered], 600)
    for d, (text, spans) in zip(dialogues, rendered, strict=True):
        ids, labels = encode(tok, text, spans)
        learned = tok.decode([t for t, y in zip(ids, labels, strict=True) if y != -100])
        turns = [m for m in d.messages if m["role"] != "system"]
        assert learned.count("<|im_end|>") == len(turns)
        for m in turns:
            assert m["content"].split("\n")[0] in learned
        assert "<tools>" not in learned and "<|im_start|>system" not in learned
        assert learned.startswith("<|im_start|>user")
    # the batched encoding of the training run gives exactly the per-dialogue encoding
    assert encode_all(tok, rendered, chunk=7) == [encode(tok, t, s) for t, s in rendered]


def test_tokenizer_splits_a_name_into_the_same_tokens_in_prose_json_and_code():
    from transformers import PreTrainedTokenizerFast

    from freetoken_agents.recipes.tiny.tokenizer import character_tokenizer, train_tokenizer

    rng = random.Random(5)
    bootstrap = PreTrainedTokenizerFast(
        tokenizer_object=character_tokenizer(), chat_template=DEFAULT_CHAT_TEMPLATE
    )
    tok = train_tokenizer([render(bootstrap, corpus.dialogue(rng))[0] for _ in range(300)], 600)

    def name_tokens(text: str, name: str) -> list[str]:
        pieces = tok.tokenize(text)
        joined = ""
        for i, p in enumerate(pieces):  # the pieces that spell `name`, from its first letter
            if name.startswith(p) and "".join(pieces[i:]).startswith(name):
                out = []
                for q in pieces[i:]:
                    out.append(q)
                    joined += q
                    if joined == name:
                        return out
        raise AssertionError(f"{name!r} is not a run of whole tokens in {pieces}")

    name = "Kavonbou"
    prose = name_tokens(f"What is the capital of {name}?", name)
    assert prose == name_tokens(f'{{"country": "{name}"}}', name)
    assert prose == list(name)  # one character a token, like digits
    fn = "apply_sable"
    assert name_tokens(f"def {fn}(x):", fn) == list(fn)
    assert name_tokens(f"Implement `{fn}(x)`.", fn) == name_tokens(f"def {fn}(x):", fn)
    assert name_tokens(f"Create a function {fn}(x) which", fn) == name_tokens(f"def {fn}(x):", fn)


@pytest.mark.filterwarnings("error::FutureWarning")  # no deprecated transformers argument either
def test_a_shared_system_block_gives_the_logits_of_the_full_sequences(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("qwen3_moe"), experts_implementation="eager")
    g = torch.Generator().manual_seed(0)
    block = tuple(torch.randint(5, 100, (17,), generator=g).tolist())
    rows = [torch.randint(5, 100, (n,), generator=g).tolist() for n in (9, 4, 7)]
    examples = [(block, r, r) for r in rows] + [((1, 2), [3, 4], [3, 4])]  # another block: another batch
    seen = 0
    for b, ids, labels, mask in batches(examples, 10_000, 0, random.Random(0)):
        if tuple(b.tolist()) != block:
            continue
        logits = shared_block_forward(model, b, ids, mask).logits  # [B, T, V]
        for row in range(ids.shape[0]):
            n = int(mask[row].sum()) - len(block)
            assert torch.equal(labels[row, n:], torch.full_like(labels[row, n:], -100))  # padding unlearned
            full = torch.tensor([list(block) + ids[row, :n].tolist()])
            expected = model(input_ids=full).logits[0, len(block) :]
            torch.testing.assert_close(logits[row, :n], expected, atol=1e-4, rtol=1e-4)
            seen += 1
    assert seen == 3


def test_training_smoke_run_writes_an_ftw_the_engine_runs(tmp_path):
    torch.manual_seed(0)
    ftw = train(tmp_path, steps=2, dialogues=120, tokens_per_batch=2048, vocab_size=700)
    engine = Engine.from_pretrained(ftw)
    assert engine.spec.model_type == "qwen3_moe"
    ids = engine.apply_chat_template([{"role": "user", "content": "What is 2 plus 3?"}], corpus.TOOL_SCHEMAS)
    out = engine.generate(ids, max_new_tokens=4)
    assert len(out.token_ids) >= 1
    assert "<|im_end|>" in engine.tokenizer.convert_ids_to_tokens(engine.default_stop_token_ids())


@pytest.mark.parametrize("copy_first", [0, 2, 3])  # 2: stopped at the curriculum's last step
def test_a_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(tmp_path, copy_first):
    """A long CPU run is stopped and resumed from `out/last`: the optimizer, the schedule and the
    place in the batch order come back, so the final weights are the same bit for bit (with a
    copy-first curriculum, stopped inside it)."""
    from safetensors.torch import load_file

    kw = {"steps": 4, "dialogues": 160, "tokens_per_batch": 1024, "vocab_size": 700, "threads": 1}
    kw["copy_first"] = copy_first
    torch.manual_seed(0)
    train(tmp_path / "whole", save_every=2, **kw)
    assert (tmp_path / "whole" / "last" / "progress.pt").is_file()
    shutil.copytree(tmp_path / "whole" / "last", tmp_path / "resumed" / "last")
    train(tmp_path / "resumed", save_every=2, resume=True, **kw)
    whole = load_file(tmp_path / "whole" / "hf" / "model.safetensors")
    resumed = load_file(tmp_path / "resumed" / "hf" / "model.safetensors")
    assert whole.keys() == resumed.keys()
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    fresh = load_file(tmp_path / "whole" / "last" / "model.safetensors")  # the step-2 weights differ
    assert not all(torch.equal(whole[k], fresh[k]) for k in whole)


def test_copy_first_trains_its_first_steps_on_the_plain_corpus(tmp_path, monkeypatch):
    """`copy_first=N`: N steps from a corpus of plain, always-calling generic requests (its own seed),
    then the run's own corpus for the rest of the steps, in its own batch order from epoch 0."""
    from freetoken_agents.recipes.tiny import train as train_module

    corpora, taken = [], []
    real_build, real_steps = train_module.build_corpus, train_module._phase_steps

    def build(rng, size, **kw):
        corpora.append(kw)
        return real_build(rng, size, **kw)

    def phase_steps(examples, tokens, pad, seed, epoch, skip):
        for item in real_steps(examples, tokens, pad, seed, epoch, skip):
            taken.append((seed, item[0]))
            yield item

    monkeypatch.setattr(train_module, "build_corpus", build)
    monkeypatch.setattr(train_module, "_phase_steps", phase_steps)
    train(tmp_path, steps=3, dialogues=120, tokens_per_batch=1024, vocab_size=700, threads=1, copy_first=2)
    assert corpora[0]["no_call_share"] == generic.NO_CALL_SHARE and not corpora[0].get("plain_generic")
    assert corpora[1]["no_call_share"] == 0.0 and corpora[1]["plain_generic"]
    first_seed = train_module._COPY_FIRST_SEED
    assert [seed for seed, _ in taken] == [first_seed, first_seed, 0]
    assert taken[2][1] == 0  # the main corpus from its first epoch


def test_a_copy_first_longer_than_the_run_is_a_one_line_error(tmp_path, capsys):
    from freetoken_agents.recipes.tiny.train import main

    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path), "--steps", "5", "--copy-first", "6"])
    assert exc.value.code == 2
    assert "--copy-first must be between 0 and --steps (5), got 6" in capsys.readouterr().err.splitlines()[-1]


def test_distillation_loss_is_the_teachers_kl_over_the_labelled_next_tokens():
    torch.manual_seed(0)
    student, teacher = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    labels = torch.tensor([[-100, -100, 3, 4, -100], [-100, 1, 2, -100, -100]])
    assert distillation_loss(student, student, labels).item() == pytest.approx(0.0, abs=1e-6)
    # Position t predicts label t + 1: positions (0, 1), (0, 2), (1, 0) and (1, 1) count.
    counted = [(0, 1), (0, 2), (1, 0), (1, 1)]
    expected = sum(
        torch.sum(teacher[b, t].softmax(-1) * (teacher[b, t].log_softmax(-1) - student[b, t].log_softmax(-1)))
        for b, t in counted
    ) / len(counted)
    assert distillation_loss(student, teacher, labels).item() == pytest.approx(expected.item(), rel=1e-5)
    moved = teacher.clone()
    moved[0, 0] += 5.0  # predicts an unlabelled token
    moved[1, 4] += 5.0  # the last position predicts nothing
    assert distillation_loss(student, moved, labels).item() == pytest.approx(expected.item(), rel=1e-5)


def test_only_coding_and_world_batches_are_distilled():
    examples = [((1, 2), [3], [3]), ((1, 2), [4], [4]), ((5,), [6], [6]), ((7,), [8], [8])]
    assert distilled_blocks(examples, ["code", "code", "world", "generic"]) == {(1, 2), (5,)}
    with pytest.raises(ValueError, match="shares its system block"):
        distilled_blocks(examples, ["code", "generic", "world", "generic"])
    # In the real corpus the three kinds never share a system block.
    from transformers import PreTrainedTokenizerFast

    from freetoken_agents.recipes.tiny.examples import split_system_block
    from freetoken_agents.recipes.tiny.tokenizer import character_tokenizer, train_tokenizer

    dialogues = corpus.build_corpus(random.Random(0), 120, code_share=0.3, world_share=0.2)
    bootstrap = PreTrainedTokenizerFast(
        tokenizer_object=character_tokenizer(), chat_template=DEFAULT_CHAT_TEMPLATE
    )
    rendered = [render(bootstrap, d) for d in dialogues]
    tok = train_tokenizer([t for t, _ in rendered], 600)
    examples = [split_system_block(*encode(tok, text, spans)) for text, spans in rendered]
    blocks = distilled_blocks(examples, [d.kind for d in dialogues])
    assert {"code", "world", "generic"} == {d.kind for d in dialogues}
    assert blocks == {e[0] for e, d in zip(examples, dialogues, strict=True) if d.kind != "generic"}
    assert blocks < {e[0] for e in examples}


def test_a_teacher_adds_its_kl_to_the_coding_and_world_batches(tmp_path):
    """Continuing a model with itself as the teacher: at weight 0 the run is the run without a
    teacher bit for bit; at weight 1 the second step's weights differ (the student has moved)."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    start = train(tmp_path / "start", steps=1, dialogues=120, tokens_per_batch=1024, vocab_size=700)
    kw = {"steps": 2, "dialogues": 120, "tokens_per_batch": 1024, "threads": 1, "init": start}
    train(tmp_path / "alone", **kw)
    train(tmp_path / "zero", teacher=start, distill=0.0, **kw)
    train(tmp_path / "one", teacher=start, distill=1.0, **kw)
    alone, zero, one = (
        load_file(tmp_path / run / "hf" / "model.safetensors") for run in ("alone", "zero", "one")
    )
    assert all(torch.equal(alone[k], zero[k]) for k in alone)
    assert not all(torch.equal(alone[k], one[k]) for k in alone)


def test_a_missing_teacher_is_a_one_line_error(tmp_path, capsys):
    from freetoken_agents.recipes.tiny.train import main

    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path / "run"), "--steps", "1", "--teacher", str(tmp_path / "nope.ftw")])
    assert exc.value.code == 2
    assert f"--teacher: no file {tmp_path / 'nope.ftw'}" in capsys.readouterr().err.splitlines()[-1]
    assert not (tmp_path / "run").exists()


def test_cache_argument_follows_the_transformers_release(tiny_checkpoint):
    class Before:  # transformers 5 releases before the rename
        def forward(self, input_ids=None, past_key_values=None, use_cache=None): ...

    assert cache_argument(Before()) == "past_key_values"
    model = load_reference(tiny_checkpoint("qwen3_moe"))  # the installed transformers takes it
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # and not as a deprecated name
        kv = {cache_argument(model): DynamicCache()}
        out = model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True, **kv)
    assert out.logits.shape[:2] == (1, 3)


MISSING_CUDA_99 = (
    "does not exist: this machine has" if torch.cuda.is_available() else "requested but CUDA is not available"
)


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("cuda:99", f"--device: device 'cuda:99' {MISSING_CUDA_99}"),
        ("tpu", "--device: device must be 'cpu' or 'cuda[:N]', got 'tpu'"),
    ],
)
def test_training_on_a_device_the_machine_lacks_is_a_one_line_error(tmp_path, capsys, device, message):
    from freetoken_agents.recipes.tiny.train import main

    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path), "--steps", "1", "--device", device])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err.splitlines()[-1]
    assert not any(tmp_path.iterdir())  # refused before any work


def test_a_no_call_share_outside_0_1_is_a_one_line_error(tmp_path, capsys):
    from freetoken_agents.recipes.tiny.train import main

    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path), "--steps", "1", "--no-call-share", "1.5"])
    assert exc.value.code == 2
    assert "--no-call-share must be between 0 and 1, got 1.5" in capsys.readouterr().err.splitlines()[-1]
    assert not any(tmp_path.iterdir())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_training_smoke_run_on_cuda_writes_an_ftw_the_engine_runs(tmp_path):
    torch.manual_seed(0)
    ftw = train(tmp_path, steps=2, dialogues=120, tokens_per_batch=2048, vocab_size=700, device="cuda")
    engine = Engine.from_pretrained(ftw)
    ids = engine.apply_chat_template([{"role": "user", "content": "What is 2 plus 3?"}], corpus.TOOL_SCHEMAS)
    assert len(engine.generate(ids, max_new_tokens=4).token_ids) >= 1


def test_a_teacher_the_run_cannot_distil_from_is_a_one_line_error(tmp_path, capsys):
    """Without --init the run trains a tokenizer of its own; a file that is not FTW, or an FTW
    file of another tokenizer, cannot teach it: each refused before any work."""
    from freetoken_agents import default_model
    from freetoken_agents.recipes.tiny.train import main

    other = train(tmp_path / "other", steps=1, dialogues=60, tokens_per_batch=1024, vocab_size=700, threads=1)
    not_ftw = tmp_path / "notes.txt"
    not_ftw.write_text("not a model")
    shipped = str(default_model())
    cases = [
        (["--teacher", shipped], "--teacher needs --init: the teacher's tokenizer must be the model's"),
        (["--teacher", str(not_ftw), "--init", shipped], "not an FTW file"),
        (
            ["--teacher", str(other), "--init", shipped],
            f"--teacher {other} has another tokenizer than --init",
        ),
    ]
    for extra, message in cases:
        with pytest.raises(SystemExit) as exc:
            main(["--out", str(tmp_path / "run"), "--steps", "1", *extra])
        assert exc.value.code == 2
        assert message in capsys.readouterr().err.splitlines()[-1]
        assert not (tmp_path / "run").exists()
