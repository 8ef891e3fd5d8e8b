"""Tracing end to end: a real OTLP/HTTP receiver on loopback gets the request's spans, the client's
trace continues, and the engine saw the trace context in its gRPC metadata."""

from __future__ import annotations

import os

import httpx
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.conftest import MODEL
from tests.traffic._support import chat_body, sim_and_gateway, until


class OtlpReceiver:
    """The collector's trace Export service over OTLP/HTTP (protobuf), recording every span."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, str, str]] = []  # (trace id, span id, parent id, name)
        self.attributes: dict[str, dict[str, str]] = {}  # span id → string attributes
        self.runner: web.AppRunner | None = None

    async def _export(self, request: web.Request) -> web.Response:
        message = ExportTraceServiceRequest.FromString(await request.read())
        for resource in message.resource_spans:
            for scope in resource.scope_spans:
                for span in scope.spans:
                    self.spans.append(
                        (span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(), span.name)
                    )
                    self.attributes[span.span_id.hex()] = {
                        kv.key: kv.value.string_value for kv in span.attributes
                    }
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(), content_type="application/x-protobuf"
        )

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/traces", self._export)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


async def test_spans_reach_the_collector_and_the_engine_sees_the_trace() -> None:
    receiver = OtlpReceiver()
    endpoint = await receiver.start()
    trace_id = os.urandom(16).hex()
    parent_id = os.urandom(8).hex()
    try:
        async with sim_and_gateway(otlp_endpoint=endpoint) as (sim, gw):
            async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
                r = await http.post(
                    "/v1/chat/completions",
                    json=chat_body(),
                    headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
                )
                assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
                other = await http.post("/v1/chat/completions", json=chat_body(stream=False))
                assert other.status_code == 200
            # The request's own span too: it ends, and is exported, after the stages' spans.
            wanted = {
                "POST /v1/chat/completions",
                "gateway.prepare",
                "gateway.route",
                "gateway.engine",
                "gateway.stream",
            }

            def ours() -> list[tuple[str, str, str, str]]:
                return [s for s in receiver.spans if s[0] == trace_id]

            await until(lambda: wanted <= {s[3] for s in ours()})
            root = next(s for s in ours() if s[3] == "POST /v1/chat/completions")
            assert root[2] == parent_id  # the client's span is the parent: its trace continues
            # No prompt text in any span without --log-prompts.
            assert not any(k.startswith("gateway.prompt") for a in receiver.attributes.values() for k in a)
            assert "Hello there" not in str(receiver.attributes)
            by_id = {s[1]: s for s in ours()}
            for span in ours():
                if span is not root:
                    # Every stage span descends from the request's span.
                    ancestor = span
                    while ancestor[2] != parent_id:
                        ancestor = by_id[ancestor[2]]
                    assert ancestor is root
            engine_span = next(s for s in ours() if s[3] == "gateway.engine")
            traced_call = sim.requests[0].metadata["traceparent"]
            assert traced_call.split("-")[1] == trace_id
            assert traced_call.split("-")[2] == engine_span[1]
            # Storage operations of a stored response are spans of its request's trace.
            stored_trace = os.urandom(16).hex()
            async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
                r = await http.post(
                    "/v1/responses",
                    json={"model": MODEL, "input": "hi", "store": True},
                    headers={"traceparent": f"00-{stored_trace}-{parent_id}-01"},
                )
                assert r.status_code == 200
            await until(
                lambda: any(
                    s[0] == stored_trace and s[3].startswith("gateway.storage.") for s in receiver.spans
                )
            )
            # A request without a traceparent starts a trace of its own.
            await until(lambda: len({s[0] for s in receiver.spans if s[3].startswith("POST ")}) == 3)
            assert sim.requests[1].metadata["traceparent"].split("-")[1] != trace_id
    finally:
        await receiver.stop()


async def test_mcp_calls_are_spans_of_the_request() -> None:
    from tests.mcp.servers import build_docs_server, serve_mcp

    receiver = OtlpReceiver()
    endpoint = await receiver.start()
    trace_id = os.urandom(16).hex()
    try:
        async with serve_mcp(build_docs_server([])) as docs:
            async with sim_and_gateway(
                otlp_endpoint=endpoint, mcp_allow_hosts=("127.0.0.1",), log_prompts=True
            ) as (_, gw):
                async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
                    tool = {
                        "type": "mcp",
                        "server_label": "docs",
                        "server_url": docs.url,
                        "require_approval": "never",
                    }
                    r = await http.post(
                        "/v1/responses",
                        json={"model": MODEL, "input": "Please search_docs for harmony", "tools": [tool]},
                        headers={"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"},
                    )
                    assert r.status_code == 200 and r.json()["status"] == "completed"

                def names() -> list[str]:
                    return [s[3] for s in receiver.spans if s[0] == trace_id]

                # The tool call, between the engine calls of the two model turns (before and after it),
                # and the request's own span, which ends (and is exported) after the response was sent.
                await until(
                    lambda: (
                        "gateway.mcp.call" in names()
                        and names().count("gateway.engine") == 2
                        and "POST /v1/responses" in names()
                    )
                )
                # With --log-prompts the request's span carries the prompt fields.
                root = next(s for s in receiver.spans if s[0] == trace_id and s[3] == "POST /v1/responses")
                assert (
                    receiver.attributes[root[1]]["gateway.prompt.input"] == '"Please search_docs for harmony"'
                )
    finally:
        await receiver.stop()
