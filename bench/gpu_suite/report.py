"""bench/gpu.py's results as Markdown: the device's peaks, then one table per section
(a row that did not run says why)."""

from __future__ import annotations

from typing import Callable


def fmt(x, spec: str) -> str:
    return "" if x is None else format(x, spec)


def table(title: str, header: list[str], rows: list[dict], cells: Callable) -> str:
    lines = [f"## {title}", "", "| " + " | ".join(header) + " |",
             "|" + "---|" * len(header)]
    for r in rows:
        if r.get("status", "ok") == "ok":
            lines.append("| " + " | ".join(cells(r)) + " |")
        else:
            keys = [str(r.get(k, "")) for k in ("mask", "model", "seq", "impl", "remat", "batch",
                                                      "precision", "chunk", "operands")
                    if k in r]
            lines.append("| " + " | ".join(keys) + " | " + r["status"] + " |")
    return "\n".join(lines) + "\n"


def device_lines(res: dict) -> list[str]:
    d = res["device"]
    return [f"# bench/gpu.py{' --smoke' if res['smoke'] else ''}: {d['device_kind']} x"
            f"{d['device_count']} ({d['backend']}), jax {d['jax']}", "",
            f"- bf16 matmul, measured: {d['matmul_bf16_flops_measured'] / 1e12:,.2f} TFLOP/s; "
            f"data sheet: " + (f"{d['peak_bf16_flops_datasheet'] / 1e12:,.0f} TFLOP/s"
                               if d["peak_bf16_flops_datasheet"] else "unknown"),
            f"- copy bandwidth, measured: {d['copy_bytes_per_s_measured'] / 1e9:,.1f} GB/s", ""]


def attention_table(rows: list[dict]) -> str:
    return table("Attention (bf16; error against the float32 reference)",
                 ["mask", "T", "impl", "max err", "fwd ms", "fwd+bwd ms"], rows, lambda r: [
                     r["mask"], str(r["seq"]), r["impl"], f"{r['max_err']:.2e}",
                     f"{r['fwd_ms']:.2f}", f"{r['fwd_bwd_ms']:.2f}"])


def tests_section(t: dict) -> str:
    return f"## cuDNN tests\n\n{t['status']}{': ' + t['summary'] if 'summary' in t else ''}\n"


def train_table(rows: list[dict]) -> str:
    return table("Train step (bf16 compute, float32 params, scan)",
                 ["model", "T", "remat", "batch", "step ms", "tokens/s", "TFLOP/s",
                  "MFU (data sheet)", "MFU (measured matmul)", "step GiB (compiled)",
                  "compile s"], rows, lambda r: [
                     r["model"], str(r["seq"]), r["remat"], str(r["batch"]),
                     f"{r['step_ms']:.1f}", f"{r['tokens_per_s']:,.0f}",
                     f"{r['model_tflops']:.2f}", fmt(r["mfu_datasheet"], ".1%"),
                     fmt(r["mfu_measured"], ".1%"), f"{r['step_gib_compiled']:.2f}",
                     f"{r['compile_s']:.1f}"])


def decode_table(rows: list[dict]) -> str:
    return table("Decode (greedy, bf16 params and cache)",
                 ["model", "batch", "prompt + new", "tokens/s", "roofline tokens/s",
                  "of roofline", "compile s"], rows, lambda r: [
                     r["model"], str(r["batch"]), f"{r['prompt']} + {r['new_tokens']}",
                     f"{r['tokens_per_s']:,.0f}", f"{r['roofline_tokens_per_s']:,.0f}",
                     f"{r['of_roofline']:.1%}", f"{r['compile_s']:.1f}"])


def serve_table(rows: list[dict]) -> str:
    return table("Serving engine (greedy, bf16 params, continuous batching, paged cache)",
                 ["model", "sequences", "prompt + new", "tokens/s", "roofline tokens/s",
                  "of roofline", "compile s"], rows, lambda r: [
                     r["model"], str(r["sequences"]), f"{r['prompt']} + {r['new_tokens']}",
                     f"{r['tokens_per_s']:,.0f}", f"{r['roofline_tokens_per_s']:,.0f}",
                     f"{r['of_roofline']:.1%}", f"{r['compile_s']:.1f}"])


def precision_table(rows: list[dict]) -> str:
    return table("Train step by matmul precision (bf16 compute, float32 master weights, "
                 "remat dots; loss after the stated steps on one batch stream)",
                 ["model", "precision", "T", "batch", "step ms", "tokens/s", "speed-up",
                  "MFU (data sheet)", "MFU (measured matmul)", "steps", "loss", "step GiB"],
                 rows, lambda r: [
                     r["model"], r["precision"], str(r["seq"]), str(r["batch"]),
                     f"{r['step_ms']:.1f}", f"{r['tokens_per_s']:,.0f}",
                     fmt(r.get("speedup"), ".2f") + "x", fmt(r["mfu_datasheet"], ".1%"),
                     fmt(r["mfu_measured"], ".1%"), str(r["steps"]), f"{r['loss']:.3f}",
                     f"{r['step_gib_compiled']:.2f}"])


