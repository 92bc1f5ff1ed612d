"""``python -m swarm.benchmark client-memory``: a swarm client's peak memory and seconds per step at LLaDA-8B's
widths, per generation mode (issue 54).

Builds (or takes with ``--model``) realscale's checkpoint of LLaDA-8B's widths, starts servers of ``--span`` blocks
(the last with ``--head``) and runs each mode in a fresh client process at default settings: a short warm-up
generation (the route, its challenges), then the measured one. The process's peak resident memory (``VmHWM``: every
page it ever held, the checkpoint's mapped pages included, from the interpreter's start) is what a user's machine
must have; the seconds per denoising step are the measured generation's. A fresh process per mode, so that one
mode's pages never count for another. ``client_run`` is also what ``tests/test_client_memory.py`` measures with (its
modes in one process: the peak after the last bounds every mode's).
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import click

from swarm.utils.local_swarm import LocalSwarm

logger = logging.getLogger(__name__)

GiB = 2**30
# Issue 54's measurement: 16 tokens, 16 steps, blocks of 8, greedy, after a prompt of the checkpoint's words
GENERATION = dict(gen_length=16, steps=16, block_length=8, seed=0, temperature=0.0)
MODES: dict[str, dict[str, Any]] = {"plain": {}, "dual": {"cache": "dual"}, "stale": {"staleness": 2}}
PROMPT = "the cat sat on the mat"


def process_memory() -> dict[str, int]:
    """This process's resident memory in bytes: now (``rss``), its high-water mark (``peak``) and the file-backed
    part (``file``: mapped checkpoint pages).

    ``VmHWM`` rather than ``ru_maxrss``: Linux carries ``ru_maxrss`` over ``execve`` from the parent, so a fresh
    subprocess would report its parent's peak; ``VmHWM`` belongs to the new address space."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    kib = {key: int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM", "RssFile", "RssShmem")}
    return {"rss": kib["VmRSS"], "peak": kib["VmHWM"], "file": kib["RssFile"] + kib["RssShmem"]}


@dataclass
class ClientRun:
    """What one client process measured for one mode."""

    mode: str
    peak_bytes: int
    seconds_per_step: float
    client_cpu_per_step: float  # the client process's CPU seconds per step, every thread
    server_compute_per_step: float  # the route's servers' compute seconds per step (their queueing included)
    steps: int
    tokens: list[int]
    spot_checks: int  # hops drawn for a check
    unchecked: int  # of those, hops nobody could check
    head_loaded: bool  # whether the client ever read its own output head
    notes: list[str] = field(default_factory=list)  # why drawn checks were left unchecked


def client_run(path: str, initial_peers: Sequence[str], prefix: str, modes: Sequence[str],
               overrides: Optional[dict[str, Any]] = None, generation: Optional[dict[str, Any]] = None
               ) -> list[ClientRun]:
    """Run ``modes`` one after another in one fresh Python process (``python -m swarm.benchmark.client_memory``)
    and return each one's figures; a mode's peak is the process's after it, so it counts the modes before."""
    spec = dict(path=path, initial_peers=list(initial_peers), prefix=prefix, modes=list(modes),
                overrides=overrides or {}, generation=generation or GENERATION)
    done = subprocess.run([sys.executable, "-m", "swarm.benchmark.client_memory", json.dumps(spec)],
                          capture_output=True, text=True, env=os.environ.copy())
    if done.returncode:
        raise RuntimeError(f"the client of {', '.join(modes)} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return [ClientRun(**run) for run in json.loads(done.stdout.strip().splitlines()[-1])]


def measure_in_this_process(spec: dict[str, Any]) -> list[ClientRun]:
    """The child's side of :func:`client_run`: one client at default settings (plus ``overrides``), a warm-up
    generation (the route and its challenges), then one measured generation per mode."""
    from swarm.benchmark.realscale import server_compute_seconds
    from swarm.client import DistributedDiffusionLM

    runs = []
    with DistributedDiffusionLM.from_pretrained(spec["path"], initial_peers=spec["initial_peers"],
                                                dht_prefix=spec["prefix"], **spec["overrides"]) as lm:
        generation = spec["generation"]
        lm.generate(PROMPT, **dict(generation, gen_length=generation["block_length"], steps=2))
        for mode in spec["modes"]:
            route = list(lm.planner.route)
            computed, started, cpu = server_compute_seconds(lm, route), time.perf_counter(), time.process_time()
            result = lm.generate(PROMPT, **generation, **MODES[mode])
            elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
            computed = server_compute_seconds(lm, route) - computed
            checks, steps = result.info["spot_checks"], max(1, result.steps)
            runs.append(ClientRun(mode, process_memory()["peak"], elapsed / steps, cpu / steps, computed / steps,
                                  result.steps,
                                  list(result.token_ids), len(checks),
                                  result.info.get("unchecked", 0),  # clients before issue 48 count none
                                  lm._head is not None,
                                  sorted({check["note"] for check in checks if check["verdict"] == "no_checker"})))
    return runs


@click.command("client-memory")
@click.option("--model", default=None, help="A LLaDA-layout checkpoint to use instead of building one.")
@click.option("--blocks", type=click.IntRange(min=1), default=2, show_default=True,
              help="Blocks of random weights in the built checkpoint.")
@click.option("--span", type=click.IntRange(min=1), default=1, show_default=True,
              help="Blocks per server (the last one also --head).")
@click.option("--modes", default=",".join(MODES), show_default=True, help=f"Comma-separated, of {', '.join(MODES)}.")
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="Client processes per mode, interleaved; the table shows the fastest and the highest peak.")
@click.option("--spot-check-fraction", type=click.FloatRange(0, 1), default=None,
              help="The clients' ClientConfig.spot_check_fraction (default: the client's default).")
