"""A tiny random-init Llama (or a mixture of experts of the same size class: Qwen3-MoE, Mixtral, OLMoE) with a
character-level tokenizer, built locally (no model hub), for tests and smoke runs."""

from __future__ import annotations

import string
from pathlib import Path

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
# ChatML turn markers: ids 101 and 102, after the characters
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
CHARACTERS = [c for c in string.printable if c not in "\x0b\x0c"]
# Word tokens for the chat format's markup and the JSON keys of tool schemas and calls (ids 103 on), as a real
# tokenizer's merges would have them; the chat models' tokenizer has them (the default agent model), the plain one
# not, so the default plain model (its embedding rows, hence its random init) is what it was before them. Character
# by character the tools prompt was 317 tokens and one calc call 67; with these they are 102 and 25, so a chat
# episode costs a third of the compute and its answer tokens are not drowned in the call's punctuation.
CHAT_WORDS = (
    "<tool_call>",
    "</tool_call>",
    "You may call these tools:\n",
    "Call one as ",
    '{"type": "function", "function": ',
    '{"name": ',
    '"arguments": ',
    '"description": ',
    '"parameters": ',
    '"properties": ',
    '"required": ',
    '"type": ',
    '"object"',
    '"string"',
    "system\n",
    "user\n",
    "assistant\n",
    "tool\n",
)
# ChatML with tools (Qwen2.5 style): a system turn lists the tools as JSON, an assistant's tool calls are written
# <tool_call>{"name": ..., "arguments": ...}</tool_call>, a tool's result comes back in a `tool` turn.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "You may call these tools:\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    'Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n'
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for call in m.tool_calls or [] %}<tool_call>"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(chat_words: bool = False):
    """Character-level tokenizer: <pad>=0, <bos>=1, <eos>=2, then printable ASCII, then the ChatML
    markers <|im_start|>=101, <|im_end|>=102 (special tokens), with ``chat_words`` the chat words (:data:`CHAT_WORDS`,
    103 on), and a ChatML chat template with tool support. Characters outside the vocabulary encode as "?"."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *CHARACTERS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        clean_up_tokenization_spaces=False,
    )
    tok.add_special_tokens({"additional_special_tokens": list(CHAT_TOKENS)})
    if chat_words:
        tok.add_tokens([AddedToken(w, normalized=False, special=False) for w in CHAT_WORDS])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


# the mixture-of-experts variants: model_moe's value -> the family's name in messages
MOE_NAMES = {"qwen3": "Qwen3-MoE", "mixtral": "Mixtral", "olmoe": "OLMoE"}
MOE_EXPERTS = 8
MOE_TOP_K = 2


def model_config(
    tok,
    moe: str = "",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 256,
    max_position_embeddings: int = 512,
    experts: int = MOE_EXPERTS,
    top_k: int = MOE_TOP_K,
):
    """The transformers config of a tiny model for tokenizer ``tok``: a Llama (``moe`` empty), else every layer's MLP
    a mixture of ``experts`` experts of which a token takes ``top_k``, each expert ``intermediate_size // top_k``
    wide so that a token's active parameters are the dense model's."""
    from transformers import LlamaConfig, MixtralConfig, OlmoeConfig, Qwen3MoeConfig

    if moe and moe not in MOE_NAMES:
        raise ValueError(f"moe: expected one of {', '.join(MOE_NAMES)} or '' (dense), got {moe!r}")
    common = dict(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    expert = intermediate_size // top_k
    # the router's load-balancing loss stays off (output_router_logits false, each family's default): the warm
    # start and the trainer see the task's loss alone
    if moe == "qwen3":
        return Qwen3MoeConfig(
            head_dim=hidden_size // num_heads,
            # the MLP of a dense layer (mlp_only_layers): none here
            intermediate_size=intermediate_size,
            moe_intermediate_size=expert,
            num_experts=experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=True,
            output_router_logits=False,
            **common,
        )
    if moe == "mixtral":
        return MixtralConfig(
            head_dim=hidden_size // num_heads,
            intermediate_size=expert,
            num_local_experts=experts,
            num_experts_per_tok=top_k,
            output_router_logits=False,
            **common,
        )
    if moe == "olmoe":
        return OlmoeConfig(
            intermediate_size=expert,
            num_experts=experts,
            num_experts_per_tok=top_k,
            output_router_logits=False,
            **common,
        )
    return LlamaConfig(intermediate_size=intermediate_size, **common)


def describe(moe: str = "", num_layers: int = 2) -> str:
    """The model in words: "2-layer Llama", "2-layer Qwen3-MoE (8 experts, top-2)"."""
    if not moe:
        return f"{num_layers}-layer Llama"
    return f"{num_layers}-layer {MOE_NAMES[moe]} ({MOE_EXPERTS} experts, top-{MOE_TOP_K})"


def make_tiny_model(
    out_dir: str | Path,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 256,
    max_position_embeddings: int = 512,
    seed: int = 0,
    moe: str = "",
    chat_words: bool = False,
) -> str:
    """Save a random-init causal LM (safetensors) and its tokenizer into ``out_dir``: a LlamaForCausalLM, or with
    ``moe`` (qwen3 | mixtral | olmoe) that family's mixture of experts (:func:`model_config`); ``chat_words``: the
    tokenizer has :data:`CHAT_WORDS`."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    tok = build_tokenizer(chat_words)
    config = model_config(
        tok,
        moe,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    # generation ends at <eos> (plain-text prompts) or at the end of the assistant's turn (chat prompts)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id,
        pad_token_id=tok.pad_token_id,
        eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")],
    )
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))
    return str(out_dir)
