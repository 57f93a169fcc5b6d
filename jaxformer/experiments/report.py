"""What the positional-encoding study writes: results.json, a Markdown table and a plot.

Each row of ``results["rows"]`` holds ``ppl``, one list per seed of the perplexity at each
evaluation length (None where the scheme cannot run), and after ``summarize`` its
``mean`` and ``std`` over the seeds (sample standard deviation, ddof=1; None with one seed).
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from jaxformer.positions.schemes import POSITION_SCHEMES


def seed_stats(per_seed: list[list]) -> tuple[list, list]:
    """(mean, std) over the seeds of [seed][length] values, per length: None where any seed
    has None; std is the sample standard deviation (ddof=1), None with one seed."""
    columns = list(zip(*per_seed))  # [lengths][seeds]
    mean = [None if None in c else float(np.mean(c)) for c in columns]
    std = [None if None in c or len(c) < 2 else float(np.std(c, ddof=1)) for c in columns]
    return mean, std


def near_best(stats: dict[str, tuple], *, lower_is_better: bool = False) -> set[str]:
    """The keys of {key: (mean, std)} whose mean is the best, or within one std of it (the
    larger of the two sample stds): differences among them are smaller than the seed
    spread. With one seed (std None) only the best; a None mean is never in."""
    scored = {k: v for k, v in stats.items() if v[0] is not None}
    if not scored:
        return set()
    sign = -1.0 if lower_is_better else 1.0
    best = max(scored, key=lambda k: sign * scored[k][0])
    top, top_std = scored[best]
    return {k for k, (m, s) in scored.items()
            if k == best or (s is not None and top_std is not None and
                             sign * (top - m) <= max(s, top_std))}


def summarize(results: dict) -> dict:
    """Adds mean and std over the seeds to every row (None where any seed has None)."""
    for row in results["rows"].values():
        row["mean"], row["std"] = seed_stats(row["ppl"])
        if "train_loss" in row:
            losses = row["train_loss"]
            row["train_loss_mean"] = None if None in losses else float(np.mean(losses))
    return results


def _num(x: float) -> str:
    return f"{x:.2f}" if abs(x) < 1e4 else f"{x:.3g}"


def _cell(mean, std, bold=False) -> str:
    if mean is None:
        return "n/a"
    text = _num(mean) if std is None else f"{_num(mean)} ± {_num(std)}"
    return f"**{text}**" if bold else text


def _label(multiple: int) -> str:
    return "L" if multiple == 1 else f"{multiple}L"


def position_of(row: dict) -> str:
    """A row's position scheme: its own record, or (results written before model variants
    were columns) its column's name."""
    return row.get("position", row["scheme"])


def variant_notes(columns: dict[str, dict]) -> list[str]:
    """One note per column that is a model variant ({name: its row or record, holding
    about, layers and position}), saying what it is."""
    return [f"{name}: {c['about']} (layers: {c['layers']}; position={c['position']})"
            for name, c in columns.items() if c.get("about")]


def row_title(name: str, row: dict) -> str:
    if row["scaling"] is None:
        return {"none": "none (NoPE)"}.get(name, name)
    return f"{row['scheme']} + {row['scaling']} (at eval only)"


