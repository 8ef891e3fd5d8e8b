"""Routing on a cluster twin: replay one agentic trace over four twin engines under each routing policy.

    .venv/bin/python benchmarks/routing/run.py                 # the whole table, about 10 minutes
    .venv/bin/python benchmarks/routing/run.py --quick         # a smaller trace, 4 configurations, ~2 min
    .venv/bin/python benchmarks/routing/run.py --configs smg,kv_aware --rounds 2 --json-out r.jsonl
    .venv/bin/python benchmarks/routing/run.py --report r.jsonl    # the table again, medians per config
    .venv/bin/python benchmarks/routing/run.py --configs kv_aware \\
        --extra-config 'kv_dw256=kv_aware:1:--kv-decode-weight 256'

The fleet: four twin workers (`twin.py`: `harmony-gateway sim-engine` with a recorder), SGLang protocol,
16-token blocks, the timing model on (prefill 0.025 ms per uncached prompt token, so a 30k-token prompt
takes 0.75 s from cold; decode 10 ms per token plus 0.5 ms per request decoding; 16 requests running at
most), KV events published, 64-token answers. Their KV capacity is sized so that the four caches hold
`--cache-share` (40 %) of the trace's working set (the estimate of `agent_trace.Trace.working_set_tokens`;
the exact figure, the distinct blocks of every prompt and answer the twins received, is reported).

The trace (`agent_trace.py`): 48 sessions of 12 turns over four shared system/tool prompts of 3-6k
tokens, contexts growing to ~30k tokens, exponential think time (1.5 s mean) between turns, sessions
starting over 30 s; a quarter of the sessions hop between the two replicas on every turn when there are
two gateways. `replay.py` sends each turn as a streamed chat completion with usage.

For each configuration (and each round of `--rounds`), the twins and the gateways are started afresh
(cold caches), one short request per gateway warms it up, the trace is replayed, and everything is
stopped. Configurations (`--configs`, comma-separated):

| name | what |
|---|---|
| `round_robin`, `cache_aware`, `kv_aware` | `harmony-gateway serve --policy NAME`, one process |
| `cache_aware_x2`, `kv_aware_x2` | the same policy in two independent gateway processes (replicas) |
| `smg`, `smg_x2` | SMG (`smg launch --policy cache_aware`, which subscribes to the twins' KV events), one or two |

`--extra-config LABEL=POLICY:REPLICAS:ARGS` adds a configuration with extra gateway flags (POLICY `smg`
for SMG), e.g. tuned knobs.

Reported per configuration:
- `hit`: cached / prompt tokens summed over the successful turns, from the responses' usage
  (`prompt_tokens_details.cached_tokens`); `twin hit`: the same from the twins' own admissions (a
  cross-check: the gateway must pass the engine's count through);
- `oracle`: the hit rate of the offline oracle (`oracle.py`) on the same requests in the order they
  arrived: one instance of the twin's cache model per worker, each request routed to the cache holding
  its longest prefix; `hit/oracle` the ratio;
- `moves`: turns served by another worker than their session's turn before (sessions are identified by
  the `[session N turn T]` marker of each turn's message in the prompt ids the twins received; the
  oracle never moves a session whose cache survives);
- TTFT p50/p99 (first reasoning or answer delta, at the client), `p99/SMG` against SMG's with as many
  replicas, turns/s (successful turns over the replay's wall time), errors (failed turns and the turns
  their agents never sent);
- gateway CPU: user+system seconds of the gateway processes (all replicas, children included, psutil)
  over the replay, and per successful turn.

The gateways run from this checkout (`PYTHONPATH=<repo>/src`); SMG from `--smg` (default
`/tmp/benchvenv/bin/smg`) with the offline assets of `shared/bench/make_offline_assets.py` in
`--assets` (default `/tmp/benchassets`): `TIKTOKEN_ENCODINGS_BASE=<assets>/vocab`, `HF_HUB_OFFLINE=1`,
`--tokenizer-path <assets>/gpt-oss-tokenizer`; the twins then serve that folder over GetTokenizer, where
SMG looks for the served model's tokenizer. Without them the SMG rows are skipped.

On a shared 2-core machine the twins, the gateways and the client share the cores: read the numbers as a
comparison under equal conditions. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from agent_trace import Trace, TraceConfig, build_trace
from oracle import OracleResult, TwinNotes, moves, run_oracle, session_turns
from replay import MODEL, ReplayResult, replay

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WORKERS = 4


@dataclass(frozen=True)
class Config:
    label: str
    #: "smg" or one of our policies.
    policy: str
    replicas: int = 1
    args: tuple[str, ...] = ()

    @property
    def smg(self) -> bool:
        return self.policy == "smg"


BUILTIN = {
    "round_robin": Config("round_robin", "round_robin"),
    "cache_aware": Config("cache_aware", "cache_aware"),
    "kv_aware": Config("kv_aware", "kv_aware"),
    "kv_aware_x2": Config("kv_aware_x2", "kv_aware", 2),
    "cache_aware_x2": Config("cache_aware_x2", "cache_aware", 2),
    "smg": Config("smg", "smg"),
    "smg_x2": Config("smg_x2", "smg", 2),
}
DEFAULT_CONFIGS = "round_robin,cache_aware,kv_aware,kv_aware_x2,cache_aware_x2,smg,smg_x2"
#: `--quick` covers one and two replicas of ours and SMG, unless `--configs` names others.
QUICK_CONFIGS = "round_robin,kv_aware,kv_aware_x2,smg"


@dataclass(frozen=True)
class TwinSettings:
    block_size: int = 16
    capacity_tokens: int = 150_000
    prefill_ms_per_token: float = 0.025
    decode_ms_per_token: float = 10.0
    decode_ms_per_running: float = 0.5
    max_running_requests: int = 16
    output_tokens: int = 64


# -- processes ------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def gateway_executable() -> str:
    exe = Path(sys.executable).with_name("harmony-gateway")
    if not exe.exists():
        raise SystemExit(f"harmony-gateway is not next to {sys.executable}: run with the project's venv")
    return str(exe)


class Procs:
    """Started subprocesses, stopped by PID in reverse order; their output goes to log files."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = (self.logs / f"{name}.log").open("ab")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        self.procs.append((name, proc))
        return proc

    def stop(self, proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)

    def stop_all(self) -> None:
        for _name, proc in reversed(self.procs):
            self.stop(proc)
        self.procs.clear()


