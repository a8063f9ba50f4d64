"""`streamrl replay`'s text comes from the tokenizer's own library (no transformers import for a command that only
reads): the same text transformers' decode gives, special tokens and byte-level pieces included."""

from __future__ import annotations

import random

from services.ops.replay.text import decoder
from shared.runtime.config.keys import Config
from tests.support.arch_models import bpe_tokenizer


def test_the_replay_text_is_what_transformers_decodes(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    bpe = tmp_path / "bpe"
    bpe_tokenizer(bos=True).save_pretrained(str(bpe))
    rng = random.Random(0)
    for folder in (tiny_model_dir, str(bpe)):
        tok, decode = AutoTokenizer.from_pretrained(folder), decoder(Config(tokenizer=folder))
        for _ in range(300):
            ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(0, 30))]
            assert decode(ids) == tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False), ids
    assert "<|im_end|>" in decoder(Config(tokenizer=str(bpe)))([AutoTokenizer.from_pretrained(bpe).eos_token_id])
