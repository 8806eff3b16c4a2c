"""``pretune bench serve``: concurrent streaming clients over real HTTP, ``pretune serve`` vs ``transformers serve``.

Both servers serve the same model (default: SmolLM2-135M-Instruct, ``pretune.realmodels.smollm2_dir()``; any Hugging
Face decoder folder with ``--model``) in fp32 on the CPU, each started as its own process on a free loopback port
(``python -m pretune serve MODEL --max-batch N``; ``transformers serve MODEL --device cpu --dtype float32``, with
``--continuous-batching`` for the ``transformers-cb`` side), with ``OMP_NUM_THREADS`` = ``--threads``.

A measurement is one process (:func:`pretune.bench.common.spawn_worker`): it starts one server, sends one untimed
warm-up request, then for each client count N (1, 4, 16) runs N concurrent clients, each streaming
``--requests`` greedy completions (``POST /v1/completions``, ``stream: true``, ``temperature: 0``, ``max_tokens``
``--new-tokens``) of its own prompt, and stops the server. A token is a streamed chunk with text (both servers send
one per token). Per client count: tokens/s = all tokens / wall time from the first request sent to the last stream
ended; time to first token (TTFT) = from a request sent to its first token, p50 and p95 over the requests. The sides
alternate which goes first for ``--rounds`` rounds; the table gives every round and the medians, the tokens/s ratio
pretune / transformers and the TTFT ratio (the issue's targets: >= 2x the tokens/s at 16 clients, <= the TTFT at
1 client).
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .common import add_run_arguments, bench_main, report, spawn_worker

IMPLS = ("pretune", "transformers", "transformers-cb")
DEFAULT_IMPLS = IMPLS[:2]
CLIENTS = (1, 4, 16)
TOPICS = ["a lighthouse keeper", "a lost key", "the first snow", "a clockmaker", "a river journey", "an old map",
          "a quiet library", "a storm at sea", "a garden at night", "a broken violin", "a mountain village",
          "a letter never sent", "a travelling circus", "a forgotten song", "a desert well", "a winter market"]


@dataclass
class Job:
    impl: str  # pretune | transformers | transformers-cb
    model: str  # a Hugging Face decoder folder (pretune serve also takes any folder pretune loads)
    clients: list[int] = field(default_factory=lambda: list(CLIENTS))
    new_tokens: int = 64  # max_tokens of every request
    requests: int = 1  # completions each client streams one after the other
    threads: int = 0  # OMP_NUM_THREADS of the server; 0: every core
    startup_timeout: float = 300.0  # seconds the server may take to answer /v1/models


# ---------------------------------------------------------------------------------------------
# worker side (runs in a child process; starts the server as a grandchild)
# ---------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server(job: Job, port: int) -> tuple[list[str], str]:
    """The server's command line and the model name its requests use."""
    if job.impl == "pretune":
        return ([sys.executable, "-m", "pretune", "serve", job.model, "--port", str(port), "--name", "bench",
                 "--max-batch", str(max(job.clients))], "bench")
    exe = shutil.which("transformers", path=str(Path(sys.executable).parent)) or shutil.which("transformers")
    if exe is None:
        raise RuntimeError("transformers serve: no 'transformers' command (pip install 'transformers[serving]')")
    cmd = [exe, "serve", job.model, "--port", str(port), "--host", "127.0.0.1", "--device", "cpu", "--dtype",
           "float32"]
    return cmd + (["--continuous-batching"] if job.impl == "transformers-cb" else []), job.model


def _wait_ready(proc, url: str, timeout: float) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before answering")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"the server did not answer {url}/v1/models within {timeout:.0f} s")


async def _stream(client, url: str, body: dict) -> tuple[float | None, int]:
    """(seconds to the first token or None, tokens) of one streamed completion."""
    import json

    t0, first, n = time.perf_counter(), None, 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            if choices and choices[0].get("text"):
                n += 1
                first = first if first is not None else time.perf_counter() - t0
    return first, n


