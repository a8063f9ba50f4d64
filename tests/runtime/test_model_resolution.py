"""Model resolution, prompt rendering (chat templates, BOS) and stop ids."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.ops.cli.main import main
from services.ops.launch.tiny_model import load_tokenizer
from shared.runtime.models import ModelNotFound, resolve_model
from shared.runtime.prompt_format import PromptError, encode_prompt, stop_token_ids

ROOT = Path(__file__).resolve().parents[2]


def test_a_folder_resolves_to_itself(tiny_model_dir):
    assert resolve_model(tiny_model_dir) == tiny_model_dir


def test_a_mistyped_path_fails_in_one_line_naming_the_key(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFound, match="config key 'model_dir'.*no folder"):
        resolve_model(str(tmp_path / "models" / "tinyy"))
    rc = main(
        [
            "run",
            "--model-dir",
            str(tmp_path / "models" / "tinyy"),
            "--procfile",
            str(ROOT / "Procfile"),
            "--run-dir",
            str(tmp_path / "runs"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "model_dir" in err and "tinyy" in err
    # nothing was created
    assert not (tmp_path / "models" / "tinyy").exists() and not (tmp_path / "runs").exists()


def test_an_uncached_hub_id_offline_fails_naming_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelNotFound, match="not in the local Hugging Face cache"):
        resolve_model("someone/no-such-model-xyz")


def test_a_cached_hub_id_resolves_offline(monkeypatch, tmp_path, tiny_model_dir):
    """A hub id in the local cache (laid out as huggingface_hub writes it) resolves with no network."""
    import shutil

    cache = tmp_path / "hub"
    snap = cache / "models--someone--tiny" / "snapshots" / ("a" * 40)
    shutil.copytree(tiny_model_dir, snap)
    (cache / "models--someone--tiny" / "refs").mkdir()
    (cache / "models--someone--tiny" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    resolve_model.cache_clear()
    assert Path(resolve_model("someone/tiny")) == snap


def test_a_folder_without_config_is_refused(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(ModelNotFound, match="without config.json"):
        resolve_model(str(tmp_path / "m"))


def test_chat_prompts_use_the_template_and_text_prompts_stay_plain(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    ids = encode_prompt(tok, [{"role": "user", "content": "3+4="}])
    text = tok.decode(ids)
    assert text == "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    # the tiny model wants no BOS
    assert encode_prompt(tok, "3+4=") == tok.encode("3+4=", add_special_tokens=False)


def test_bos_is_added_once_for_a_model_that_expects_it(tiny_model_dir):
    from tokenizers import processors

    tok = load_tokenizer(tiny_model_dir)
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    assert encode_prompt(tok, "3+4=")[:2] == [1, tok.convert_tokens_to_ids("3")]
    # not doubled
    assert encode_prompt(tok, "<bos>3+4=")[:2] == [1, tok.convert_tokens_to_ids("3")]


def test_stop_ids_are_eos_generation_config_and_configured(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert stop_token_ids(tok) == (tok.eos_token_id,)
    assert stop_token_ids(tok, tiny_model_dir) == (tok.eos_token_id, im_end)
    assert stop_token_ids(tok, tiny_model_dir, "<|im_start|>, 7, ;") == (
        tok.eos_token_id,
        im_end,
        tok.convert_tokens_to_ids("<|im_start|>"),
        7,
        tok.convert_tokens_to_ids(";"),
    )
    with pytest.raises(PromptError, match="config key 'stop': 'END' is 3 tokens"):
        stop_token_ids(tok, tiny_model_dir, "END")


def test_a_chat_prompt_without_a_template_is_refused(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    tok.chat_template = None
    with pytest.raises(PromptError, match="chat template"):
        encode_prompt(tok, [{"role": "user", "content": "hi"}])
