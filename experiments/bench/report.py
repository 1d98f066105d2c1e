"""Turn raw measurements into ratios, target checks, JSON and a markdown table."""

from __future__ import annotations

import statistics
from typing import Any

TARGETS = {
    "capture_overhead_compiled": 0.05,  # at most 5% slower than plain vLLM, compiled
    "speedup_vs_common": 1.5,  # at least 1.5x the common approach's throughput
    "multistep_vs_minimum": 1.05,  # forwarded prompt tokens within 5% of the minimum
}


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def paired_ratio(runs: dict[str, list[dict]], num: str, den: str) -> dict | None:
    """Throughput ratio num/den: per repeat (adjacent runs, drift-robust) and of the medians."""
    a, b = runs.get(num), runs.get(den)
    if not a or not b:
        return None
    per_rep = [x["tok_per_s"] / y["tok_per_s"] for x, y in zip(a, b)]
    med_a = _median([x["tok_per_s"] for x in a])
    med_b = _median([y["tok_per_s"] for y in b])
    cpu = [x["tok_per_cpu_s"] / y["tok_per_cpu_s"] for x, y in zip(a, b)
           if x.get("tok_per_cpu_s") and y.get("tok_per_cpu_s")]
    return {"num": num, "den": den, "per_repeat": per_rep, "median_of_paired": _median(per_rep),
            "ratio_of_medians": med_a / med_b, "cpu_time_median_of_paired": _median(cpu)}


def summarize_throughput(runs: dict[str, list[dict]], modes: tuple[str, ...]) -> dict:
    configs = {}
    for name, rs in runs.items():
        tps = [r["tok_per_s"] for r in rs]
        cps = [r["tok_per_cpu_s"] for r in rs if r.get("tok_per_cpu_s")]
        configs[name] = {"tok_per_s_median": _median(tps), "tok_per_cpu_s_median": _median(cps),
                         "tok_per_s_min": min(tps),
                         "tok_per_s_max": max(tps), "seconds_median": _median([r["seconds"] for r in rs]),
                         "runs": rs}
    ratios: dict[str, Any] = {}
    for mode in modes:
        for storage in ("float32", "bfloat16"):
            r = paired_ratio(runs, f"ours-{mode}-{storage}", f"plain-{mode}")
            if r:
                r["overhead"] = 1.0 - r["median_of_paired"]
                ratios[f"capture_{mode}_{storage}_vs_plain"] = r
        r = paired_ratio(runs, f"ours-{mode}-float32", "common-eager")
        if r:
            ratios[f"ours_{mode}_float32_vs_common"] = r
    for mode in modes:
        r = paired_ratio(runs, "common-eager", f"plain-{mode}")
        if r:
            r["overhead"] = 1.0 - r["median_of_paired"]
            ratios[f"common_vs_plain_{mode}"] = r
    return {"configs": configs, "ratios": ratios}


def bytes_per_token(runs: dict[str, list[dict]], layers: int, hidden: int) -> dict:
    """Measured bytes per captured row (RPC payload and returned tensors) beside the arithmetic."""
    out = {}
    for storage, elt in (("float32", 4), ("bfloat16", 2)):
        rows = [r for name, rs in runs.items() if name.startswith("ours-") and name.endswith(storage)
                for r in rs]
        entry: dict[str, Any] = {"hidden_bytes_per_token_arithmetic": layers * hidden * elt}
        if rows:
            r = rows[0]
            entry["rpc_payload_bytes_per_forwarded_row"] = r["payload_bytes"] / r["rows_forwarded"]
            entry["returned_bytes_per_row"] = r["hidden_bytes"] / r["rows"]
        out[storage] = entry
    common = runs.get("common-eager")
    if common:
        r = common[0]
        out["common_float32_pickle"] = {
            "hidden_bytes_per_token_arithmetic": layers * hidden * 4,
            "rpc_payload_bytes_per_forwarded_row": r["payload_bytes"] / r["rows_forwarded"],
            "returned_bytes_per_row": r["hidden_bytes"] / r["rows"],
        }
    return out


