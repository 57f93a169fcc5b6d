"""model.loss_chunk across the objectives table (jaxformer.training.objectives): an entry
whose hooks chunk their loss (Objective.loss_chunk) takes it, every other refuses it at
config time in one line naming the objective and the setting, never training silently
on the whole logits. Parametrised over the table, so an objective added later is
checked too."""

import pytest

from jaxformer.model.config import ConfigError
from jaxformer.training import load_config, objectives
from jaxformer.training.chunked_loss import ChunkedLanguageModel
from tests.training.test_objectives import needs, run  # noqa: F401  (run: a fixture)


@pytest.mark.parametrize("name", list(objectives.OBJECTIVES))
def test_loss_chunk_is_taken_or_refused_by_each_objective(name, run):  # noqa: F811
    args = [*needs(name, run), f"objective.name={name}", "model.loss_chunk=8"]
    if not objectives.OBJECTIVES[name].loss_chunk:
        with pytest.raises(ConfigError) as err:
            load_config(None, args)
        message = str(err.value)
        assert "\n" not in message
        for words in (f"model.loss_chunk=8 with objective.name={name}", "objective.name lm"):
            assert words in message, message
        load_config(None, args[:-1])  # the same run without it loads
        return
    cfg = load_config(None, args)
    assert cfg.train.loss_chunk == 8
    assert isinstance(objectives.build(cfg), ChunkedLanguageModel)


def test_a_fine_tune_from_weights_takes_loss_chunk(run):  # noqa: F811
    """SFT (lm on prompt/completion records, from train.init_from's model) chunks its loss:
    model.loss_chunk moves to train before init_from's model fills the model section."""
    cfg = load_config(None, ["data.format=prompt_completion", "data.path=p.jsonl",
                             f"train.init_from={run}", "model.loss_chunk=8"])
    assert cfg.train.loss_chunk == 8 and cfg.model.d_model == 32  # the run's model
    assert isinstance(objectives.build(cfg), ChunkedLanguageModel)
