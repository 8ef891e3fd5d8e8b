"""A tiny gpt-oss that speaks Harmony, built and trained on the CPU for the real-engine tests.

The model has gpt-oss-20b's architecture and vocabulary (`model_type gpt_oss`, vocab 201088, EOS 200002,
alternating sliding/full attention, mixture of experts, YaRN RoPE) shrunk to 2 layers, hidden size 64,
4 experts (top 2), 4 query / 2 KV heads of 16: about 26M parameters, nearly all in the embedding and
unembedding. It is trained from a fixed seed on the conversations in `CONVERSATIONS`, rendered with the
gateway's own Harmony renderer exactly as the gateway renders those requests, until greedy decoding
reproduces every answer token for token. What it answers is documented in docs/tiny-model.md.

Two halves, because the engine's Python is not the gateway's:
- the gateway's environment renders the training set (`prepare`: config.json and the prompt and answer
  ids) and writes the gpt-oss tokenizer files (`write_tokenizer`: tokenizer.json built offline from the
  o200k ranks plus the Harmony special tokens, like the upstream converter does), the latter while the
  model trains;
- `python tiny_model.py train FOLDER` runs in the MLX environment (it imports only the standard library
  at module level): it builds `mlx_lm.models.gpt_oss.Model`, trains it with Adam on the ~150 tokens the
  conversations use, saves float32 weights (MLX on a CPU cannot run bfloat16 expert matmuls), loads them
  back the way the engine does and checks that greedy decoding over the full vocabulary reproduces every
  answer by a margin.

`ensure_tiny_model(cache_root, mlx_python)` does it all once: the result lives in
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
#: Adam's step size, and the margins (in logits) training stops at and the saved model must keep.
LEARNING_RATE = 2e-3
TRAIN_MARGIN = 2.0
VERIFY_MARGIN = 1.0

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
    """What the trainer reads: config.json and the rendered training set (the tokenizer files come apart)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIG, indent=1))
    (folder / "train.json").write_text(json.dumps({"seed": SEED, "conversations": render_conversations()}))