def wait_for_port(port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args!r} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise SystemExit(f"nothing listens on 127.0.0.1:{port} after {timeout:g} s")


def cpu_seconds(procs: list[subprocess.Popen[bytes]]) -> float:
    """User+system seconds of the processes and their children so far."""
    total = 0.0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(proc.pid)
            for q in (p, *p.children(recursive=True)):
                with contextlib.suppress(psutil.Error):
                    t = q.cpu_times()
                    total += t.user + t.system
    return total


# -- one configuration ----------------------------------------------------------------------------


@dataclass
class Gateway:
    base: str
    proc: subprocess.Popen[bytes]
    metrics_url: str


def start_twins(
    procs: Procs, twin: TwinSettings, records: Path, tokenizer: Path | None
) -> list[tuple[str, Path]]:
    workers: list[tuple[str, Path]] = []
    started: list[tuple[int, subprocess.Popen[bytes]]] = []
    for index in range(WORKERS):
        port = free_port()
        record = records / f"twin{index}.pickle"
        cmd = [
            sys.executable,
            str(HERE / "twin.py"),
            "--host", "127.0.0.1",
            "--port", str(port),
            "--engine", "sglang",
            "--block-size", str(twin.block_size),
            "--kv-capacity-tokens", str(twin.capacity_tokens),
            "--prefill-ms-per-token", str(twin.prefill_ms_per_token),
            "--decode-ms-per-token", str(twin.decode_ms_per_token),
            "--decode-ms-per-running", str(twin.decode_ms_per_running),
            "--max-running-requests", str(twin.max_running_requests),
            "--output-tokens", str(twin.output_tokens),
            "--no-record-requests",
            "--record", str(record),
        ]  # fmt: skip
        if tokenizer is not None:
            cmd += ["--serve-tokenizer", str(tokenizer)]
        started.append((port, procs.start(f"twin{index}", cmd, child_env())))
        workers.append((f"grpc://127.0.0.1:{port}", record))
    for port, proc in started:
        wait_for_port(port, proc, 30)
    return workers


