"""A tiny gpt-oss that speaks Harmony, built and trained on the CPU for the real-engine tests.

The model has gpt-oss-20b's architecture and vocabulary (`model_type gpt_oss`, vocab 201088, EOS 200002,
alternating sliding/full attention, mixture of experts, YaRN RoPE) shrunk to 2 layers, hidden size 64,
4 experts (top 2), 4 query / 2 KV heads of 16: about 26M parameters, nearly all in the embedding and
unembedding. It is trained from a fixed seed on the conversations in `CONVERSATIONS`, rendered with the
gateway's own Harmony renderer exactly as the gateway renders those requests, until greedy decoding
reproduces every answer token for token. What it answers is documented in docs/tiny-model.md.

Two halves, because the engine's Python is not the gateway's:
- `prepare(folder)` runs in the gateway's environment: it renders the training set (prompt ids, answer
  ids) and writes the gpt-oss tokenizer files (tokenizer.json built offline from the o200k ranks plus the
  Harmony special tokens, like the upstream converter does) and config.json;
- `python tiny_model.py train FOLDER` runs in the MLX environment (it imports only the standard library
  at module level): it builds `mlx_lm.models.gpt_oss.Model`, trains it with Adam and saves float32
  weights (MLX on a CPU cannot run bfloat16 expert matmuls).

`ensure_tiny_model(cache_root, mlx_python)` does both once: the result lives in
`cache_root/tiny-gpt-oss-<hash of this file>`, so editing the recipe rebuilds it and nothing else does.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: The conversation start date the gateway must pin (`--conversation-date`) for the prompts to match.
CONVERSATION_DATE = "2026-01-01"
SEED = 20260101

WEATHER_TOOL: dict[str, Any] = {
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "The city name."}},
        "required": ["city"],
    },
}
WEATHER_ARGUMENTS = '{"city":"Paris"}'
WEATHER_RESULT = '{"temperature":21,"sky":"sunny"}'

HELLO_PROMPT = "Say hello."
HELLO_REASONING = "The user wants a greeting."
HELLO_ANSWER = "Hello! How can I help you today?"
WEATHER_PROMPT = "What is the weather in Paris?"
WEATHER_REASONING = "I should call get_weather for Paris."
AFTER_TOOL_REASONING = "The tool says it is sunny and 21 degrees."
AFTER_TOOL_ANSWER = "It is sunny and 21 degrees in Paris."
COUNT_PROMPT = "Count from 1 to 30."
COUNT_REASONING = "Counting."
COUNT_ANSWER = " ".join(str(i) for i in range(1, 31))

#: name → (user prompt, tools declared, tool round done, completion text the model is trained to emit).
CONVERSATIONS: dict[str, tuple[str, bool, bool, str]] = {
    "hello": (
        HELLO_PROMPT,
        False,
        False,
        f"<|channel|>analysis<|message|>{HELLO_REASONING}<|end|>"
        f"<|start|>assistant<|channel|>final<|message|>{HELLO_ANSWER}<|return|>",
    ),
    "tool_call": (
        WEATHER_PROMPT,
        True,
        False,
        f"<|channel|>analysis<|message|>{WEATHER_REASONING}<|end|>"
        f"<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        f"<|message|>{WEATHER_ARGUMENTS}<|call|>",
    ),
    "after_tool": (
        WEATHER_PROMPT,
        True,
        True,
        f"<|channel|>analysis<|message|>{AFTER_TOOL_REASONING}<|end|>"
        f"<|start|>assistant<|channel|>final<|message|>{AFTER_TOOL_ANSWER}<|return|>",
    ),
    "count": (
        COUNT_PROMPT,
        False,
        False,
        f"<|channel|>analysis<|message|>{COUNT_REASONING}<|end|>"
        f"<|start|>assistant<|channel|>final<|message|>{COUNT_ANSWER}<|return|>",
    ),
}

CONFIG: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "vocab_size": 201088,
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "layer_types": ["sliding_attention", "full_attention"],
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "experts_per_token": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "sliding_window": 128,
    "rope_theta": 150000,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05,
    "attention_bias": True,
    "attention_dropout": 0.0,
    "swiglu_limit": 7.0,
    "hidden_act": "silu",
    "initial_context_length": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 199998,
    "eos_token_id": 200002,
    "pad_token_id": 199999,
}
ORDINARY_RANKS = 199998
O200K_PATTERN = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)


def recipe_hash() -> str:
    """Identifies the model: this file's bytes (the recipe, the data and the training loop)."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


# -- the gateway half: training data and tokenizer files -----------------------------------------