@click.option("--spot-check-memory-mb", type=click.FloatRange(min=0), default=None,
              help="The clients' ClientConfig.spot_check_memory_mb (default: the client's default; 2000 lets a "
                   "check load a block and the head here, as before issue 54).")
def client_memory(model: Optional[str], blocks: int, span: int, modes: str, repeats: int,
                  spot_check_fraction: Optional[float], spot_check_memory_mb: Optional[float]) -> None:
    """A client's peak memory and seconds per step at LLaDA-8B's widths, per mode, each in a fresh process."""
    from swarm.benchmark.realscale import checkpoint, start_span_servers

    logging.basicConfig(level=logging.WARNING)
    chosen = [mode.strip() for mode in modes.split(",") if mode.strip()]
    unknown = sorted(set(chosen) - set(MODES))
    if unknown:
        raise click.BadParameter(f"unknown modes {', '.join(unknown)}", param_hint="--modes")
    overrides = {name: value for name, value in (("spot_check_fraction", spot_check_fraction),
                                                 ("spot_check_memory_mb", spot_check_memory_mb)) if value is not None}
    prefix = "client-memory"
    runs: dict[str, list[ClientRun]] = {mode: [] for mode in chosen}
    with checkpoint(model, blocks) as path, LocalSwarm() as swarm:
        swarm.start_bootstrap()
        start_span_servers(swarm, path, span, "--dht-prefix", prefix)
        for _ in range(repeats):
            for mode in chosen:
                click.echo(f"running: {mode} ...", err=True)
                runs[mode] += client_run(str(path), swarm.initial_peers, prefix, [mode], overrides)
    print_runs(runs)


def print_runs(runs: dict[str, list[ClientRun]]) -> None:
    click.echo(f"\n{'mode':<8}{'peak GB':>9}{'s/step':>8}{'client CPU s':>13}{'servers s':>10}{'steps':>7}"
               f"{'checks':>8}{'unchecked':>11}{'client head':>13}  tokens (first 6)")
    for mode, measured in runs.items():
        fastest = min(measured, key=lambda run: run.seconds_per_step)
        peak = max(run.peak_bytes for run in measured)
        click.echo(f"{mode:<8}{peak / 1e9:>9.2f}{fastest.seconds_per_step:>8.2f}{fastest.client_cpu_per_step:>13.3f}"
                   f"{fastest.server_compute_per_step:>10.2f}{fastest.steps:>7}"
                   f"{fastest.spot_checks:>8}{fastest.unchecked:>11}{'loaded' if fastest.head_loaded else 'no':>13}"
                   f"  {fastest.tokens[:6]}")
        for note in sorted({note for run in measured for note in run.notes}):
            click.echo(f"    unchecked: {note}")
    click.echo("peak: the client process's VmHWM (mapped checkpoint pages included); per denoising step of the "
               "measured generation (after a warm-up one): wall seconds, the client's CPU seconds, the route's "
               "servers' compute seconds (queueing included)")


if __name__ == "__main__":  # the child of client_run
    print(json.dumps([asdict(run) for run in measure_in_this_process(json.loads(sys.argv[1]))]))
