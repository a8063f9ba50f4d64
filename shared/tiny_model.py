"""A tiny random-init Llama with a character-level tokenizer, built locally
(no model hub), for tests and smoke runs."""

from __future__ import annotations

import string
from pathlib import Path

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
CHARACTERS = [c for c in string.printable if c not in "\x0b\x0c"]


def build_tokenizer():
    """Character-level tokenizer: <pad>=0, <bos>=1, <eos>=2, then printable ASCII.
    Characters outside the vocabulary encode as "?"."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *CHARACTERS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   clean_up_tokenization_spaces=False)


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def make_tiny_model(out_dir: str | Path, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                    intermediate_size: int = 256, max_position_embeddings: int = 512, seed: int = 0) -> str:
    """Save a random-init LlamaForCausalLM (safetensors) and its tokenizer into ``out_dir``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden_size, num_hidden_layers=num_layers,
                         num_attention_heads=num_heads, num_key_value_heads=num_heads,
                         intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))
    return str(out_dir)
