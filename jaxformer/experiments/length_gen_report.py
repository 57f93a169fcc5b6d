"""What the length-generalisation study writes: results.json, Markdown tables (one per task)
and a plot (one panel per task) of exact-match accuracy against input length.

``results["rows"][scheme][task]["accuracy"]`` is [seed][length] (None where the scheme cannot
run at that length); ``summarize`` adds ``mean`` and ``std`` over the seeds, per length.
"""

from __future__ import annotations

import pathlib

import numpy as np

from jaxformer.experiments.report import near_best, seed_stats, variant_notes, write_files


def summarize(results: dict) -> dict:
    """Adds mean and std (ddof=1; None with one seed) over the seeds to every (scheme, task)."""
    for per_task in results["rows"].values():
        for row in per_task.values():
            row["mean"], row["std"] = seed_stats(row["accuracy"])
    return results


def range_stats(results: dict, scheme: str, task: str, trained: bool):
    """(mean, std) over the seeds of each seed's mean accuracy over the training lengths
    (trained=True) or the longer ones; None where a length in the range has no score, or
    the range holds no evaluation length."""
    cut = results["train_max_len"]
    picked = [i for i, n in enumerate(results["eval_lengths"]) if (n <= cut) == trained]
    per_seed = [[acc[i] for i in picked] for acc in results["rows"][scheme][task]["accuracy"]]
    if not picked or any(None in s for s in per_seed):
        return None, None
    means = [float(np.mean(s)) for s in per_seed]
    return float(np.mean(means)), (float(np.std(means, ddof=1)) if len(means) > 1 else None)


def _cell(mean, std, bold=False) -> str:
    if mean is None:
        return "n/a"
    text = f"{mean:.2f}" if std is None else f"{mean:.2f} ± {std:.2f}"
    return f"**{text}**" if bold else text


def task_table(results: dict, task: str) -> str:
    """Schemes x evaluation lengths for one task (mean ± std), then the mean over the
    training lengths and over the longer ones, bold where within one std of the best."""
    lengths, cut = results["eval_lengths"], results["train_max_len"]
    head = ["scheme"] + [f"{n}" if n <= cut else f"{n}*" for n in lengths]
    head += [f"mean 1..{cut}", f"mean > {cut}"]
    lines = [f"### {task}", "", "| " + " | ".join(head) + " |",
             "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    ranges = {trained: {s: range_stats(results, s, task, trained) for s in results["rows"]}
              for trained in (True, False)}
    tops = {trained: near_best(stats) for trained, stats in ranges.items()}
    for scheme, per_task in results["rows"].items():
        row = per_task[task]
        cells = [{"none": "none (NoPE)"}.get(scheme, scheme)]
        cells += [_cell(m, s) for m, s in zip(row["mean"], row["std"])]
        cells += [_cell(*ranges[t][scheme], bold=scheme in tops[t]) for t in (True, False)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(results: dict) -> str:
    """Every task's table, then what the numbers are."""
    seeds, cut = results["seeds"], results["train_max_len"]
    notes = [
        f"Exact-match accuracy of greedy decoding on {results['eval_examples']} examples per "
        f"length (input symbols; digits per operand for addition), the same for every scheme. "
        f"Models trained on lengths 1..{cut}; * marks lengths beyond them.",
        "n/a: the example does not fit the learned position table (or, scored at random "
        "positions, train.random_positions).",
        positions_note(results.get("config", {})),
        *variant_notes(results.get("models", {})),
        "mean 1..L / mean > L: each seed's mean over those lengths, then mean ± std over seeds."
        " Bold: the best scheme and every scheme within one standard deviation of it (the "
        "larger of the two): differences among the bold ones are smaller than the seed "
        "spread." + ("" if len(seeds) > 1 else " With one seed there is no spread to compare "
                     "against, so only the best is bold: run with --seeds N."),
        f"Seeds {', '.join(map(str, seeds))}" + (
            ": mean ± sample standard deviation (ddof=1)." if len(seeds) > 1 else "."),
        f"Wall time {results['seconds']:.0f} s.",
    ]
    tables = "\n\n".join(task_table(results, task) for task in results["tasks"])
    return tables + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"


def positions_note(config: dict) -> str:
    """How the examples' position ids were given, from the study's resolved config."""
    study, train = config.get("study", {}), config.get("train", {})
    kind, offset = study.get("task_positions", "index"), study.get("position_offset", 0)
    note = {"index": "Position ids 0, 1, 2, ... along each example",
            "coupled": "Position ids coupled by significance (Cho et al. 2024)",
            "abacus": "Abacus position ids (McLeish et al. 2024)"}[kind]
    if kind != "index":
        note += f", start offsets 0..{offset} in training, 0 in evaluation"
    if train.get("random_positions"):
        note += (f"; in training{' and evaluation' if study.get('eval_random_positions') else ''}"
                 f" a sorted random subset of [0, {train['random_positions']}) (Ruoss et al. 2023)")
    return note + "."


def draw(results: dict, axes) -> None:
    """Accuracy against length, one line per scheme, on one matplotlib Axes per task; the
    training lengths shaded."""
    lengths, cut = results["eval_lengths"], results["train_max_len"]
    for ax, task in zip(axes, results["tasks"]):
        ax.axvspan(0.5, cut + 0.5, color="gray", alpha=0.15, label=f"training lengths 1..{cut}")
        for scheme, per_task in results["rows"].items():
            row = per_task[task]
            xs = [n for n, m in zip(lengths, row["mean"]) if m is not None]
            ys = [m for m in row["mean"] if m is not None]
            err = [s for s, m in zip(row["std"], row["mean"]) if m is not None]
            ax.errorbar(xs, ys, yerr=None if None in err else err, marker="o", markersize=4,
                        capsize=3, label={"none": "none (NoPE)"}.get(scheme, scheme))
        ax.set_xlim(0.5, lengths[-1] + 0.5)
        ax.set_ylim(-0.03, 1.03)
        ax.set_title(task)
        ax.set_xlabel("input length (symbols)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("exact-match accuracy")
    axes[-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def write_outputs(results: dict, out_dir) -> dict[str, pathlib.Path]:
    """results.json, results.md and length_gen.png (one panel per task) in out_dir."""
    n = len(results["tasks"])
    return write_files(results, out_dir, markdown=markdown(results), plot="length_gen.png",
                       figsize=(3.6 * n + 1.8, 3.8), draw_on=lambda fig: draw(
                           results, fig.subplots(1, n, sharey=True, squeeze=False)[0]))