def check_targets(throughput: dict, multistep: dict | None) -> list[dict]:
    ratios = throughput["ratios"]
    out = []
    r = ratios.get("capture_compiled_float32_vs_plain")
    if r:
        out.append({"name": "capture overhead, compiled (fp32 storage)", "target": "<= 5%",
                    "measured": r["overhead"], "met": r["overhead"] <= TARGETS["capture_overhead_compiled"]})
    r = ratios.get("capture_compiled_bfloat16_vs_plain")
    if r:
        out.append({"name": "capture overhead, compiled (bf16 storage)", "target": "<= 5%",
                    "measured": r["overhead"], "met": r["overhead"] <= TARGETS["capture_overhead_compiled"]})
    r = ratios.get("ours_compiled_float32_vs_common") or ratios.get("ours_eager_float32_vs_common")
    if r:
        out.append({"name": f"speed-up over the common approach ({r['num']} / {r['den']})",
                    "target": ">= 1.5x", "measured": r["median_of_paired"],
                    "met": r["median_of_paired"] >= TARGETS["speedup_vs_common"]})
    if multistep:
        v = multistep["ours"]["vs_token_minimum"]
        out.append({"name": "multi-step forwarded prompt tokens / token minimum", "target": "<= 1.05",
                    "measured": v, "met": v is not None and v <= TARGETS["multistep_vs_minimum"]})
    return out


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def _x(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def markdown(result: dict) -> str:
    meta, thr = result["meta"], result["throughput"]
    wl = meta["profile"]["workload"]
    lines = [
        f"# Capture benchmark ({meta['profile']['name']})",
        "",
        f"Command: `{meta['command']}`  ",
        f"Model: {meta['model']['name']} ({meta['profile']['model_dtype']}), captured layers "
        f"{meta['profile']['layers']} (hidden {meta['model']['hidden_size']}).  ",
        f"Workload: {wl['num_prompts']} prompts x n={wl['n']} x {wl['max_tokens']} tokens "
        f"(ignore_eos), {meta['profile']['reps']} interleaved repeats per config, all engines "
        "alive in one process (in-process engine core).  ",
        f"Machine: {meta['cpu_count']} CPUs, load average {meta['loadavg_start'][0]:.1f} at start, "
        f"{meta['loadavg_end'][0]:.1f} at end; run took {meta['duration_seconds']:.0f} s. "
        f"vLLM {meta['versions']['vllm']}, torch {meta['versions']['torch']}.",
        "",
        "## Throughput",
        "",
        "| config | generated tok/s (median) | min-max | s/run | tok per CPU-s | rows returned | "
        "RPC bytes/row |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, c in thr["configs"].items():
        r0 = c["runs"][0]
        rows = r0.get("rows")
        bpr = (r0["payload_bytes"] / r0["rows_forwarded"]) if r0.get("payload_bytes") else None
        lines.append(f"| {name} | {c['tok_per_s_median']:.1f} | {c['tok_per_s_min']:.1f}-"
                     f"{c['tok_per_s_max']:.1f} | {c['seconds_median']:.2f} | "
                     f"{_num(c['tok_per_cpu_s_median'])} | "
                     f"{rows if rows is not None else '-'} | {f'{bpr:.0f}' if bpr else '-'} |")
    lines += ["", "| throughput ratio | median of per-repeat pairs | ratio of medians | "
              "same, CPU time |", "|---|---:|---:|---:|"]
    for key, r in thr["ratios"].items():
        lines.append(f"| {r['num']} / {r['den']} | {_x(r['median_of_paired'])} | "
                     f"{_x(r['ratio_of_medians'])} | {_x(r['cpu_time_median_of_paired'])} |")
    lines += ["", "Where the time goes (median seconds per pass): inside vLLM's `generate` (forward passes, "
              "including worker-side recording), the capture fetch RPC (+ decode / unpickle), and our "
              "engine-side assembly (placing rows, prefix-store fill, results).", "",
              "| config | total | vLLM generate | fetch | assembly |", "|---|---:|---:|---:|---:|"]
    for name, c in thr["configs"].items():
        def med(key: str) -> str:
            vals = [r[key] for r in c["runs"] if r.get(key) is not None]
            return f"{_median(vals):.2f}" if vals else "-"
        lines.append(f"| {name} | {c['seconds_median']:.2f} | {med('vllm_generate_seconds')} | "
                     f"{med('fetch_seconds')} | {med('assembly_seconds')} |")
    mem = result["memory"]
    lines += ["", "## Memory", "", "| storage | hidden bytes/token (L x H x size) | RPC bytes/row | "
              "returned bytes/row |", "|---|---:|---:|---:|"]
    for key, e in mem["bytes_per_token"].items():
        rpc = e.get("rpc_payload_bytes_per_forwarded_row")
        ret = e.get("returned_bytes_per_row")
        lines.append(f"| {key} | {e['hidden_bytes_per_token_arithmetic']} | "
                     f"{f'{rpc:.0f}' if rpc else '-'} | {f'{ret:.0f}' if ret else '-'} |")
    if mem.get("peak_rss"):
        lines += ["", f"Peak RSS ({mem['method']})", "",
                  "| config (eager) | RSS ready MiB | run peak MiB | run delta MiB | lifetime peak (VmHWM) MiB | "
                  "rows returned |", "|---|---:|---:|---:|---:|---:|"]
        for e in mem["peak_rss"]:
            if "error" in e:
                lines.append(f"| {e['config']} | error: {e['error'][:80]} | | | | |")
                continue
            lines.append(f"| {e['config']} | {e['rss_ready_mb']:.0f} | {e['run_peak_rss_mb']:.0f} | "
                         f"{e['run_delta_mb']:.0f} | {e['vm_hwm_mb']:.0f} | {e['rows'] or '-'} |")
    else:
        lines += ["", f"Peak RSS: {mem['method']}"]
    ms = result.get("multistep")
    if ms:
        w = ms["workload"]
        lines += ["", "## Multi-step online best-of-n", "",
                  f"{w['num_questions']} questions x {w['candidates']} candidates x {w['steps']} steps "
                  f"(one line each, <= {w['max_step_tokens']} tokens), block size {ms['block_size']}.", "",
                  "| policy | prompt tokens forwarded | token minimum | x token min | block minimum | "
                  "x block min | rows from store | rows recomputed |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for key in ("ours", "reset"):
            p = ms[key]
            lines.append(f"| {p['policy']} | {p['prompt_tokens_forwarded']} | {p['token_minimum']} | "
                         f"{_x(p['vs_token_minimum'])} | {p['block_minimum']} | {_x(p['vs_block_minimum'])} | "
                         f"{p['rows_from_store']} | {p['rows_recomputed']} |")
        lines.append(f"\nReset policy forwards {_x(ms['reset_vs_ours_forwarded'])} the prompt tokens of ours "
                     f"({_x(ms['reset_vs_global_token_minimum'])} the global token minimum).")
    lines += ["", "## Targets", "", "| target | goal | measured | met |", "|---|---|---:|---|"]
    for t in result["targets"]:
        v = t["measured"]
        shown = _pct(v) if "overhead" in t["name"] else _x(v)
        lines.append(f"| {t['name']} | {t['target']} | {shown} | {'yes' if t['met'] else 'NO'} |")
    lines += ["", "## Notes", ""] + [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


def performance_section(result: dict) -> str:
    """The short README "Performance" section: key ratios, the command, where the full table is."""
    meta, thr, ms = result["meta"], result["throughput"], result.get("multistep")
    wl = meta["profile"]["workload"]
    ratios = thr["ratios"]
    cfgs = thr["configs"]

    def tps(name: str) -> str:
        c = cfgs.get(name)
        return "n/a" if c is None else f"{c['tok_per_s_median']:.0f}"

    lines = [
        "## Performance",
        "",
        f"Measured with `{meta['command']}` on {meta['cpu_count']} CPU cores "
        f"(vLLM {meta['versions']['vllm']} CPU, {meta['model']['name']} in {meta['profile']['model_dtype']}, "
        f"{len(meta['profile']['layers'])} captured layers {meta['profile']['layers']}; "
        f"{wl['num_prompts']} prompts x n={wl['n']} x {wl['max_tokens']} tokens; "
        f"{meta['profile']['reps']} interleaved repeats; load average "
        f"{meta['loadavg_start'][0]:.1f} -> {meta['loadavg_end'][0]:.1f}; "
        f"{meta['duration_seconds'] / 60:.1f} min). Full table: `experiments/results/bench/"
        f"{meta['profile']['name']}.md`.",
        "",
        "| measure | result | target |",
        "|---|---:|---|",
    ]
    for mode in meta["profile"]["modes"]:
        for storage in ("float32", "bfloat16"):
            r = ratios.get(f"capture_{mode}_{storage}_vs_plain")
            if r:
                lines.append(f"| capture overhead, {mode}, {storage} storage "
                             f"({tps(r['num'])} vs {tps(r['den'])} tok/s) | {_pct(r['overhead'])} | "
                             f"{'<= 5%' if mode == 'compiled' else '-'} |")
    for mode in meta["profile"]["modes"]:
        r = ratios.get(f"ours_{mode}_float32_vs_common")
        if r:
            lines.append(f"| ours ({mode}) vs the common approach (eager hooks + pickled fp32) "
                         f"| {_x(r['median_of_paired'])} | {'>= 1.5x' if mode == 'compiled' else '-'} |")
    bpt = result["memory"]["bytes_per_token"]
    for storage in ("float32", "bfloat16"):
        e = bpt.get(storage, {})
        if e.get("returned_bytes_per_row"):
            lines.append(f"| bytes per captured token, {storage} | {e['returned_bytes_per_row']:.0f} "
                         f"(RPC {e['rpc_payload_bytes_per_forwarded_row']:.0f}) | - |")
    for e in result["memory"].get("peak_rss") or []:
        if "error" not in e:
            lines.append(f"| peak RSS added by the run, {e['config']} | {e['run_delta_mb']:.0f} MiB "
                         f"(peak {e['run_peak_rss_mb']:.0f} MiB) | - |")
    if ms:
        o, r = ms["ours"], ms["reset"]
        lines.append(f"| multi-step best-of-n: prompt tokens forwarded / token minimum | "
                     f"{_x(o['vs_token_minimum'])} ({o['prompt_tokens_forwarded']} / {o['token_minimum']}) "
                     "| <= 1.05x |")
        lines.append(f"| same / block-granular minimum (vLLM's floor, block {ms['block_size']}) | "
                     f"{_x(o['vs_block_minimum'])} | - |")
        lines.append(f"| reset prefix cache every step: prompt tokens forwarded vs ours | "
                     f"{_x(ms['reset_vs_ours_forwarded'])} | - |")
        lines.append(f"| rows filled from the store / recomputed (multi-step, ours) | "
                     f"{o['rows_from_store']} / {o['rows_recomputed']} | - |")
    return "\n".join(lines) + "\n"