def start_gateway(
    procs: Procs, config: Config, index: int, urls: list[str], assets: Path, smg: str
) -> Gateway:
    port = free_port()
    if config.smg:
        prom = free_port()
        cmd = [
            smg, "launch",
            "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom),
            "--worker-urls", *urls,
            "--policy", "cache_aware",
            "--block-size", "16",
            "--tokenizer-path", str(assets / "gpt-oss-tokenizer"),
            "--shutdown-grace-period-secs", "1",
            "--log-level", "info",
            *config.args,
        ]  # fmt: skip
        env = child_env(TIKTOKEN_ENCODINGS_BASE=str(assets / "vocab"), HF_HUB_OFFLINE="1")
        proc = procs.start(f"{config.label}-smg{index}", cmd, env)
        return Gateway(f"http://127.0.0.1:{port}", proc, f"http://127.0.0.1:{prom}/metrics")
    cmd = [gateway_executable(), "serve", "--host", "127.0.0.1", "--port", str(port)]
    for url in urls:
        cmd += ["--worker-url", url]
    cmd += ["--engine", "sglang", "--policy", config.policy, "--storage", "memory://"]
    cmd += ["--log-level", "warning", *config.args]
    proc = procs.start(f"{config.label}-gw{index}", cmd, child_env())
    base = f"http://127.0.0.1:{port}"
    return Gateway(base, proc, base + "/metrics")


