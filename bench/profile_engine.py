"""Where a lorafleet engine step spends its time: one scenario at one concurrency, timed from outside.

Wraps (without changing the engine's code) the step's parts with wall-clock timers: the whole
step, the model forward, the LoRA backend's `apply` (all layers and groups), `prepare`, and
sampling. `--torch-profile [STEPS]` also prints torch.profiler's top operators over a few decode
steps of one more pass (a whole pass would hold gigabytes of trace).

    python bench/profile_engine.py --scenario mixed16 --concurrency 32 --torch-profile 4
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import (
    OUTPUT_LEN,
    PROMPT_LEN,
    SCENARIOS,
    one_pass,
    requests_for,
    scenario_adapters,
    scenario_model,
)
from common import log

PREFILL_STEPS = 2  # the first steps of a pass are prefills; the torch profile covers decode steps


class Timers:
    """Accumulated wall time and call count per label."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.enabled = False

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.enabled:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[label] += time.perf_counter() - t0
                self.calls[label] += 1

        return timed

    def report(self) -> str:
        step = self.total.get("step", 0.0) or 1e-9
        rows = [f"{'part':<14}{'calls':>8}{'total s':>10}{'ms/call':>10}{'% of step':>11}"]
        for label in sorted(self.total, key=lambda k: -self.total[k]):
            t, n = self.total[label], self.calls[label]
            rows.append(f"{label:<14}{n:>8}{t:>10.2f}{1000 * t / n:>10.3f}{100 * t / step:>10.1f}%")
        return "\n".join(rows)


class StepProfiler:
    """torch.profiler around `max_steps` decode steps, started and stopped in the engine's own thread."""

    def __init__(self, fn: Callable[..., Any], max_steps: int) -> None:
        self.fn = fn
        self.max_steps = max_steps
        self.steps = 0
        self.prof: Any = None
        self.enabled = False
        self.table = ""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch.profiler import ProfilerActivity, profile

        if self.enabled:
            self.steps += 1
        if self.enabled and self.prof is None and self.steps == PREFILL_STEPS + 1:
            self.prof = profile(activities=[ProfilerActivity.CPU])
            self.prof.__enter__()
        if self.prof is not None and (not self.enabled or self.steps > PREFILL_STEPS + self.max_steps):
            self.prof.__exit__(None, None, None)
            self.table = self.prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
            self.prof = None
        return self.fn(*args, **kwargs)


def profile(model: Path, scenario: str, concurrency: int, profile_steps: int) -> None:
    from lorafleet_worker.core.engine import Engine
    from lorafleet_worker.sample.params import SamplingParams

    spec = SCENARIOS[scenario]
    adapters = scenario_adapters(scenario, model)
    timers = Timers()
    engine = Engine(
        model,
        max_loras=spec.max_loras,
        max_cpu_loras=max(64, len(adapters)),
        max_lora_rank=64,
        max_num_seqs=max(concurrency, 1),
        max_model_len=PROMPT_LEN + OUTPUT_LEN + 16,
    )
    profiler = StepProfiler(engine._step, profile_steps) if profile_steps else None
    engine._step = timers.wrap("step", profiler or engine._step)
    engine.core.runner.model.forward = timers.wrap("forward", engine.core.runner.model.forward)
    runner = engine.core.runner
    runner.sampler = timers.wrap("sample", runner.sampler)
    engine.core.scheduler.schedule = timers.wrap("schedule", engine.core.scheduler.schedule)
    if engine.core.runner.lora_backend is not None:
        backend = engine.core.runner.lora_backend
        backend.apply = timers.wrap("lora_apply", backend.apply)
        backend.step_runner = lambda pool, batch: None  # decode steps' LoRA through the timed apply too
        backend.prepare = timers.wrap("lora_prepare", backend.prepare)

    async def run() -> None:
        await engine.start()
        for name, path in adapters:
            await engine.add_adapter(name, path)
        names = [n for n, _ in adapters]
        await one_pass(engine, SamplingParams, requests_for(1, names, engine.config.vocab_size)[:1], 1)
        timers.enabled = True
        reqs = requests_for(concurrency, names, engine.config.vocab_size)
        res = await one_pass(engine, SamplingParams, reqs, concurrency)
        timers.enabled = False
        log(f"{scenario} c={concurrency}: {res['output_tok_s']} tok/s, {engine.stats.steps} steps")
        print(timers.report(), flush=True)
        if profiler is not None:
            profiler.enabled = True
            await one_pass(engine, SamplingParams, reqs, concurrency)
            profiler.enabled = False
            await one_pass(engine, SamplingParams, reqs[:1], 1)  # one more step stops the profiler
            print(profiler.table, flush=True)
        await engine.stop()

    asyncio.run(run())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default="mixed16", choices=list(SCENARIOS))
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--torch-profile", type=int, nargs="?", const=4, default=0, metavar="STEPS",
                    help="torch.profiler table of STEPS decode steps (default 4) of one more pass")  # fmt: skip
    args = ap.parse_args()
    profile(scenario_model(args.scenario), args.scenario, args.concurrency, args.torch_profile)


if __name__ == "__main__":
    main()