def render_conversations() -> dict[str, dict[str, list[int]]]:
    """Each conversation's prompt as the gateway renders it (medium effort, pinned date) and its answer."""
    from harmony_gateway.harmony.encoding import PromptRenderer, get_encoding
    from harmony_gateway.harmony.messages import (
        FunctionTool,
        PromptPrefix,
        SystemOptions,
        assistant,
        assistant_call,
        tool_result,
        user,
    )

    encoding = get_encoding()
    renderer = PromptRenderer(encoding)
    tool = FunctionTool(WEATHER_TOOL["name"], WEATHER_TOOL["description"], WEATHER_TOOL["parameters"])
    options = SystemOptions(effort="medium", conversation_start_date=CONVERSATION_DATE)
    out: dict[str, dict[str, list[int]]] = {}
    for name, (prompt, with_tools, after_tool, completion) in CONVERSATIONS.items():
        prefix = PromptPrefix(options, None, (tool,) if with_tools else ())
        history = [user(prompt)]
        if after_tool:
            history += [
                assistant(WEATHER_REASONING, "analysis"),
                assistant_call("functions." + WEATHER_TOOL["name"], WEATHER_ARGUMENTS),
                tool_result("functions." + WEATHER_TOOL["name"], WEATHER_RESULT),
            ]
        out[name] = {
            "prompt": renderer.render_for_completion(prefix, history),
            "answer": list(encoding.encode(completion, allowed_special="all")),
        }
        if after_tool:
            # A client that does not send the reasoning back (Chat clients usually do not) renders without it.
            out[name + "_no_reasoning"] = {
                "prompt": renderer.render_for_completion(prefix, [history[0], *history[2:]]),
                "answer": out[name]["answer"],
            }
    return out


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet (GPT-2's): printable bytes map to themselves, the rest above 255."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def write_tokenizer(folder: Path) -> None:
    """tokenizer.json for o200k_harmony: byte-level BPE whose merges are derived from the tiktoken ranks
    (a token's merge is its best split into two lower-ranked tokens), plus the Harmony special tokens."""
    import quicktok
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    from harmony_gateway.harmony.encoding import get_encoding

    enc = quicktok.get_encoding("o200k_base")
    ranks = {enc.decode_single_token_bytes(r): r for r in range(ORDINARY_RANKS)}
    alphabet = _bytes_to_unicode()

    def spell(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    vocab = {spell(token): rank for token, rank in ranks.items()}
    merges: list[tuple[int, bytes, bytes]] = []
    for token, rank in ranks.items():
        splits = [
            (token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks
        ]
        splits.sort(key=lambda pair: (ranks[pair[0]], ranks[pair[1]]))
        merges.extend((rank, left, right) for left, right in splits)
    merges.sort(key=lambda m: m[0])
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(spell(left), spell(right)) for _, left, right in merges],
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    harmony = get_encoding()
    specials = [
        AddedToken(harmony.decode([i]), special=True, normalized=False)
        for i in range(ORDINARY_RANKS, CONFIG["vocab_size"])
    ]
    tokenizer.add_special_tokens(specials)
    for i, special in zip(range(ORDINARY_RANKS, CONFIG["vocab_size"]), specials, strict=True):
        if tokenizer.token_to_id(special.content) != i:
            raise RuntimeError(f"special token {special.content!r} did not get id {i}")
    probe = "Hello! It is sunny and 21 degrees in Paris."
    if tokenizer.encode(probe).ids != list(enc.encode_ordinary(probe)):
        raise RuntimeError("the rebuilt tokenizer disagrees with o200k_base")
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|startoftext|>",
                "eos_token": "<|return|>",
                "pad_token": "<|endoftext|>",
                "model_max_length": CONFIG["max_position_embeddings"],
            },
            indent=1,
        )
    )
    (folder / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 199998, "eos_token_id": [200002, 199999, 200012], "pad_token_id": 199999})
    )


def prepare(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIG, indent=1))
    (folder / "train.json").write_text(json.dumps({"seed": SEED, "conversations": render_conversations()}))
    write_tokenizer(folder)


def ensure_tiny_model(cache_root: Path, mlx_python: str, *, log: Any = None) -> Path:
    """The trained model folder, built on first use (about a minute on two cores) and reused after.

    Raises RuntimeError (with the trainer's output) when training does not converge.
    """
    target = cache_root / f"tiny-gpt-oss-{recipe_hash()}"
    if (target / "model.safetensors").exists():
        return target
    cache_root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".tiny-gpt-oss-", dir=cache_root))
    try:
        started = time.monotonic()
        prepare(work)
        result = subprocess.run(
            [mlx_python, __file__, "train", str(work)], capture_output=True, text=True, timeout=900
        )
        if result.returncode != 0:
            raise RuntimeError(f"training the tiny model failed:\n{result.stdout}\n{result.stderr}")
        if log is not None:
            log(f"tiny gpt-oss built in {time.monotonic() - started:.1f} s: {result.stdout.strip()}")
        try:
            os.replace(work, target)
        except OSError:
            if not (target / "model.safetensors").exists():  # another process won the race otherwise
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


# -- the MLX half: build, train, save -------------------------------------------------------------