def ensure_tiny_model(cache_root: Path, mlx_python: str, *, log: Any = None) -> Path:
    """The trained model folder, built on first use (well under a minute of CPU) and reused after.

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
        # The tokenizer files (seconds of BPE merges) are written while the model trains.
        with subprocess.Popen(
            [mlx_python, __file__, "train", str(work)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ) as trainer:
            try:
                write_tokenizer(work)
                out, err = trainer.communicate(timeout=900)
            finally:
                if trainer.poll() is None:
                    trainer.kill()
        if trainer.returncode != 0:
            raise RuntimeError(f"training the tiny model failed:\n{out}\n{err}")
        if log is not None:
            log(f"tiny gpt-oss built in {time.monotonic() - started:.1f} s: {out.strip()}")
        try:
            os.replace(work, target)
        except OSError:
            if not (target / "model.safetensors").exists():  # another process won the race otherwise
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


# -- the MLX half: build, train, save -------------------------------------------------------------


def train(folder: Path, *, max_steps: int = 300) -> str:
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten
    from mlx_lm.models import gpt_oss
    from mlx_lm.utils import load_model

    def topk(a: Any, k: int, axis: int = -1) -> tuple[Any, Any]:
        # The router's top-k, with the expert indices outside autodiff (integers have no gradient).
        indices = mx.stop_gradient(mx.argpartition(a, kth=-k, axis=axis)[..., -k:])
        return mx.take_along_axis(a, indices, axis=axis), indices

    original_topk = gpt_oss.mlx_topk
    gpt_oss.mlx_topk = topk
    config = json.loads((folder / "config.json").read_text())
    data = json.loads((folder / "train.json").read_text())
    mx.random.seed(data["seed"])
    args = gpt_oss.ModelArgs.from_dict(config)
    model = gpt_oss.Model(args)
    mx.eval(model.parameters())

    # Training never touches the 201088-row embedding and unembedding: it works on a table of the ~150
    # tokens the conversations use (an input row and an output row each), written back at the end. The
    # other tokens' output rows are zero and the head has no bias, so their logits are exactly 0 for any
    # input; the loss carries them as one constant column (log of their count), which makes it the exact
    # full-vocabulary cross-entropy, and the stop test asks every trained target to beat both the other
    # used tokens and 0 by a margin. The full vocabulary costs a dense 13M-row gradient and Adam update
    # per step (over a second on two cores); the table costs milliseconds.
    rows = list(data["conversations"].values())
    used = sorted({t for row in rows for t in row["prompt"] + row["answer"]})
    column = {t: i for i, t in enumerate(used)}
    width = max(len(r["prompt"]) + len(r["answer"]) for r in rows) - 1
    inputs: list[list[int]] = []
    targets: list[int] = []
    scored: list[int] = []
    for b, row in enumerate(rows):
        seq = [column[t] for t in row["prompt"] + row["answer"]]
        inputs.append(seq[:-1] + [0] * (width - len(seq) + 1))
        targets.extend(seq[len(row["prompt"]) :])
        # The position that predicts the first answer token is the prompt's last one.
        scored.extend(b * width + i for i in range(len(row["prompt"]) - 1, len(seq) - 1))
    x = mx.array(inputs)
    y = mx.array(targets)
    flat = mx.array(scored)
    rest = math.log(args.vocab_size - len(used))
    used_ids = mx.array(used)

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = model.model
            self.embed = model.model.embed_tokens.weight[used_ids]
            self.head = mx.zeros((len(used), args.hidden_size))

        def logits(self) -> Any:
            hidden = self.body(x, input_embeddings=self.embed[x]).reshape(-1, args.hidden_size)[flat]
            return hidden @ self.head.T

    tiny = Tiny()
    tiny.body.embed_tokens.freeze()

    def loss_fn(m: Tiny) -> tuple[Any, Any]:
        logits = m.logits()
        lse = mx.logaddexp(mx.logsumexp(logits, axis=1), mx.array(rest))
        return mx.mean(lse - mx.take_along_axis(logits, y[:, None], axis=1)[:, 0]), logits

    def margin(logits: Any) -> Any:
        # How far each target's logit is above the best other token's (a used one, or 0 for all the
        # others); positive everywhere means teacher-forced greedy decoding reproduces every answer.
        target = mx.take_along_axis(logits, y[:, None], axis=1)[:, 0]
        others = mx.put_along_axis(logits, y[:, None], mx.array(-math.inf), axis=1)
        return mx.min(target - mx.maximum(mx.max(others, axis=1), 0.0))

    # A short warm-up, then a cosine decay, and clipped gradients: the router's top-k makes the loss
    # jumpy, and a larger rate (5e-3 and up) keeps knocking the model out of a minimum it had reached.
    schedule = optim.join_schedules(
        [
            optim.linear_schedule(LEARNING_RATE / 10, LEARNING_RATE, 10),
            optim.cosine_decay(LEARNING_RATE, max_steps, LEARNING_RATE / 10),
        ],
        [10],
    )
    optimizer = optim.Adam(learning_rate=schedule)
    step_fn = nn.value_and_grad(tiny, loss_fn)

    def evaluate() -> tuple[Any, Any, Any]:
        (value, logits), grads = step_fn(tiny)
        return value, margin(logits), grads

    def update(grads: Any) -> None:
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(tiny, grads)

    loss, gap, step = float("nan"), -math.inf, 0
    started = time.monotonic()
    for step in range(1, max_steps + 1):
        # Judged on the parameters the step's gradient was taken at: when they pass, they are the ones
        # saved, with no update after the check.
        value, gap_arr, grads = evaluate()
        mx.eval(value, gap_arr, grads)
        loss, gap = value.item(), gap_arr.item()
        if os.environ.get("TINY_MODEL_VERBOSE"):
            sys.stderr.write(
                f"step {step} loss {loss:.4f} margin {gap:.2f} at {time.monotonic() - started:.1f} s\n"
            )
        if gap >= TRAIN_MARGIN:
            break
        update(grads)
        mx.eval(tiny.parameters(), optimizer.state)
    else:
        raise SystemExit(f"no convergence after {max_steps} steps (loss {loss:.4f}, margin {gap:.2f})")
    trained = time.monotonic() - started

    embed = model.model.embed_tokens.weight
    embed[used_ids] = tiny.embed
    head = mx.zeros((args.vocab_size, args.hidden_size))
    head[used_ids] = tiny.head
    model.model.embed_tokens.weight = embed
    model.lm_head.weight = head
    mx.save_safetensors(
        str(folder / "model.safetensors"),
        {k: v.astype(mx.float32) for k, v in tree_flatten(model.parameters())},
        metadata={"format": "mlx"},
    )
    gpt_oss.mlx_topk = original_topk
    (folder / "train.json").unlink()
    try:
        served = verify(folder, rows, load_model)
    except BaseException:
        (folder / "model.safetensors").unlink()
        raise
    return (
        f"converged after {step} steps ({trained:.1f} s), loss {loss:.4f}, teacher-forced margin {gap:.2f}; "
        f"greedy over the full vocabulary reproduces every answer (smallest margin {served:.2f})"
    )


def verify(folder: Path, rows: list[dict[str, list[int]]], load_model: Any) -> float:
    """Loads the saved folder as the engine does and decodes each prompt greedily, one token at a time
    with the KV cache, over all 201088 logits: every answer must come out token for token, each step's
    winner ahead of the runner-up by VERIFY_MARGIN (so batching or kernel rounding in the engine cannot
    flip it). Returns the smallest margin seen."""
    import mlx.core as mx

    model, _ = load_model(folder)
    smallest = math.inf
    for row in rows:
        cache = model.make_cache()
        logits = model(mx.array([row["prompt"]]), cache=cache)[0, -1]
        for i, expected in enumerate(row["answer"]):
            top2 = mx.topk(logits, 2)
            best = int(mx.argmax(logits).item())
            gap = float((mx.max(top2) - mx.min(top2)).item())
            if best != expected or gap < VERIFY_MARGIN:
                raise SystemExit(
                    f"greedy decoding diverges at answer token {i}: got {best}, want {expected}, "
                    f"margin {gap:.3f}"
                )
            smallest = min(smallest, gap)
            if i + 1 < len(row["answer"]):
                logits = model(mx.array([[expected]]), cache=cache)[0, -1]
    return smallest


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
