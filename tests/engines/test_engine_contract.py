"""Every gRPC engine client in the registry against its simulated protocol, through the real gateway.

The same checks for each engine (`GRPC_ENGINES`): auto-detection, Chat stream and non-stream agreeing,
the stop ids the wire needs, capabilities refused as a 400 naming the parameter, prompts that must never
reach an engine, an aborted request that ends the engine's stream, and the tokenizer sent by the worker.
"""

from __future__ import annotations

import asyncio
import io
import zipfile
from pathlib import Path

import openai
import pytest

from harmony_gateway.engines.base import GenerateRequest, SamplingOptions
from harmony_gateway.engines.registry import GRPC_ENGINES, create_client
from harmony_gateway.errors import InvalidRequest, UpstreamError
from harmony_gateway.sim import SimConfig, start_sim_engine
from tests.conftest import MODEL
from tests.support.servers import running_gateway
from tests.support.servers import test_settings as gateway_settings
from tests.support.tiny_tokenizer import eos_id, write_tokenizer_folder

ENGINES = [name for name in GRPC_ENGINES if name != "auto"]
RETURN, CALL = 200002, 200012


@pytest.mark.parametrize("engine", ENGINES)
async def test_chat_through_each_engine_detected_automatically(engine: str) -> None:
    async with await start_sim_engine(SimConfig(engine=engine, model=MODEL)) as sim:  # type: ignore[arg-type]
        settings = gateway_settings(worker_urls=(sim.url,), engine="auto")
        async with (
            running_gateway(settings) as gw,
            openai.AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0, timeout=30) as client,
        ):
            assert [w.engine for w in gw.state.fleet.all_workers()] == [engine]
            messages = [{"role": "user", "content": "What is 2+2?"}]
            whole = await client.chat.completions.create(model=MODEL, messages=messages, temperature=0)  # type: ignore[arg-type]
            assert "simulated answer" in (whole.choices[0].message.content or "")
            assert whole.choices[0].finish_reason == "stop"
            text = ""
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=messages,
                stream=True,
                temperature=0,  # type: ignore[arg-type]
            )
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
            assert text == whole.choices[0].message.content
            sent = sim.requests[-1].sampling
            stop_ids = {int(t) for t in sent["stop_token_ids"]}
            assert {RETURN, CALL} <= stop_ids  # <|call|> must stop a tool call on every wire
            if engine == "mlx":
                assert float(sent["temperature"]) == 0.0 or "temperature" in sent
                assert int(sent["max_tokens"]) > 0  # unset would mean the whole context
            if engine == "trtllm":
                assert sent["include_stop_token_in_output"] is True
                assert int(sent["max_tokens"]) > 0