def train(folder: Path, *, max_steps: int = 400, check_every: int = 5) -> str:
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten
    from mlx_lm.models import gpt_oss

    def topk(a: Any, k: int, axis: int = -1) -> tuple[Any, Any]:
        # The router's top-k, with the expert indices outside autodiff (integers have no gradient).
        indices = mx.stop_gradient(mx.argpartition(a, kth=-k, axis=axis)[..., -k:])
        return mx.take_along_axis(a, indices, axis=axis), indices

    gpt_oss.mlx_topk = topk
    config = json.loads((folder / "config.json").read_text())
    data = json.loads((folder / "train.json").read_text())
    mx.random.seed(data["seed"])
    args = gpt_oss.ModelArgs.from_dict(config)
    model = gpt_oss.Model(args)
    mx.eval(model.parameters())

    rows = list(data["conversations"].values())
    width = max(len(r["prompt"]) + len(r["answer"]) for r in rows)
    inputs, targets, weights = [], [], []
    for row in rows:
        seq = row["prompt"] + row["answer"]
        pad = width - len(seq)
        inputs.append(seq[:-1] + [0] * pad)
        targets.append(seq[1:] + [0] * pad)
        first = len(row["prompt"]) - 1  # the position that predicts the first answer token
        weights.append([0.0] * first + [1.0] * len(row["answer"]) + [0.0] * pad)
    x = mx.array(inputs)
    # Only answer positions are scored, and only against the tokens the training set uses: the rows of
    # the other ~200k tokens in the unembedding start at zero and get no gradient, so they stay at zero,
    # their logits are exactly 0, and one constant column (log of their count) makes the loss the exact
    # full-vocabulary cross-entropy. The full 201088-wide softmax costs ~10 s a step on two cores.
    used = sorted({t for row in rows for t in row["prompt"] + row["answer"]})
    column = {t: i for i, t in enumerate(used)}
    positions = [i for i, v in enumerate(sum(weights, [])) if v]
    flat = mx.array(positions)
    y_flat = mx.array([column.get(t, 0) for t in sum(targets, [])])[flat]
    used_ids = mx.array(used)
    rest = mx.full((len(positions), 1), math.log(args.vocab_size - len(used)))
    model.lm_head.weight = mx.zeros_like(model.lm_head.weight)

    def loss_fn(m: Any) -> Any:
        hidden = m.model(x).reshape(-1, args.hidden_size)[flat]
        logits = hidden @ m.lm_head.weight[used_ids].T
        return nn.losses.cross_entropy(mx.concatenate([logits, rest], axis=1), y_flat, reduction="mean")

    # A short warm-up, then a cosine decay: a constant rate memorises fast but keeps jumping out of the
    # minimum late in training; clipping keeps single bad steps from undoing it.
    schedule = optim.join_schedules(
        [optim.linear_schedule(1e-4, 8e-3, 10), optim.cosine_decay(8e-3, max_steps, 1e-4)], [10]
    )
    optimizer = optim.Adam(learning_rate=schedule)
    step_fn = nn.value_and_grad(model, loss_fn)

    def greedy_ok() -> bool:
        # With the right answer so far fed back (teacher forcing), greedy decoding reproduces an answer
        # exactly when every answer position's argmax is its next token; a zero-row token (logit 0)
        # wins whenever the best trained logit is not above 0.
        hidden = model.model(x).reshape(-1, args.hidden_size)[flat]
        logits = hidden @ model.lm_head.weight[used_ids].T
        best = mx.argmax(logits, axis=1)
        top = mx.max(logits, axis=1)
        return bool(mx.all((best == y_flat) & (top > 0)).item())

    loss = float("nan")
    started = time.monotonic()
    for step in range(1, max_steps + 1):
        value, grads = step_fn(model)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state, value)
        loss = value.item()
        if os.environ.get("TINY_MODEL_VERBOSE"):
            sys.stderr.write(f"step {step} loss {loss:.4f} at {time.monotonic() - started:.1f} s\n")
        if step % check_every == 0 and loss < 0.1 and greedy_ok():
            weights_out = dict(tree_flatten(model.parameters()))
            mx.save_safetensors(
                str(folder / "model.safetensors"),
                {k: v.astype(mx.float32) for k, v in weights_out.items()},
                metadata={"format": "mlx"},
            )
            (folder / "train.json").unlink()
            return f"converged after {step} steps, loss {loss:.4f}"
    raise SystemExit(f"no convergence after {max_steps} steps (loss {loss:.4f})")


def main(argv: list[str]) -> None:
    """`build CACHE MLX_PYTHON` (gateway environment) or `train FOLDER` (MLX environment)."""
    if len(argv) == 3 and argv[0] == "build":
        folder = ensure_tiny_model(Path(argv[1]), argv[2], log=lambda line: sys.stdout.write(line + "\n"))
        sys.stdout.write(f"tiny gpt-oss: {folder}\n")
    elif len(argv) == 2 and argv[0] == "train":
        sys.stdout.write(train(Path(argv[1])) + "\n")
    else:
        raise SystemExit("usage: tiny_model.py build CACHE MLX_PYTHON | train FOLDER")


if __name__ == "__main__":
    main(sys.argv[1:])