async def wait_ready(gateway: Gateway, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        while time.monotonic() < deadline:
            if gateway.proc.poll() is not None:
                raise SystemExit(f"{gateway.proc.args!r} exited with {gateway.proc.returncode}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(gateway.base + "/readiness") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise SystemExit(f"gateway at {gateway.base} is not ready after {timeout:g} s")


async def warm_up(gateway: Gateway) -> None:
    """One short streamed request: the gateway has served before the trace starts."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello."}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 256,
    }
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http,
        http.post(gateway.base + "/v1/chat/completions", json=body) as r,
    ):
        text = await r.text()
        if r.status != 200 or "[DONE]" not in text:
            raise SystemExit(f"warm-up on {gateway.base} failed: {r.status} {text[:300]}")


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_STATE = re.compile(r'state="([^"]*)"')


async def scrape(url: str, pattern: re.Pattern[str]) -> dict[str, float]:
    """Metric samples whose name matches `pattern`, summed over their labels (histogram buckets left out;
    a gauge with a `state` label is summed per state)."""
    out: dict[str, float] = {}
    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http,
            http.get(url) as r,
        ):
            text = await r.text()
        for line in text.splitlines():
            match = _SAMPLE.match(line)
            if not match or not pattern.search(match[1]) or match[1].endswith(("_bucket", "_created")):
                continue
            name = match[1]
            state = _STATE.search(match[2] or "")
            if state:  # a state gauge: count the series in each state
                name = f"{name}[{state[1]}]"
            with contextlib.suppress(ValueError):
                out[name] = out.get(name, 0.0) + float(match[3])
    return {name: value for name, value in out.items() if value or "[" not in name}


KV_METRICS = re.compile(r"kv_", re.IGNORECASE)


@dataclass
class Row:
    label: str
    round: int
    replicas: int
    turns_sent: int
    turns_ok: int
    errors: int
    error_samples: list[str]
    hit: float
    twin_hit: float
    oracle_hit: float
    unbounded_hit: float
    ttft_p50: float | None
    ttft_p99: float | None
    turns_per_s: float
    wall_s: float
    gateway_cpu_s: float
    cpu_ms_per_turn: float | None
    twin_cpu_s: float
    working_set_tokens: int
    capacity_tokens: int
    peak_live_tokens: int
    per_worker_requests: list[int]
    #: Turns served by another worker than their session's turn before (the router's and the oracle's).
    moves: int
    oracle_moves: int
    #: Requests whose session and turn were read from the prompt (all of them, normally).
    labelled: int
    oracle_assigned: list[int]
    evicted_blocks: int
    load_avg: tuple[float, float]
    kv_metrics: dict[str, float] = field(default_factory=dict)


def peak_live_tokens(result: ReplayResult) -> int:
    """The most context the sessions in progress held at once (each at its latest prompt)."""
    by_session: dict[int, list[tuple[float, float, int]]] = {}
    for t in result.ok_turns():
        by_session.setdefault(t.session, []).append((t.sent, t.sent + t.latency, t.prompt_tokens))
    events: list[tuple[float, int]] = []
    for turns in by_session.values():
        turns.sort()
        end = turns[-1][1]
        previous = 0
        for sent, _done, prompt in turns:
            events.append((sent, prompt - previous))
            previous = prompt
        events.append((end, -previous))
    events.sort()
    live = peak = 0
    for _t, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def run_config(
    config: Config, trace: Trace, twin: TwinSettings, args: argparse.Namespace, round_: int
) -> Row:
    workdir = Path(tempfile.mkdtemp(prefix=f"routebench-{config.label}-"))
    procs = Procs(workdir)
    gateways: list[Gateway] = []
    try:
        tokenizer = args.assets / "gpt-oss-tokenizer" if config.smg else None
        workers = start_twins(procs, twin, workdir, tokenizer)
        urls = [url for url, _ in workers]
        gateways = [
            start_gateway(procs, config, index, urls, args.assets, args.smg)
            for index in range(config.replicas)
        ]

        async def drive() -> tuple[ReplayResult, float, float, dict[str, float]]:
            for gateway in gateways:
                await wait_ready(gateway, 90)
            for gateway in gateways:
                await warm_up(gateway)
            if config.smg:
                await asyncio.sleep(1.0)  # let SMG's event subscriptions settle on the warm-up batches
            twin_procs = [p for name, p in procs.procs if name.startswith("twin")]
            gw_procs = [g.proc for g in gateways]
            gw0, twin0 = cpu_seconds(gw_procs), cpu_seconds(twin_procs)
            result = await replay(trace, [g.base for g in gateways], timeout=args.request_timeout)
            gw1, twin1 = cpu_seconds(gw_procs), cpu_seconds(twin_procs)
            metrics: dict[str, float] = {}
            for index, gateway in enumerate(gateways):
                for name, value in (await scrape(gateway.metrics_url, KV_METRICS)).items():
                    metrics[f"{index}:{name}"] = value
            return result, gw1 - gw0, twin1 - twin0, metrics

        load_before = os.getloadavg()[0]
        result, gw_cpu, twin_cpu, metrics = asyncio.run(drive())
        load_after = os.getloadavg()[0]
        for gateway in gateways:
            procs.stop(gateway.proc)
    finally:
        procs.stop_all()
    notes = [TwinNotes.load(record) for _, record in workers]
    oracle: OracleResult = run_oracle(notes, since=result.started_at)
    labels = session_turns(notes, since=result.started_at)
    served = {
        (twin, number): twin
        for twin, note in enumerate(notes)
        for t, number, _out, _ids in note.enters
        if t >= result.started_at
    }
    twin_prompt = twin_cached = 0
    per_worker: list[int] = []
    for note in notes:
        leaves = [leave for leave in note.leaves if leave[0] >= result.started_at]
        by_number = {number: ids for _t, number, _o, ids in note.enters}
        count = 0
        for _t, number, _output, cached in leaves:
            if number in by_number and cached >= 0:
                twin_prompt += len(by_number[number])
                twin_cached += cached
                count += 1
        per_worker.append(count)
    ok = result.ok_turns()
    errors = result.errors()
    samples = sorted({(e.error or "?")[:160] for e in errors})[:5]
    row = Row(
        label=config.label,
        round=round_,
        replicas=config.replicas,
        turns_sent=len(result.turns),
        turns_ok=len(ok),
        errors=len(errors) + (trace.turns() - len(result.turns)),
        error_samples=samples,
        hit=result.hit_rate(),
        twin_hit=twin_cached / twin_prompt if twin_prompt else 0.0,
        oracle_hit=oracle.hit_rate,
        unbounded_hit=oracle.unbounded_hit_rate,
        ttft_p50=result.ttft(50),
        ttft_p99=result.ttft(99),
        turns_per_s=result.turns_per_second(),
        wall_s=result.wall_seconds,
        gateway_cpu_s=gw_cpu,
        cpu_ms_per_turn=gw_cpu * 1000 / len(ok) if ok else None,
        twin_cpu_s=twin_cpu,
        working_set_tokens=oracle.working_set_tokens,
        capacity_tokens=twin.capacity_tokens * WORKERS,
        peak_live_tokens=peak_live_tokens(result),
        per_worker_requests=per_worker,
        moves=moves(served, labels),
        oracle_moves=moves(oracle.choices, labels),
        labelled=len(labels),
        oracle_assigned=oracle.assigned,
        evicted_blocks=sum(n.evicted_blocks for n in notes),
        load_avg=(load_before, load_after),
        kv_metrics=metrics,
    )
    if not args.keep_logs and not errors:
        for path in workdir.iterdir():
            path.unlink()
        workdir.rmdir()
    else:
        print(f"  logs: {workdir}", file=sys.stderr)
    return row


# -- report ---------------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f} %"


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{1000 * x:.0f}"


def _count(x: float | None) -> str:
    return "–" if x is None else f"{x:.0f}"


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def table(rows: list[dict[str, Any]]) -> str:
    """One line per configuration: medians over its rounds (the rounds' values in brackets when several)."""
    labels: list[str] = []
    for row in rows:
        if row["label"] not in labels:
            labels.append(row["label"])
    by_label = {label: [r for r in rows if r["label"] == label] for label in labels}
    # TTFT p99 is compared with SMG's with as many replicas (one replica's when that is all there is).
    smg_p99 = {
        replicas: _median([r["ttft_p99"] for r in by_label.get(label, [])])
        for replicas, label in ((1, "smg"), (2, "smg_x2"))
    }
    smg_p99[2] = smg_p99[2] or smg_p99[1]
    out = [
        "| config | hit | twin hit | oracle | hit/oracle | moves | TTFT p50 ms | TTFT p99 ms | p99/SMG "
        "| turns/s | errors | gw CPU s | CPU ms/turn |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, group in by_label.items():

        def med(key: str, group: list[dict[str, Any]] = group) -> float | None:
            return _median([r[key] for r in group])

        def spread(key: str, fmt: Any, group: list[dict[str, Any]] = group) -> str:
            value = fmt(med(key))
            if len(group) > 1:
                value += " (" + " / ".join(fmt(r[key]) for r in group) + ")"
            return value

        for r in group:
            r.setdefault("moves", None)
        ratios = [r["hit"] / r["oracle_hit"] if r["oracle_hit"] else None for r in group]
        ratio = _median(ratios)
        p99 = med("ttft_p99")
        reference = smg_p99.get(group[0].get("replicas", 1)) or smg_p99[1]
        vs_smg = f"{p99 / reference:.2f}" if p99 is not None and reference else "–"
        errors = sum(r["errors"] for r in group)
        out.append(
            f"| {label} | {spread('hit', _pct)} | {_pct(med('twin_hit'))} | {_pct(med('oracle_hit'))} "
            f"| {'–' if ratio is None else f'{ratio:.2f}'} | {_count(med('moves'))} "
            f"| {spread('ttft_p50', _ms)} "
            f"| {spread('ttft_p99', _ms)} | {vs_smg} | {med('turns_per_s') or 0:.2f} | {errors} "
            f"| {med('gateway_cpu_s') or 0:.1f} | {med('cpu_ms_per_turn') or 0:.1f} |"
        )
    lines = ["\n".join(out), ""]
    for label, group in by_label.items():
        if label.endswith("_x2") and label[:-3] in by_label:
            one = _median([r["hit"] for r in by_label[label[:-3]]])
            two = _median([r["hit"] for r in group])
            if one and two is not None:
                lines.append(
                    f"- {label}: hit rate {100 * two / one:.0f} % of one replica's "
                    f"({100 * (two / one - 1):+.1f} %)"
                )
    first = rows[0]
    lines.append(
        f"- working set {first['working_set_tokens']:,} tokens (distinct blocks of every prompt and "
        f"answer), fleet KV capacity {first['capacity_tokens']:,} "
        f"({100 * first['capacity_tokens'] / max(1, first['working_set_tokens']):.0f} %); "
        f"at most {first['peak_live_tokens']:,} tokens of context in the sessions in progress at once "
        f"(shared prompts counted per session); "
        f"unbounded-cache hit rate {_pct(first['unbounded_hit'])}"
    )
    return "\n".join(lines)


def details(row: Row) -> str:
    kv = ", ".join(f"{k}={v:g}" for k, v in sorted(row.kv_metrics.items()))
    return (
        f"  {row.label} round {row.round}: {row.turns_ok}/{row.turns_sent} turns ok, wall {row.wall_s:.1f} s, "
        f"per worker {row.per_worker_requests} (oracle {row.oracle_assigned}), "
        f"moves {row.moves} (oracle {row.oracle_moves}; {row.labelled} labelled), evicted blocks "
        f"{row.evicted_blocks:,}, twin CPU {row.twin_cpu_s:.1f} s, load {row.load_avg[0]:.1f}"
        f"->{row.load_avg[1]:.1f}"
        + (f"\n    errors: {row.error_samples}" if row.error_samples else "")
        + (f"\n    metrics: {kv}" if kv else "")
    )


# -- main -----------------------------------------------------------------------------------------


def parse_configs(args: argparse.Namespace) -> list[Config]:
    configs: list[Config] = []
    names = args.configs or (QUICK_CONFIGS if args.quick else DEFAULT_CONFIGS)
    for name in filter(None, (n.strip() for n in names.split(","))):
        if name not in BUILTIN:
            raise SystemExit(f"unknown configuration {name!r}; known: {', '.join(BUILTIN)}")
        configs.append(BUILTIN[name])
    for spec in args.extra_config:
        label, _, rest = spec.partition("=")
        policy, _, rest = rest.partition(":")
        replicas, _, extra = rest.partition(":")
        if not label or not policy:
            raise SystemExit(f"--extra-config {spec!r}: expected LABEL=POLICY:REPLICAS:ARGS")
        configs.append(Config(label, policy, int(replicas or 1), tuple(extra.split())))
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="16 sessions x 6 turns to 12k tokens, four configurations"
    )
    parser.add_argument(
        "--configs",
        default=None,
        help=f"comma-separated configurations (default: {DEFAULT_CONFIGS}; with --quick: {QUICK_CONFIGS})",
    )
    parser.add_argument("--extra-config", action="append", default=[], metavar="LABEL=POLICY:N:ARGS")
    parser.add_argument("--rounds", type=int, default=1, help="replays per configuration, interleaved")
    parser.add_argument("--cache-share", type=float, default=0.4, help="fleet KV capacity / working set")
    parser.add_argument("--sessions", type=int, default=None)
    parser.add_argument("--turns", type=int, default=None)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--request-timeout", type=float, default=180.0)
    parser.add_argument("--smg", default="/tmp/benchvenv/bin/smg", help="the smg executable")
    parser.add_argument("--assets", type=Path, default=Path("/tmp/benchassets"))
    parser.add_argument("--json-out", type=Path, default=None, help="append one JSON line per replay")
    parser.add_argument("--report", type=Path, default=None, help="print the table of a --json-out file")
    parser.add_argument("--keep-logs", action="store_true", help="keep the processes' logs")
    args = parser.parse_args()

    if args.report:
        rows = [json.loads(line) for line in args.report.read_text().splitlines() if line.strip()]
        print(table(rows))
        return

    if args.quick:
        trace_config = TraceConfig(
            sessions=16, turns=6, final_context_tokens=12_000, think_seconds=1.0, ramp_seconds=8.0
        )
    else:
        trace_config = TraceConfig()
    overrides = {"sessions": args.sessions, "turns": args.turns, "seed": args.seed}
    trace_config = TraceConfig(
        **{**asdict(trace_config), **{k: v for k, v in overrides.items() if v is not None}}
    )
    trace = build_trace(trace_config)
    twin = TwinSettings()
    estimate = trace.working_set_tokens(answer_tokens=40, overhead_tokens=6)
    per_worker = int(args.cache_share * estimate / WORKERS) // twin.block_size * twin.block_size
    twin = TwinSettings(capacity_tokens=per_worker)

    configs = parse_configs(args)
    smg_ok = Path(args.smg).exists() and (args.assets / "gpt-oss-tokenizer").is_dir()
    if not smg_ok and any(c.smg for c in configs):
        print(f"skipping SMG: {args.smg} or {args.assets}/gpt-oss-tokenizer is missing", file=sys.stderr)
        configs = [c for c in configs if not c.smg]
    print(
        f"trace: {len(trace.sessions)} sessions x {trace_config.turns} turns ({trace.turns()} turns), "
        f"~{estimate:,} tokens of working set; twins: {WORKERS} x {twin.capacity_tokens:,} KV tokens",
        file=sys.stderr,
    )
    rows: list[Row] = []
    for round_ in range(1, args.rounds + 1):
        for config in configs:
            started = time.monotonic()
            row = run_config(config, trace, twin, args, round_)
            rows.append(row)
            print(
                f"{config.label} round {round_}: hit {_pct(row.hit)} (oracle {_pct(row.oracle_hit)}), "
                f"TTFT p50/p99 {_ms(row.ttft_p50)}/{_ms(row.ttft_p99)} ms, {row.turns_per_s:.2f} turns/s, "
                f"{row.errors} errors, gateway CPU {row.gateway_cpu_s:.1f} s "
                f"[{time.monotonic() - started:.0f} s]",
                file=sys.stderr,
            )
            print(details(row), file=sys.stderr)
            if args.json_out:
                with args.json_out.open("a") as f:
                    f.write(json.dumps(asdict(row)) + "\n")
    print(table([asdict(r) for r in rows]))


if __name__ == "__main__":
    main()
