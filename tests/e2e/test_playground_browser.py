"""The playground in a real browser: Debian's Chromium, headless, driven by Playwright against a gateway
on the simulated engine over loopback. The engine is paced, so a turn is observed mid-stream (reasoning
shown, answer not yet) by waiting on DOM conditions, never by sleeping. Each test saves a screenshot
under test-artifacts/playground/."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest
from openai_harmony import Conversation, Message, ReasoningEffort, Role, SystemContent
from playwright.async_api import Browser, Locator, Page, async_playwright, expect

from harmony_gateway.harmony.encoding import get_encoding
from harmony_gateway.sim import RunningSim, SimConfig, start_sim_engine
from tests.conftest import MODEL
from tests.mcp.servers import build_docs_server, serve_mcp
from tests.support.servers import TEST_DATE, RunningGateway, running_gateway, test_settings, wait_until

CHROMIUM = os.environ.get("CHROMIUM_PATH") or shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "playground"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
KEY = "playground-key"
WEATHER = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
]

pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason=f"Chromium not found at {CHROMIUM}: `make test` installs it"
)


@pytest.fixture(scope="module")
async def paced_sim() -> AsyncIterator[RunningSim]:
    # ~400 analysis tokens for [[long]] at 150 tokens/s: the reasoning streams for seconds before the
    # answer starts, so the intermediate state is observable with a wide margin.
    engine = await start_sim_engine(SimConfig(port=0, model=MODEL, tokens_per_second=150.0))
    try:
        yield engine
    finally:
        await engine.stop()


@pytest.fixture(scope="module")
async def open_gateway(paced_sim: RunningSim) -> AsyncIterator[RunningGateway]:
    async with running_gateway(test_settings(worker_urls=(paced_sim.url,))) as gw:
        yield gw


@pytest.fixture(scope="module")
async def keyed_gateway(paced_sim: RunningSim) -> AsyncIterator[RunningGateway]:
    settings = test_settings(worker_urls=(paced_sim.url,), api_keys=frozenset({KEY}))
    async with running_gateway(settings) as gw:
        yield gw


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as p:
        launched = await p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            await launched.close()


@pytest.fixture
async def page(browser: Browser, request: pytest.FixtureRequest) -> AsyncIterator[Page]:
    context = await browser.new_context(viewport={"width": 1400, "height": 900})
    opened = await context.new_page()
    try:
        yield opened
    finally:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        name = request.node.name.replace("[", "-").replace("]", "").replace("/", "_")
        try:
            await opened.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)
        finally:
            await context.close()


async def open_playground(page: Page, gateway: RunningGateway) -> None:
    await page.goto(gateway.url + "/")
    await expect(page.get_by_label("Model")).to_have_value(MODEL)


def region(page: Page, name: str) -> Locator:
    return page.get_by_role("region", name=name, exact=True)


async def test_reasoning_then_answer_stream_into_their_panes(
    page: Page, open_gateway: RunningGateway
) -> None:
    await open_playground(page, open_gateway)
    message = page.get_by_role("textbox", name="Message")
    await message.fill("Explain this [[long]] please")
    await message.press("Enter")  # the keyboard alone sends
    # Mid-stream: reasoning has arrived, the answer has not, the turn is still streaming.
    await page.wait_for_function(
        """() => {
            const text = (name) => document.querySelector(`[aria-label="${name}"] [data-body]`).textContent;
            return text("Reasoning").length > 40 && text("Answer") === ""
                && document.body.dataset.streaming === "true";
        }"""
    )
    await expect(page.get_by_role("status", name="Turn status")).to_have_text("Streaming…")
    await expect(region(page, "Reasoning")).to_contain_text("The user wrote")
    await expect(region(page, "Answer")).to_contain_text(
        'You said: "Explain this please". This is a simulated answer.', timeout=20_000
    )
    await expect(page.get_by_role("status", name="Turn status")).to_have_text("Done (stop)")
    stats = page.get_by_label("Turn statistics")
    for name in ("Time to first token", "Tokens per second", "Prompt tokens", "Reasoning tokens", "Worker"):
        await expect(stats).to_contain_text(name)
    worker = open_gateway.state.fleet.all_workers()[0].id
    await expect(stats.locator('[data-stat="Worker"]')).to_have_text(worker)
    await expect(stats.locator('[data-stat="Finish reason"]')).to_have_text("stop")
    await expect(page.get_by_role("log", name="Conversation")).to_contain_text("Explain this [[long]] please")


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_a_function_call_round_trip_through_the_tools_editor(
    page: Page, open_gateway: RunningGateway, api: str
) -> None:
    await open_playground(page, open_gateway)
    await page.get_by_label("API", exact=True).select_option(api)
    await page.get_by_label("Tools editor (JSON)").fill(json.dumps(WEATHER))
    await page.get_by_role("textbox", name="Message").fill("Use get_weather for Paris")
    await page.get_by_role("button", name="Send", exact=True).click()
    calls = region(page, "Tool calls")
    await expect(calls).to_contain_text("function get_weather")
    await expect(calls).to_contain_text('{"city":"Paris"}')
    result = page.get_by_label('Result of get_weather({"city":"Paris"})')
    await result.fill("18C and sunny")
    await page.get_by_role("button", name="Send tool results").click()
    await expect(region(page, "Answer")).to_contain_text(
        'The tool functions.get_weather returned: "18C and sunny".', timeout=20_000
    )
    await expect(page.get_by_role("status", name="Turn status")).to_have_text(
        "Done (stop)" if api == "chat" else "Done (completed)"
    )
    if api == "responses":
        # The continuation was chained to the call's response, and the chain is what the page holds.
        previous = await page.locator("#previous-id").text_content()
        assert previous and previous.startswith("resp_")
        stored = open_gateway.state.store
        record = await stored.get_response(previous, "")
        assert record is not None and record.response.get("previous_response_id")


async def test_a_wrong_key_is_a_readable_401(page: Page, keyed_gateway: RunningGateway) -> None:
    await page.goto(keyed_gateway.url + "/playground")
    key = page.get_by_label("API key")
    await expect(key).to_be_visible()  # keys are configured: the page asks for one
    await expect(page.get_by_role("alert")).to_contain_text("401")
    await key.fill(KEY)
    await key.press("Tab")
    await expect(page.get_by_label("Model")).to_have_value(MODEL)
    await expect(page.get_by_role("alert")).to_be_hidden()
    assert await page.evaluate("() => Object.keys(localStorage).length") == 0
    await key.fill("not-the-key")
    await key.press("Tab")
    await page.get_by_role("textbox", name="Message").fill("Hello")
    await page.get_by_role("textbox", name="Message").press("Enter")
    alert = page.get_by_role("alert")
    await expect(alert).to_contain_text("401: Incorrect or missing API key")
    await expect(region(page, "Answer")).to_contain_text("No answer: 401")
    await expect(page.get_by_role("status", name="Turn status")).to_have_text("Failed")
    stored = await page.evaluate("() => sessionStorage.getItem('harmony-gateway.api-key')")
    assert stored == "not-the-key"


async def test_without_a_key_the_page_asks_for_one_and_send_says_why(
    page: Page, keyed_gateway: RunningGateway
) -> None:
    """A gateway with keys and a page without one (or with a wrong one): the page says a key is needed
    and offers the field, Send says the same (401) and moves to the field, and once the key is in, the
    message typed before is sent. The page asks for nothing that is not there (no 404, favicon included)."""
    missing: list[str] = []
    page.on("response", lambda r: missing.append(r.url) if r.status == 404 else None)
    await page.goto(keyed_gateway.url + "/")
    alert = page.get_by_role("alert")
    key = page.get_by_label("API key")
    await expect(key).to_be_visible()
    await expect(alert).to_contain_text("401: The gateway needs an API key")
    message = page.get_by_role("textbox", name="Message")
    await message.fill("Hello there")
    send = page.get_by_role("button", name="Send", exact=True)
    await send.click()
    await expect(alert).to_contain_text("401: The gateway needs an API key")
    await expect(alert).not_to_contain_text("No model")
    await expect(key).to_be_focused()
    await expect(message).to_have_value("Hello there")  # kept until it can be sent
    await key.fill("not-the-key")
    await key.press("Enter")
    await expect(alert).to_contain_text("401: The gateway refused this API key")
    await send.click()
    await expect(alert).to_contain_text("401: The gateway refused this API key")
    await expect(key).to_be_focused()
    await key.fill(KEY)
    await key.press("Enter")
    await expect(page.get_by_label("Model")).to_have_value(MODEL)
    await expect(alert).to_be_hidden()
    await send.click()
    await expect(region(page, "Answer")).to_contain_text(
        'You said: "Hello there". This is a simulated answer.', timeout=20_000
    )
    assert missing == []


async def test_show_prompt_token_ids_are_openai_harmonys_rendering(
    page: Page, open_gateway: RunningGateway
) -> None:
    await open_playground(page, open_gateway)
    await page.get_by_label("Reasoning effort").select_option("low")
    await page.get_by_role("textbox", name="Message").fill("What is 2+2?")
    await page.get_by_role("textbox", name="Message").press("Enter")
    await expect(page.get_by_role("status", name="Turn status")).to_have_text("Done (stop)", timeout=20_000)
    await page.get_by_role("button", name="Show prompt", exact=True).click()
    prompt = page.get_by_role("region", name="Prompt")
    await expect(prompt).to_be_visible()
    ids_text = await page.locator("#prompt-ids").text_content()
    shown = [int(x) for x in (ids_text or "").split(",")]
    system = SystemContent.new().with_reasoning_effort(ReasoningEffort.LOW)
    conversation = Conversation.from_messages(
        [
            Message.from_role_and_content(Role.SYSTEM, system.with_conversation_start_date(TEST_DATE)),
            Message.from_role_and_content(Role.USER, "What is 2+2?"),
        ]
    )
    expected = get_encoding().render_conversation_for_completion(conversation, Role.ASSISTANT)
    assert shown == expected
    tokens = page.locator("#prompt-text span")
    assert [int(x) for x in await tokens.evaluate_all("spans => spans.map(s => s.dataset.id)")] == expected
    start = page.locator("#prompt-text span.special").first
    await expect(start).to_have_text("<|start|>")
    await expect(start).to_have_attribute("title", "token 200006")
    await expect(prompt).to_contain_text("round_robin")
    await expect(prompt).not_to_contain_text("would pick")  # the worker choice is for admins
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    await page.screenshot(path=str(ARTIFACTS / "show-prompt-dialog.png"))
    await page.keyboard.press("Escape")
    await expect(prompt).to_be_hidden()

    # A second turn: each turn in the conversation shows the prompt it was sent.
    await page.get_by_role("textbox", name="Message").fill("And 3+3?")
    await page.get_by_role("textbox", name="Message").press("Enter")
    await expect(page.get_by_role("status", name="Turn status")).to_have_text("Done (stop)", timeout=20_000)
    answer = 'You said: "What is 2+2?". This is a simulated answer.'
    second = get_encoding().render_conversation_for_completion(
        Conversation.from_messages(
            [
                *conversation.messages,
                Message.from_role_and_content(Role.ASSISTANT, answer).with_channel("final"),
                Message.from_role_and_content(Role.USER, "And 3+3?"),
            ]
        ),
        Role.ASSISTANT,
    )
    for button, ids in (("Show prompt of turn 1", expected), ("Show prompt of turn 2", second)):
        await page.get_by_role("button", name=button).click()
        await expect(prompt).to_be_visible()
        await expect(page.locator("#prompt-ids")).to_have_text(", ".join(map(str, ids)))
        await page.get_by_role("button", name="Close").click()
        await expect(prompt).to_be_hidden()


async def test_a_mid_stream_error_is_a_readable_message(
    page: Page, open_gateway: RunningGateway, paced_sim: RunningSim
) -> None:
    await open_playground(page, open_gateway)
    paced_sim.fail_next(grpc.StatusCode.INTERNAL, after_tokens=4)
    message = page.get_by_role("textbox", name="Message")
    await message.fill("This turn breaks")
    await message.press("Enter")
    alert = page.get_by_role("alert")
    await expect(alert).to_contain_text("Stream error:")
    await expect(page.get_by_role("status", name="Turn status")).to_have_text("Failed")
    # What arrived before the error stays; the answer pane says why it is empty.
    await expect(region(page, "Reasoning")).not_to_be_empty()
    await expect(region(page, "Answer")).to_contain_text("No answer: Stream error:")


async def test_mcp_calls_show_their_output(page: Page, paced_sim: RunningSim) -> None:
    async with (
        serve_mcp(build_docs_server([])) as docs,
        running_gateway(test_settings(worker_urls=(paced_sim.url,), mcp_allow_hosts=("127.0.0.1",))) as gw,
    ):
        await open_playground(page, gw)
        await page.get_by_label("API", exact=True).select_option("responses")
        server = {"type": "mcp", "server_label": "docs", "server_url": docs.url, "require_approval": "never"}
        await page.get_by_label("Tools editor (JSON)").fill(json.dumps([server]))
        await page.get_by_role("textbox", name="Message").fill("Please search_docs for harmony")
        await page.get_by_role("textbox", name="Message").press("Enter")
        calls = region(page, "Tool calls")
        await expect(calls).to_contain_text("MCP docs: list tools")
        await expect(calls).to_contain_text("MCP docs.search_docs")
        await expect(calls).to_contain_text('{"query":"harmony"}')
        await expect(calls).to_contain_text("→ Docs result for harmony: the answer is 42.")
        await expect(region(page, "Answer")).to_contain_text("Docs result for harmony", timeout=20_000)
        await expect(page.get_by_role("status", name="Turn status")).to_have_text("Done (completed)")


async def test_open_a_stored_response_and_continue_it(
    page: Page, open_gateway: RunningGateway, paced_sim: RunningSim
) -> None:
    async with httpx.AsyncClient(base_url=open_gateway.url, timeout=30) as http:
        stored = await http.post("/v1/responses", json={"model": MODEL, "input": "Remember the word kiwi"})
    first = stored.json()["id"]
    await open_playground(page, open_gateway)
    await page.get_by_label("Response id", exact=True).fill(first)
    await page.get_by_label("Response id", exact=True).press("Enter")
    transcript = page.get_by_role("log", name="Conversation")
    await expect(transcript).to_contain_text("Remember the word kiwi")
    await expect(transcript).to_contain_text('You said: "Remember the word kiwi"')
    await expect(page.get_by_label("API", exact=True)).to_have_value("responses")
    await page.get_by_role("textbox", name="Message").fill("Which word was it?")
    await page.get_by_role("textbox", name="Message").press("Enter")
    await expect(page.get_by_role("status", name="Turn status")).to_have_text(
        "Done (completed)", timeout=20_000
    )
    latest = await page.get_by_label("Last response id").text_content()
    assert latest and latest != first
    async with httpx.AsyncClient(base_url=open_gateway.url, timeout=30) as http:
        chained = (await http.get(f"/v1/responses/{latest}")).json()
    assert chained["previous_response_id"] == first
    prompt = get_encoding().decode(paced_sim.requests[-1].input_ids)
    assert "Remember the word kiwi" in prompt and prompt.endswith(
        "<|start|>user<|message|>Which word was it?<|end|><|start|>assistant"
    )


async def test_no_healthy_worker_is_a_readable_503(page: Page) -> None:
    async with (
        await start_sim_engine(SimConfig(port=0, model=MODEL)) as engine,
        running_gateway(test_settings(worker_urls=(engine.url,), health_failure_threshold=1)) as gw,
    ):
        await open_playground(page, gw)
        await engine.set_healthy(False)
        worker = gw.state.fleet.all_workers()[0]
        await wait_until(lambda: not worker.healthy)
        await page.get_by_role("textbox", name="Message").fill("Anyone there?")
        await page.get_by_role("textbox", name="Message").press("Enter")
        await expect(page.get_by_role("alert")).to_contain_text("503:")
        await expect(page.get_by_role("alert")).to_contain_text("No engine is available")
        await expect(region(page, "Answer")).to_contain_text("No answer: 503")