async def _load(url: str, model: str, clients: int, job: Job) -> dict:
    import asyncio

    import httpx

    def body(c: int, k: int) -> dict:
        topic = TOPICS[(c + k) % len(TOPICS)]
        return {"model": model, "prompt": f"Here is a short story about {topic}. Once upon a time,",
                "max_tokens": job.new_tokens, "temperature": 0, "stream": True}

    async def one_client(client, c: int) -> list[tuple[float | None, int]]:
        return [await _stream(client, url, body(c, k)) for k in range(job.requests)]

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        await _stream(client, url, {**body(0, 0), "max_tokens": 4})  # warm-up (untimed)
        t0 = time.perf_counter()
        done = await asyncio.gather(*(one_client(client, c) for c in range(clients)))
        wall = time.perf_counter() - t0
    ttft = sorted(f for runs in done for f, _ in runs if f is not None)
    tokens = sum(n for runs in done for _, n in runs)
    return {"clients": clients, "tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
            "ttft_p50": _quantile(ttft, 0.5), "ttft_p95": _quantile(ttft, 0.95)}


def _quantile(xs: list[float], q: float) -> float | None:
    """The q-quantile of sorted ``xs`` (linear between neighbours; None when empty)."""
    if not xs:
        return None
    i = q * (len(xs) - 1)
    lo = int(i)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (i - lo)


def run_worker(job: Job) -> dict:
    """Start the server of ``job.impl``, run each client count's load, stop it; one dict per client count."""
    import asyncio

    if job.impl not in IMPLS:
        raise ValueError(f"impl ({job.impl!r}) must be one of {IMPLS}")
    port = _free_port()
    cmd, model = _server(job, port)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_WAIT_POLICY="PASSIVE")
    if job.threads:
        env["OMP_NUM_THREADS"] = str(job.threads)
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        try:
            _wait_ready(proc, url, job.startup_timeout)
        except RuntimeError as e:
            proc.kill()
            raise RuntimeError(f"{job.impl}: {e}: {' '.join(cmd)}\n{proc.communicate()[1][-2000:]}") from None
        startup = time.perf_counter() - t0
        loads = [asyncio.run(_load(url, model, n, job)) for n in job.clients]
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return {"impl": job.impl, "startup_seconds": startup, "loads": loads}


# ---------------------------------------------------------------------------------------------
# parent side
# ---------------------------------------------------------------------------------------------
def bench_serve(*, model=None, clients=CLIENTS, rounds: int = 3, new_tokens: int = 64, requests: int = 1,
                threads: int = 0, impls=DEFAULT_IMPLS, echo=print, spawn=spawn_worker) -> list[dict]:
    """Alternate the servers, one process per (round, side), ``rounds`` times.

    Args:
        model: a Hugging Face decoder folder; None: SmolLM2-135M-Instruct.
        clients: the client counts, each a load of its own on the same server.
        rounds, new_tokens, requests, threads: see :class:`Job` and the module docstring.
        impls: which of IMPLS to run.
        echo: where a line per finished run goes (None: nowhere).
        spawn: runs one :class:`Job` and returns its result (default: in a fresh process).
    Returns:
        One row per client count: ``<impl>_tokens_per_s`` / ``<impl>_ttft_p50`` / ``<impl>_ttft_p95`` (medians over
        rounds) and ``<impl>_runs`` (each round's tokens/s); with pretune and transformers, ``ratio`` (tokens/s,
        pretune / transformers) and ``ttft_ratio`` (p50, pretune / transformers).
    """
    if rounds < 1 or new_tokens < 1 or requests < 1 or not clients or min(clients) < 1:
        raise ValueError(f"rounds ({rounds}), new_tokens ({new_tokens}), requests ({requests}) and clients "
                         f"({clients}) must be >= 1")
    impls = tuple(impls)
    if not impls or any(i not in IMPLS for i in impls) or len(set(impls)) != len(impls):
        raise ValueError(f"impls ({impls}) must be distinct names from {IMPLS}")
    if model is None:
        from ..io.realmodels import smollm2_dir

        model = smollm2_dir()
    results: dict[str, list[dict]] = {i: [] for i in impls}
    for r in range(rounds):
        for impl in (impls if r % 2 == 0 else tuple(reversed(impls))):  # alternate who goes first
            job = Job(impl, str(model), clients=list(clients), new_tokens=new_tokens, requests=requests,
                      threads=threads)
            res = spawn(job, "pretune.bench.serve")
            results[impl].append(res)
            if echo is not None:
                echo(f"round {r + 1} {impl}: " + ", ".join(f"{x['clients']} clients {x['tokens_per_s']:.1f} tok/s"
                                                           for x in res["loads"]))
    rows = []
    for k, n in enumerate(clients):
        row = {"bench": "serve", "model": str(model), "clients": n, "new_tokens": new_tokens, "requests": requests,
               "rounds": rounds, "threads": threads}
        for impl in impls:
            loads = [res["loads"][k] for res in results[impl]]
            row[f"{impl}_runs"] = [round(x["tokens_per_s"], 2) for x in loads]
            row[f"{impl}_tokens"] = [x["tokens"] for x in loads]
            row[f"{impl}_tokens_per_s"] = statistics.median(x["tokens_per_s"] for x in loads)
            for q in ("ttft_p50", "ttft_p95"):
                got = [x[q] for x in loads if x[q] is not None]
                row[f"{impl}_{q}"] = statistics.median(got) if got else None
        if "pretune" in impls and "transformers" in impls:
            row["ratio"] = row["pretune_tokens_per_s"] / row["transformers_tokens_per_s"]
            if row["pretune_ttft_p50"] and row["transformers_ttft_p50"]:
                row["ttft_ratio"] = row["pretune_ttft_p50"] / row["transformers_ttft_p50"]
        rows.append(row)
    return rows