def chunk_table(rows: list[dict]) -> str:
    return table("Chunked loss (model.loss_chunk; 0: the plain loss)",
                 ["model", "vocab", "T", "batch", "loss chunk", "step GiB (compiled)",
                  "of plain", "tokens/s", "loss"], rows, lambda r: [
                     r["model"], f"{r['vocab']:,}", str(r["seq"]), str(r["batch"]),
                     str(r["chunk"]), f"{r['step_gib_compiled']:.2f}",
                     fmt(r.get("peak_of_plain"), ".1%"), fmt(r["tokens_per_s"], ",.0f"),
                     fmt(r["loss"], ".3f")])


def moe_table(rows: list[dict]) -> str:
    return table("MoE train step (dropless; MFU on active parameters) and grouped matmuls",
                 ["shape", "params", "active", "experts / top-k / width", "T", "batch",
                  "tokens/s", "MFU (data sheet)", "MFU (measured matmul)", "step GiB",
                  "grouped max rel err"], rows, lambda r: [
                     r["model"], f"{r['params'] / 1e9:.2f}B", f"{r['active_params'] / 1e9:.2f}B",
                     f"{r['experts']} / {r['top_k']} / {r['expert_d_ff']}", str(r["seq"]),
                     str(r["batch"]), f"{r['tokens_per_s']:,.0f}", fmt(r["mfu_datasheet"], ".1%"),
                     fmt(r["mfu_measured"], ".1%"), f"{r['step_gib_compiled']:.2f}",
                     ", ".join(f"{k} {v:.1e}" for k, v in r["grouped_max_err"].items())]) + \
        "\n" + table("ragged_dot forward by operand type (the step's rows, float32 results)",
                     ["shape", "operands", "ms", "TFLOP/s", "in the compiled matmul",
                      "max rel err"],
                     [{"model": r["model"], "operands": k, **v} for r in rows
                      for k, v in r.get("ragged_dot_operands", {}).items()], lambda o: [
                         o["model"], o["operands"], f"{o['ms']:.3f}", f"{o['tflops']:.1f}",
                         "yes" if o["in_matmul"] else "no (converted)",
                         f"{o['max_err']:.1e}"])


def mla_table(rows: list[dict]) -> str:
    return table("MLA (absorbed, latent cache) against GQA decoding (greedy, bf16)",
                 ["attention", "batch", "prompt + new", "ms / step", "tokens/s", "cache MiB",
                  "of roofline"], rows, lambda r: [
                     r["model"], str(r["batch"]), f"{r['prompt']} + {r['new_tokens']}",
                     f"{r['ms_per_step']:.2f}", f"{r['tokens_per_s']:,.0f}",
                     f"{r['cache_bytes'] / 2**20:,.1f}", f"{r['of_roofline']:.1%}"])


def decode_profile_table(rows: list[dict]) -> str:
    """The decode step's ops (section 10), then each row's top ops by time."""
    text = table("Decode step profile (batch 1; per step, the prefill counted among them)",
                 ["model", "prompt + new", "ops / step", "busy ms / step", "span ms / step",
                  "idle", "traced ms / step", "untraced ms / step", "ops from",
                  "command buffers traced"], rows,
                 lambda r: [
                     r["model"], f"{r['prompt']} + {r['new_tokens']}",
                     f"{r['ops_per_step']:.0f}", f"{r['busy_ms_per_step']:.3f}",
                     f"{r['span_ms_per_step']:.3f}", f"{r['idle_share']:.1%}",
                     f"{r['traced_wall_ms_per_step']:.3f}",
                     f"{r['untraced_wall_ms_per_step']:.3f}", r["op_source"],
                     "yes" if r["graphs_traced"] else "no"])
    for r in rows:
        if r.get("top_ops"):
            text += "\n" + table(f"Top ops of the decode step ({r['model']})",
                          ["op", "ms / step", "per step", "share of busy"], r["top_ops"],
                          lambda o: [o["op"], f"{o['ms_per_step']:.3f}",
                                     f"{o['per_step']:.1f}", f"{o['share_of_busy']:.1%}"])
    return text


SECTION_TABLES = {"attention": attention_table, "tests": tests_section, "train": train_table,
                  "decode": decode_table, "serve": serve_table, "precision": precision_table,
                  "loss_chunk": chunk_table, "moe": moe_table,
                  "mla_decode": mla_table,
                  "decode_profile": decode_profile_table}  # each section's results -> its Markdown


def markdown(res: dict) -> str:
    return "\n".join(device_lines(res) + [SECTION_TABLES[s](res[s]) for s in SECTION_TABLES
                                          if s in res])
