"""Tokenizers of non-Harmony models, loaded once per model and kept in `GatewayState.tokenizers`;
concurrent first requests share one load."""

from __future__ import annotations

import asyncio
import os

import anyio

from ..errors import UpstreamError
from ..routing.fleet import ModelGroup
from .context import GatewayState
from .tokenizer import ModelTokenizer, load_folder, load_zip


async def _load(state: GatewayState, group: ModelGroup) -> ModelTokenizer:
    name = group.name
    # `--tokenizer DIR` without a model ("*") serves every model without a folder of its own.
    folder = state.settings.tokenizer_paths.get(name) or state.settings.tokenizer_paths.get("*")
    if folder:
        return await anyio.to_thread.run_sync(load_folder, folder)
    reported = group.info.tokenizer_path
    if reported != "" and await anyio.to_thread.run_sync(os.path.isdir, reported):
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


async def _load_and_keep(state: GatewayState, group: ModelGroup) -> ModelTokenizer:
    try:
        tokenizer = state.tokenizers[group.name] = await _load(state, group)
        return tokenizer
    finally:
        del state.tokenizer_loads[group.name]  # a failure is not kept: the next request tries again


async def model_tokenizer(state: GatewayState, group: ModelGroup) -> ModelTokenizer:
    """The model's tokenizer, loaded on first use (see the module docstring)."""
    cached = state.tokenizers.get(group.name)
    if cached is not None:
        return cached
    loading = state.tokenizer_loads.get(group.name)
    if loading is None:
        # A task of the app's: concurrent first requests share it, and it is finished (and kept)
        # even when they have all left.
        loading = state.tasks.spawn(
            _load_and_keep(state, group), name=f"tokenizer-{group.name}", awaited=True
        )
        state.tokenizer_loads[group.name] = loading
    return await asyncio.shield(loading)


__all__ = ["model_tokenizer"]