def format_rows(rows: list[dict]) -> str:
    """The rows of :func:`bench_serve` as a text table."""
    rows = [r for r in rows if r.get("bench") == "serve"]
    if not rows:
        return ""
    r0 = rows[0]
    impls = [i for i in IMPLS if f"{i}_runs" in r0]
    lines = [f"streaming greedy completions over HTTP, {Path(r0['model']).name}, fp32 CPU, "
             f"{r0['threads'] or 'all'} threads: {r0['requests']} request(s) of {r0['new_tokens']} tokens per "
             f"client; medians over {r0['rounds']} rounds (each round's tokens/s in brackets)"]
    head = f"{'clients':<9}{'server':<17}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p95':>10}   rounds"
    lines += [head, "-" * len(head)]
    sec = lambda v: f"{v:>9.2f}s" if v is not None else f"{'-':>10}"  # noqa: E731
    for r in rows:
        for i in impls:
            lines.append(f"{r['clients']:<9}{i:<17}{r[f'{i}_tokens_per_s']:>9.1f}{sec(r[f'{i}_ttft_p50'])}"
                         f"{sec(r[f'{i}_ttft_p95'])}   {r[f'{i}_runs']}")
        if "ratio" in r:
            ttft = f", TTFT p50 ratio {r['ttft_ratio']:.2f}" if "ttft_ratio" in r else ""
            lines.append(f"{r['clients']:<9}pretune / transformers: tokens/s {r['ratio']:.2f}x{ttft}")
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument("--model", help="a Hugging Face decoder folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--clients", type=int, nargs="+", default=list(CLIENTS), help="client counts (default 1 4 16)")
    p.add_argument("--new-tokens", type=int, default=64, help="max_tokens of every request (default 64)")
    p.add_argument("--requests", type=int, default=1, help="completions each client streams (default 1)")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(DEFAULT_IMPLS),
                   help="servers to time (default: pretune transformers; transformers-cb: its --continuous-batching)")
    add_run_arguments(p, threads="every core")


def run_cli(args) -> int:
    rows = bench_serve(model=args.model, clients=tuple(args.clients), rounds=args.rounds, new_tokens=args.new_tokens,
                       requests=args.requests, threads=args.threads, impls=args.impls)
    return report(rows, format_rows(rows), args.json)


def main(argv=None) -> int:
    return bench_main(argv, prog="python -m pretune.bench.serve", doc=__doc__, job_cls=Job, run_worker=run_worker,
                      add_arguments=add_arguments, run_cli=run_cli)


if __name__ == "__main__":
    sys.exit(main())
