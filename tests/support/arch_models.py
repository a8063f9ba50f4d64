"""Tiny random-init models of real architectures (Llama, Qwen2 with tied embeddings, Mistral), each with a
byte-level BPE tokenizer trained here with `tokenizers` on a tiny corpus, ChatML special tokens and template,
and two stop ids in its generation config (<|im_end|> and <|endoftext|>). Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

CHATML = (
    "{% if bos_token and add_bos %}{{ bos_token }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>"]
CORPUS = [f"{a}+{b}={a + b}. The answer is {a + b}." for a in range(10) for b in range(10)] + [
    "You are a helpful assistant.",
    "What is the sum? Please think step by step.",
    "user assistant system",
] * 5


def bpe_tokenizer(bos: bool):
    """Byte-level BPE (vocab ~320); ``bos``: a Llama-style tokenizer that prepends <|begin_of_text|> to every
    encoding and whose template writes it too (the pipeline must not double it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=320, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    if bos:
        bos_id = core.token_to_id("<|begin_of_text|>")
        core.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A",
            pair="<|begin_of_text|> $A $B",
            special_tokens=[("<|begin_of_text|>", bos_id)],
        )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token="<|begin_of_text|>" if bos else None,
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHATML.replace("add_bos", "true" if bos else "false")
    return tok


def make_arch_model(kind: str, out_dir: str | Path, seed: int = 0) -> str:
    """``kind``: llama | qwen2 | mistral | mistral-sliding (a sliding-window cache the torch engine refuses); the
    mixtures of experts qwen3-moe | mixtral | olmoe (8 experts, top-2; qwen3-moe with one dense layer between)."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        GenerationConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        OlmoeConfig,
        Qwen2Config,
        Qwen3MoeConfig,
    )

    tok = bpe_tokenizer(bos=kind == "llama")
    ids = dict(
        vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id
    )
    dims = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=256,
    )
    if kind == "llama":
        config = LlamaConfig(**dims, **ids, tie_word_embeddings=False)
    elif kind == "qwen2":
        config = Qwen2Config(**dims, **ids, tie_word_embeddings=True, use_sliding_window=False)
    elif kind == "mistral":
        config = MistralConfig(**dims, **ids, sliding_window=None)
    elif kind == "mistral-sliding":
        config = MistralConfig(**dims, **ids, sliding_window=32)
    elif kind == "qwen3-moe":
        moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
        config = Qwen3MoeConfig(**{**dims, "num_hidden_layers": 3}, **ids, **moe, head_dim=16, mlp_only_layers=[1])
    elif kind == "mixtral":
        config = MixtralConfig(**dims, **ids, num_local_experts=8, num_experts_per_tok=2, sliding_window=None)
    elif kind == "olmoe":
        config = OlmoeConfig(**dims, **ids, num_experts=8, num_experts_per_tok=2)
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config = GenerationConfig(
        eos_token_id=[tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")],
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
    )
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))
    return str(out_dir)


def digit_share(response: str, task: dict) -> float:
    """A reward that varies between samples of a random model (so GRPO has a signal): the share of digits."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)
