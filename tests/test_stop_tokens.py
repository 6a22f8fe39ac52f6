"""Every end-of-sequence id a checkpoint declares ends a turn, as `transformers`' `generate` does: a
Qwen3-style checkpoint whose config.json says `<|im_end|>` and whose generation_config.json lists
`<|im_end|>` and `<|endoftext|>` (issue 35: the old engine read config.json's only, so a model that
emitted `<|endoftext|>` ran on to the length limit). HF folders and FTW files alike."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import transformers
from tiny_models import EOS_TOKEN_ID, PAD_TOKEN_ID

from freetoken_agents import FreeTokenModel, GenerateRequest
from freetoken_agents.engine import CheckpointError, Engine
from freetoken_agents.engine.loading.convert import convert_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

ENDOFTEXT = PAD_TOKEN_ID  # <|endoftext|>: in generation_config.json only, as in Qwen3


@pytest.fixture(scope="module")
def qwen3_like(tiny_checkpoint, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3-like") / "model"
    shutil.copytree(tiny_checkpoint("qwen3_moe"), folder)
    config = json.loads((folder / "generation_config.json").read_text())
    config["eos_token_id"] = [EOS_TOKEN_ID, ENDOFTEXT]
    (folder / "generation_config.json").write_text(json.dumps(config))
    assert json.loads((folder / "config.json").read_text())["eos_token_id"] == EOS_TOKEN_ID
    return folder


def test_the_stop_ids_are_every_eos_id_transformers_stops_at(qwen3_like):
    reference = transformers.GenerationConfig.from_pretrained(qwen3_like).eos_token_id
    ids = Engine.from_pretrained(qwen3_like).default_stop_token_ids()
    assert set(reference) <= set(ids) and ids[0] == EOS_TOKEN_ID  # config.json's id closes our turns


def test_an_ftw_file_keeps_the_generation_configs_eos_ids(qwen3_like, tmp_path):
    convert_checkpoint(qwen3_like, tmp_path / "m.ftw", progress=False)
    folder, ftw = Engine.from_pretrained(qwen3_like), Engine.from_pretrained(tmp_path / "m.ftw")
    assert ftw.default_stop_token_ids() == folder.default_stop_token_ids()


@pytest.mark.parametrize("source", ["folder", "ftw"])
def test_a_turn_ends_at_an_eos_id_named_only_in_generation_config(qwen3_like, tmp_path, source):
    path = qwen3_like
    if source == "ftw":
        path = tmp_path / "m.ftw"
        convert_checkpoint(qwen3_like, path, progress=False)
    model = FreeTokenModel(Engine.from_pretrained(path))
    model.sync(model.render([{"role": "user", "content": "hi"}], None))
    request = GenerateRequest(max_new_tokens=20, logit_bias={ENDOFTEXT: 100.0}, temperature=0.0)
    events = list(model.generate(request))
    done = events[-1]
    assert done.kind == "done" and done.finish_reason == "stop"
    assert model.usage().decoded <= 1  # it stopped at the first <|endoftext|>, not after 20 tokens


@pytest.mark.parametrize(
    ("text", "says"),
    [("{not json", "not valid JSON"), ('{"eos_token_id": "two"}', "must be an int or a list of ints")],
)
def test_a_garbled_generation_config_is_a_checkpoint_error_at_load(qwen3_like, tmp_path, text, says):
    folder = tmp_path / "model"
    shutil.copytree(qwen3_like, folder)
    (folder / "generation_config.json").write_text(text)
    with pytest.raises(CheckpointError, match=says):
        Engine.from_pretrained(folder)


# gpt-oss's generation_config.json as published: eos_token_id [<|return|>, <|endoftext|>, <|call|>]
# (200002, 199999, 200012 in o200k_harmony); here the same tokens by name in the tiny tokenizer.
HARMONY_EOS = ("<|return|>", "<|endoftext|>", "<|call|>")


@pytest.fixture(scope="module")
def gpt_oss_like(tiny_checkpoint, tmp_path_factory) -> Path:
    from real_templates import real_template
    from real_tokenizers import HARMONY_SPECIAL

    folder = tmp_path_factory.mktemp("gpt-oss-like") / "model"
    shutil.copytree(tiny_checkpoint("gpt_oss"), folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": list(HARMONY_SPECIAL)})
    tokenizer.chat_template = real_template("openai-gpt-oss-120b")
    tokenizer.save_pretrained(folder)
    eos = [tokenizer.convert_tokens_to_ids(t) for t in HARMONY_EOS]
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": eos}))
    return folder


@pytest.mark.parametrize("token", ["<|call|>", "<|return|>"])
def test_gpt_oss_call_and_return_end_the_turn(gpt_oss_like, token):
    engine = Engine.from_pretrained(gpt_oss_like)
    reference = transformers.GenerationConfig.from_pretrained(gpt_oss_like).eos_token_id
    assert set(reference) <= set(engine.default_stop_token_ids())
    model = FreeTokenModel(engine)
    model.sync(model.render([{"role": "user", "content": "hi"}], None))
    token_id = engine.tokenizer.convert_tokens_to_ids(token)
    request = GenerateRequest(max_new_tokens=20, logit_bias={token_id: 100.0}, temperature=0.0)
    done = list(model.generate(request))[-1]
    assert done.kind == "done" and done.finish_reason == "stop"
    assert model.usage().decoded <= 1  # it stopped at the harmony end token, not after 20 tokens