async def test_mlx_refuses_what_it_cannot_do_with_a_400_naming_the_param() -> None:
    async with await start_sim_engine(SimConfig(engine="mlx", model=MODEL)) as sim:
        settings = gateway_settings(worker_urls=(sim.url,), engine="mlx")
        async with (
            running_gateway(settings) as gw,
            openai.AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0, timeout=30) as client,
        ):
            messages = [{"role": "user", "content": "What is 2+2?"}]
            tool = {
                "type": "function",
                "function": {"name": "add", "parameters": {"type": "object", "properties": {}}},
            }
            schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}
            cases = [
                ("n", {"n": 2}),
                ("tool_choice", {"tools": [tool], "tool_choice": "required"}),
                (
                    "tool_choice",
                    {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "add"}}},
                ),
                ("response_format", {"response_format": schema}),
            ]
            for param, extra in cases:
                with pytest.raises(openai.BadRequestError) as caught:
                    await client.chat.completions.create(model=MODEL, messages=messages, **extra)  # type: ignore[arg-type, call-overload]
                assert caught.value.body["param"] == param, extra  # type: ignore[index]
                assert "mlx" in caught.value.body["message"]  # type: ignore[index]
            with pytest.raises(openai.BadRequestError) as caught:
                await client.responses.create(
                    model=MODEL,
                    input="hi",
                    text={"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}},
                )
            assert caught.value.body["param"] == "text.format"  # type: ignore[index]
            assert sim.requests == []  # none of them reached the engine
            # What the engine can do still works: tools declared but not forced.
            ok = await client.chat.completions.create(model=MODEL, messages=messages, tools=[tool])  # type: ignore[arg-type, list-item]
            assert ok.choices[0].finish_reason in ("stop", "tool_calls")


@pytest.mark.parametrize("engine", ENGINES)
async def test_empty_and_out_of_vocabulary_prompts_never_reach_the_engine(engine: str) -> None:
    async with await start_sim_engine(SimConfig(engine=engine, model=MODEL)) as sim:  # type: ignore[arg-type]
        client = create_client(sim.url, engine)
        try:
            await client.model_info(timeout=5)
            for ids, needle in (([], "empty"), ([1, 2, 201088], "201088")):
                request = GenerateRequest("r-" + needle, ids, SamplingOptions(max_new_tokens=4))
                with pytest.raises(InvalidRequest) as caught:
                    async for _ in client.generate(request):
                        pass
                assert caught.value.param == "prompt" and needle in caught.value.message
            assert sim.requests == []
        finally:
            await client.close()


@pytest.mark.parametrize("engine", ENGINES)
async def test_an_aborted_request_ends_the_stream_with_an_error_never_a_hang(engine: str) -> None:
    config = SimConfig(engine=engine, model=MODEL, tokens_per_second=50)  # type: ignore[arg-type]
    async with await start_sim_engine(config) as sim:
        client = create_client(sim.url, engine)
        try:
            await client.model_info(timeout=5)
            request = GenerateRequest(
                "abort-me", [200006, 1428, 200008, 12194, 200007], SamplingOptions(max_new_tokens=500)
            )
            seen: list[int] = []
            finished: list[str | None] = []

            async def consume() -> None:
                async for chunk in client.generate(request):
                    seen.extend(chunk.token_ids)
                    if chunk.finished:
                        finished.append(chunk.finish_reason)
                    if len(seen) == 2:
                        await client.abort("abort-me")

            if engine == "mlx":
                # The MLX servicer ends an aborted RPC with status OK and no Complete: an error, not an answer.
                with pytest.raises(UpstreamError, match="aborted"):
                    await asyncio.wait_for(consume(), 10)
            else:
                await asyncio.wait_for(consume(), 10)
                assert finished and finished[-1] in ("abort", "cancelled")
            assert "abort-me" in sim.aborted
        finally:
            await client.close()


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_non_harmony_model_needs_no_local_tokenizer(engine: str, tmp_path: Path) -> None:
    """The worker's GetTokenizer sends the tokenizer as a zip (checked by SHA-256), client and gateway."""
    folder = write_tokenizer_folder(tmp_path / "tok")
    answer = "Hello from the engine."
    config = SimConfig(
        engine=engine,  # type: ignore[arg-type]
        model="tiny-chat",
        harmony=False,
        tokenizer_path=str(folder),
        replies=(("", answer),),
        eos_token_id=eos_id(folder),
    )
    async with await start_sim_engine(config) as sim:
        client = create_client(sim.url, "auto")
        try:
            await client.model_info(timeout=5)
            assert client.capabilities.tokenizer
            data = await client.get_tokenizer(timeout=10)
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                assert archive.read("tokenizer.json") == (folder / "tokenizer.json").read_bytes()
        finally:
            await client.close()
        async with (
            running_gateway(gateway_settings(worker_urls=(sim.url,), engine="auto")) as gw,
            openai.AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0, timeout=30) as oai,
        ):
            r = await oai.chat.completions.create(
                model="tiny-chat", messages=[{"role": "user", "content": "Hi"}]
            )
            assert r.choices[0].message.content == answer
            assert gw.state.tokenizers["tiny-chat"].source == sim.url
