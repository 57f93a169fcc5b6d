"""jaxformer.experiments.grpo_addition end to end at toy sizes: the fine-tune resumes chunk
by chunk until its target (here never reached: every chunk runs), then GRPO, then both
scored."""

import json

from jaxformer.experiments import grpo_addition


def test_the_experiment_fine_tunes_in_chunks_then_runs_grpo(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(grpo_addition, "MODEL", [  # one narrow layer: smaller programs
        "model.preset=tiny", "model.d_model=32", "model.n_layers=1", "model.n_heads=2",
        "model.max_seq_len=32", "model.vocab_size=257"])
    assert grpo_addition.main(["--out", str(tmp_path), "--target", "2", "--sft-chunk", "2",
                               "--sft-steps", "3", "--grpo-steps", "1", "--prompts", "2",
                               "--inner", "1", "--quiet"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["sft_steps"] == 3 and row["grpo_steps"] == 1
    assert 0 <= row["sft_accuracy"] <= 1 and 0 <= row["grpo_accuracy"] <= 1
    metrics = [json.loads(x) for x in open(tmp_path / "seed0" / "grpo" / "metrics.jsonl")]
    assert any("reward_mean" in m for m in metrics)
    steps = sorted(int(p.name) for p in (tmp_path / "seed0" / "sft" / "checkpoints").iterdir())
    assert steps[-1] == 3
