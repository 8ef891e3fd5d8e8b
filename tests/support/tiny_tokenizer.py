"""A small byte-level BPE tokenizer with a Qwen2.5-style chat template, trained in the test on a tiny
corpus and saved to a folder, so non-Harmony tests need no downloads. CJK and emoji stay split over
several byte tokens (the vocabulary is small), which exercises incremental UTF-8 handling."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "The user greets me. I answer. Hello! This is the answer.",
    "I need the weather tool. The tool answered. It is sunny in Paris.",
    "one two three four five counting numbers words you said",
    'get_weather city Paris {"name": "get_weather", "arguments": {"city": "Paris"}}',
    "You are a helpful assistant. system user assistant tool response",
    "你好 世界 🌍 🚀 naïve café",
] * 20

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

QWEN_TEMPLATE = """{%- if messages[0]['role'] == 'assistant' %}
    {{- raise_exception('Conversation roles must start with user or system') }}
{%- endif %}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def train_tokenizer(vocab_size: int = 300) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in TAGS])
    return tokenizer


def write_tokenizer_folder(folder: Path, *, template: str = QWEN_TEMPLATE) -> Path:
    """Train and save `tokenizer.json` + `tokenizer_config.json` into `folder`; returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    train_tokenizer().save(str(folder / "tokenizer.json"))
    config = {
        "chat_template": template,
        "eos_token": {"content": "<|im_end|>", "special": True},
        "bos_token": None,
        "tokenizer_class": "Qwen2Tokenizer",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def eos_id(folder: Path) -> int:
    token_id = Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id("<|im_end|>")
    assert token_id is not None
    return token_id
