"""`harmony-gateway serve --demo` (what `make demo` runs) prints the playground's address first, and the
address serves the page, which loads its own files only, and the favicon browsers ask for."""

from __future__ import annotations

import asyncio
import contextlib
import sys

import httpx

from tests.support.processes import free_port


async def test_demo_prints_the_playground_address_first_and_serves_it() -> None:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "harmony_gateway.cli",
        "serve",
        "--demo",
        "--port",
        str(port),
        "--storage",
        "memory://",
        "--log-level",
        "warning",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        assert proc.stdout is not None
        first = b""
        while not first.strip():
            first = await asyncio.wait_for(proc.stdout.readline(), 30)
        url = f"http://127.0.0.1:{port}/"
        assert first.decode().startswith(f"Playground: {url}")
        async with httpx.AsyncClient(timeout=5) as client:
            page = None
            for _ in range(300):  # the address is printed as the server starts listening
                with contextlib.suppress(httpx.TransportError):
                    page = await client.get(url)
                    break
                await asyncio.sleep(0.1)
            assert page is not None and page.status_code == 200
            assert page.headers["content-type"].startswith("text/html")
            assert "default-src 'self'" in page.headers["content-security-policy"]
            assert '<textarea id="message"' in page.text
            for asset in ("playground.js", "playground.css"):
                assert asset in page.text
                assert (await client.get(f"{url}playground/static/{asset}")).status_code == 200
            icon = await client.get(f"{url}favicon.ico")
            assert icon.status_code == 200 and icon.headers["content-type"] == "image/x-icon"
            assert icon.content[:4] == b"\x00\x00\x01\x00"  # an ICO file, with one PNG image:
            assert icon.content[22:30] == b"\x89PNG\r\n\x1a\n"
            assert '<link rel="icon" href="/favicon.ico">' in page.text
            missing = await client.get(f"{url}playground/static/..%2Fstatic%2Fplayground.html")
            assert missing.status_code == 404 and missing.json()["error"]["type"]
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        await asyncio.wait_for(proc.wait(), 15)