def markdown_table(results: dict) -> str:
    """One row per scheme (and RoPE scaling), one column per evaluation length."""
    mults, lengths, rows = results["eval_multiples"], results["eval_lengths"], results["rows"]
    ratio = 1 in mults and len(mults) > 1
    head = ["scheme", "params", "train loss"] + [f"{_label(m)} = {n}" for m, n in
                                                zip(mults, lengths)]
    head += [f"{_label(mults[-1])} / L"] if ratio else []
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    tops = [near_best({name: (row["mean"][i], row["std"][i]) for name, row in rows.items()},
                      lower_is_better=True) for i in range(len(lengths))]
    for name, row in rows.items():
        loss = (f"({row['scheme']}'s)" if "train_loss" not in row else
                "n/a" if row["train_loss_mean"] is None else f"{row['train_loss_mean']:.3f}")
        cells = [row_title(name, row), f"{row['params']:,}", loss]
        cells += [_cell(m, s, name in top) for m, s, top in zip(row["mean"], row["std"], tops)]
        if ratio:
            first, last = row["mean"][mults.index(1)], row["mean"][-1]
            cells.append("n/a" if first is None or last is None else f"{last / first:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    seeds = results["seeds"]
    notes = [
        f"Validation perplexity per token (lower is better) of models trained at L = "
        f"{results['train_len']} tokens, on the same {results['eval_tokens']:,} validation "
        f"tokens at every length, cut into non-overlapping windows of that length "
        "(each token sees the tokens before it in its window).",
        "train loss: mean over the last log interval of training, in nats per token.",
    ]
    for scheme in sorted({r["scheme"] for r in rows.values()}):
        if POSITION_SCHEMES[position_of(rows[scheme])].max_length is not None:  # a table
            notes.append(f"{scheme}: its position table has L rows, so it cannot run beyond L "
                         "(n/a).")
    notes += variant_notes({name: row for name, row in rows.items() if row["scaling"] is None})
    for name, row in rows.items():
        if row["scaling"] is not None:
            notes.append(f"{row_title(name, row)}: the trained {row['scheme']} model, evaluated "
                         f"at nL with {row['scaling']} scaling of factor n "
                         "(original length L); nothing retrained.")
    if ratio:
        notes.append(f"{_label(mults[-1])} / L: perplexity at the longest length over that at L; "
                     "below 1 means the extra context helps (the scheme extrapolates).")
    notes.append("Bold: the best at each length and every row within one standard deviation "
                 "of it (the larger of the two): differences among the bold ones are smaller "
                 "than the seed spread." + ("" if len(seeds) > 1 else " With one seed there is "
                                            "no spread, so only the best: run with --seeds N."))
    notes.append(f"Seeds {', '.join(map(str, seeds))}" + (
        ": mean ± sample standard deviation (ddof=1) over the seeds." if len(seeds) > 1 else "."))
    notes.append(f"Data: {results['data']}. Wall time {results['seconds']:.0f} s.")
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"


def draw(results: dict, ax) -> None:
    """Perplexity against evaluation length, one line per row, on a matplotlib Axes."""
    from matplotlib.ticker import ScalarFormatter

    lengths = results["eval_lengths"]
    for name, row in results["rows"].items():
        xs = [n for n, m in zip(lengths, row["mean"]) if m is not None]
        ys = [m for m in row["mean"] if m is not None]
        err = [s for s, m in zip(row["std"], row["mean"]) if m is not None]
        err = None if None in err else err
        ax.errorbar(xs, ys, yerr=err, marker="o" if len(xs) > 1 else "s", capsize=3,
                    markersize=5 if len(xs) > 1 else 9, label=row_title(name, row),
                    linestyle="--" if row["scaling"] else "-")
    ax.axvline(results["train_len"], color="gray", linestyle=":", label="training length L")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.tick_params(axis="y", which="minor", labelsize=7)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("validation perplexity")
    ax.set_title(f"Positional encodings trained at L = {results['train_len']}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the plot


def write_files(results: dict, out_dir, *, markdown: str, plot: str, figsize,
                draw_on) -> dict[str, pathlib.Path]:
    """results.json, results.md (the text `markdown`) and the PNG `plot` in out_dir (created
    if needed); draw_on(figure) draws the plot."""
    from matplotlib.figure import Figure  # no pyplot: leaves any notebook backend alone

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "markdown": out / "results.md", "plot": out / plot}
    paths["json"].write_text(json.dumps(results, indent=1, allow_nan=False) + "\n")
    paths["markdown"].write_text(markdown)
    fig = Figure(figsize=figsize)
    draw_on(fig)
    fig.tight_layout()
    fig.savefig(paths["plot"], dpi=110)
    return paths


def write_outputs(results: dict, out_dir) -> dict[str, pathlib.Path]:
    """results.json, results.md and positions.png in out_dir."""
    return write_files(results, out_dir, markdown=markdown_table(results), plot="positions.png",
                       figsize=(9, 4.5), draw_on=lambda fig: draw(results, fig.subplots()))
