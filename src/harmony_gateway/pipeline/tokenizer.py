"""Tokenizers of non-Harmony models: loaded once per model and cached in `GatewayState.tokenizers`.

Sources, first that applies: the folder given with `--tokenizer MODEL=DIR`; the engine's reported
`tokenizer_path` when it is a folder on this host; the engine's `GetTokenizer` RPC (SGLang gRPC: a zip
of the tokenizer files streamed in chunks, the SHA-256 on the last one). A folder (or zip) holds
`tokenizer.json` (HF `tokenizers`) and `tokenizer_config.json` (`chat_template`, `bos_token`,
`eos_token`); a `chat_template.jinja` or `chat_template.json` file beside them wins, as in transformers.

Loading parses a multi-megabyte JSON file, so it runs in a worker thread; concurrent first requests for
a model share one load. A failure is not cached: the next request tries again. Raises `UpstreamError`
when no source is available or the files are unusable (a deployment problem, not the client's).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from ..errors import UpstreamError
from .context import GatewayState

if TYPE_CHECKING:
    from tokenizers import Tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json")


def _token_content(value: Any) -> str | None:
    """`bos_token` / `eos_token` are strings or serialised AddedTokens (`{"content": ...}`)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


@dataclass(eq=False)
class ModelTokenizer:
    """A model's tokenizer and chat template. `chat_template` is one template, or named templates
    (`{"default": ..., "tool_use": ...}`) as transformers allows."""

    tokenizer: Tokenizer
    chat_template: str | dict[str, str] | None
    bos_token: str | None = None
    eos_token: str | None = None
    source: str = ""
    _token_texts: dict[int, str] = field(default_factory=dict)
    #: Compiled templates, by name (filled by `pipeline.chat_template`).
    compiled: dict[str, Any] = field(default_factory=dict)

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.token_to_id(self.eos_token) if self.eos_token else None

    def encode(self, text: str) -> list[int]:
        """Ids of a rendered prompt; the template already placed any special tokens."""
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ids

    def token_text(self, token_id: int) -> str:
        """One token's text (for logprobs), special tokens included; cached per id."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_texts) < 65536:
                self._token_texts[token_id] = text
        return text


def tokenizer_from_files(files: Mapping[str, bytes], source: str) -> ModelTokenizer:
    """Build a `ModelTokenizer` from file contents by base name (`TOKENIZER_FILES`)."""
    if "tokenizer.json" not in files:
        raise UpstreamError(f"no tokenizer.json in {source}")
    try:
        from tokenizers import Tokenizer  # only models served with a chat template need it

        tokenizer = Tokenizer.from_str(files["tokenizer.json"].decode())
    except Exception as exc:
        raise UpstreamError(f"tokenizer.json in {source} cannot be loaded: {exc}") from exc
    config: dict[str, Any] = {}
    if "tokenizer_config.json" in files:
        try:
            config = json.loads(files["tokenizer_config.json"])
        except ValueError as exc:
            raise UpstreamError(f"tokenizer_config.json in {source} is not JSON: {exc}") from exc
    template: Any = config.get("chat_template")
    if "chat_template.jinja" in files:
        template = files["chat_template.jinja"].decode()
    elif "chat_template.json" in files:
        try:
            template = json.loads(files["chat_template.json"]).get("chat_template", template)
        except ValueError as exc:
            raise UpstreamError(f"chat_template.json in {source} is not JSON: {exc}") from exc
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
        template = {t["name"]: t["template"] for t in template if isinstance(t, dict) and "name" in t}
    return ModelTokenizer(
        tokenizer=tokenizer,
        chat_template=template,
        bos_token=_token_content(config.get("bos_token")),
        eos_token=_token_content(config.get("eos_token")),
        source=source,
    )


def load_folder(folder: str | os.PathLike[str]) -> ModelTokenizer:
    path = Path(folder)
    if not path.is_dir():
        raise UpstreamError(f"tokenizer folder {str(path)!r} does not exist")
    files = {name: (path / name).read_bytes() for name in TOKENIZER_FILES if (path / name).is_file()}
    return tokenizer_from_files(files, str(path))


def load_zip(data: bytes, source: str) -> ModelTokenizer:
    """Tokenizer files from a zip (any folder depth; the shallowest copy of each file wins)."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile as exc:
        raise UpstreamError(f"the tokenizer sent by {source} is not a zip archive") from exc
    files: dict[str, bytes] = {}
    depth: dict[str, int] = {}
    with archive:
        for info in archive.infolist():
            name = info.filename.rsplit("/", 1)[-1]
            level = info.filename.count("/")
            if name in TOKENIZER_FILES and level < depth.get(name, 1 << 30):
                files[name] = archive.read(info)
                depth[name] = level
    return tokenizer_from_files(files, source)


async def _load(state: GatewayState, group: Any) -> ModelTokenizer:
    name = group.name
    folder = state.settings.tokenizer_paths.get(name)
    if folder:
        return await anyio.to_thread.run_sync(load_folder, folder)
    reported = getattr(group.info, "tokenizer_path", "")
    if reported and await anyio.to_thread.run_sync(os.path.isdir, reported):
        return await anyio.to_thread.run_sync(load_folder, reported)
    errors = []
    for worker in group.workers:
        if not worker.client.capabilities.tokenizer:
            continue
        try:
            data = await worker.client.get_tokenizer(timeout=state.settings.timeouts.connect * 6)
        except UpstreamError as exc:
            errors.append(exc.message)
            continue
        return await anyio.to_thread.run_sync(load_zip, data, worker.public_url)
    detail = f" ({'; '.join(errors)})" if errors else ""
    raise UpstreamError(
        f"no tokenizer for model {name!r}: pass --tokenizer {name}=DIR, or serve it from an engine "
        f"that implements GetTokenizer{detail}"
    )


async def model_tokenizer(state: GatewayState, group: Any) -> ModelTokenizer:
    """The model's tokenizer, loaded on first use (see the module docstring)."""
    cached = state.tokenizers.get(group.name)
    if isinstance(cached, ModelTokenizer):
        return cached
    if cached is None:
        cached = asyncio.ensure_future(_load(state, group))
        state.tokenizers[group.name] = cached
    try:
        result: ModelTokenizer = await asyncio.shield(cached)
    except BaseException:
        if cached.done() and state.tokenizers.get(group.name) is cached:
            del state.tokenizers[group.name]  # retry on the next request
        raise
    state.tokenizers[group.name] = result
    return result


__all__ = [
    "TOKENIZER_FILES",
    "ModelTokenizer",
    "load_folder",
    "load_zip",
    "model_tokenizer",
    "tokenizer_from_files",
]
