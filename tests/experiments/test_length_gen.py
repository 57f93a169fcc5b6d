"""The length-generalisation study: its tasks against Python's arithmetic, its packing, its
one-pass exact match against greedy decoding, its vmapped seeds against separate runs, and
the command line end to end with its report (jaxformer.experiments.length_gen_report)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import ModelConfig, Transformer
from jaxformer.decode import generate, init_cache
from jaxformer.experiments import length_gen, tasks
from jaxformer.experiments.seeds import seed_slice, train_seeds
from jaxformer.training.optim import OptimConfig, make_optimizer
from jaxformer.training.step import init_state, make_train_step

DIGITS = "0123456789"


def text(example):
    """An example's tokens as a string: digits, '+', '=', '$' (end), a task letter."""
    names = {tasks.PLUS: "+", tasks.EQUALS: "=", tasks.EOS: "$", tasks.MARKERS["copy"]: "C",
             tasks.MARKERS["reverse"]: "R", tasks.MARKERS["addition"]: "A"}
    return "".join(names[int(t)] if int(t) in names else DIGITS[int(t) - tasks.DIGIT]
                   for t in example)


@pytest.mark.parametrize("task", tasks.TASKS)
def test_examples_are_right(rng, task):
    n = int(rng.integers(1, 12))
    for ex in tasks.make_examples(task, n, 20, rng):
        s = text(ex)
        assert len(ex) == tasks.example_tokens(task, n) and s[-1] == "$"
        prompt, answer = s[1:-1].split("=")
        assert s[tasks.answer_start(task, n)] == answer[0]
        if task == "copy":
            assert answer == prompt and len(prompt) == n
        elif task == "reverse":
            assert answer == prompt[::-1]
        else:  # least significant digit first, in the operands and the sum
            a, b = prompt.split("+")
            total = int(a[::-1]) + int(b[::-1])
            assert len(a) == len(b) == n and len(answer) == n + 1
            assert int(answer[::-1]) == total


def test_pack_segments_positions_and_answer_mask(rng):
    task = str(rng.choice(tasks.TASKS))
    lengths = rng.integers(1, 6, 12)
    examples = tasks.sample_examples(task, lengths, rng)
    starts = tasks.answer_start(task, lengths)
    b = tasks.pack(examples, starts, row_len=40)
    seen = 0
    for r in range(len(b["inputs"])):
        for seg in np.unique(b["segment_ids"][r][b["segment_ids"][r] > 0]):
            where = np.flatnonzero(b["segment_ids"][r] == seg)
            i = b["example"][r, where[0]]
            ex, seen = examples[i], seen + 1
            assert (np.diff(where) == 1).all() and len(where) == len(ex) - 1
            np.testing.assert_array_equal(b["positions"][r, where], np.arange(len(ex) - 1))
            np.testing.assert_array_equal(b["inputs"][r, where], ex[:-1])
            np.testing.assert_array_equal(b["targets"][r, where], ex[1:])
            # the loss covers exactly the answer: '=' onwards is the input, answer the target
            masked = b["targets"][r, where][b["loss_mask"][r, where] > 0]
            np.testing.assert_array_equal(masked, ex[starts[i]:])
        pad = b["segment_ids"][r] == 0
        assert (b["loss_mask"][r, pad] == 0).all() and (b["inputs"][r, pad] == tasks.PAD).all()
    assert seen == len(examples)


def test_one_pass_exact_match_is_greedy_decoding(rng):
    """Answers that are the model's own greedy continuations all count as solved; change
    one token of an answer and that example does not."""
    cfg = ModelConfig(vocab_size=tasks.VOCAB_SIZE, d_model=32, n_layers=2, n_heads=4,
                      max_seq_len=32, position=str(rng.choice(["rope", "t5", "fire", "none"])))
    model = Transformer(cfg)
    params = model.init(jax.random.key(int(rng.integers(1 << 30))),
                        jnp.zeros((1, 8), jnp.int32))["params"]
    params = jax.tree.map(lambda x: x + 0.3 * rng.standard_normal(x.shape, np.float32), params)
    n, count = 3, 6
    prompts = tasks.make_examples("copy", n, count, rng)[:, :tasks.answer_start("copy", n)]
    out = generate(model, params, prompts, max_new_tokens=n + 1, rng=jax.random.key(0),
                   temperature=0.0)
    examples = [np.concatenate([p, np.asarray(t)]) for p, t in zip(prompts, out.tokens)]
    wrong = int(rng.integers(count))
    examples[wrong] = examples[wrong].copy()
    k = len(prompts[0]) + int(rng.integers(n + 1))
    examples[wrong][k] = (examples[wrong][k] + 1) % tasks.VOCAB_SIZE
    stacked = jax.tree.map(lambda x: x[None], params)
    solved = length_gen.exact_match(cfg, stacked, examples, [len(prompts[0])] * count,
                                    row_len=32, batch_tokens=64)
    np.testing.assert_array_equal(solved[0], np.arange(count) != wrong)


def test_vmapped_seeds_train_like_separate_runs(rng):
    cfg = ModelConfig(vocab_size=tasks.VOCAB_SIZE, d_model=16, n_layers=1, n_heads=2,
                      max_seq_len=24, position="t5")
    optim, steps, seeds = OptimConfig(lr=3e-3, warmup_steps=1), 3, [int(rng.integers(99)), 7]

    def batch(seed, step):
        return tasks.train_batch("reverse", 3, 4, 24, np.random.default_rng([seed, step]))

    params, _ = train_seeds(cfg, optim, steps, seeds, batch, log_every=steps, log=lambda *a: 0)
    model = Transformer(cfg)
    tx, schedule = make_optimizer(optim, cfg, steps)
    step_fn = make_train_step(model, tx, schedule)
    for i, seed in enumerate(seeds):
        state = init_state(model, tx, seed)
        for step in range(steps):
            state, _ = step_fn(state, batch(seed, step))
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6),
                     seed_slice(params, i), state.params)


def test_command_line_writes_results(tmp_path, capsys):
    out = tmp_path / "lg"
    code = length_gen.main(["--small", "study.schemes=learned,alibi", "study.tasks=copy",
                            "train.steps=4", "study.eval_lengths=1,2,12", "--seeds", "2",
                            "--out", str(out)])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert results["tasks"] == ["copy"] and len(results["seeds"]) == 2
    assert results["train_max_len"] == 3 and results["eval_lengths"] == [1, 2, 12]
    learned, alibi = results["rows"]["learned"]["copy"], results["rows"]["alibi"]["copy"]
    assert [a[2] for a in learned["accuracy"]] == [None, None]  # 25 slots: beyond the table of 24
    assert learned["mean"][2] is None and all(0 <= a <= 1 for a in learned["mean"][:2])
    acc = np.asarray(alibi["accuracy"])
    np.testing.assert_allclose(alibi["mean"], acc.mean(0))
    np.testing.assert_allclose(alibi["std"], acc.std(0, ddof=1))
    assert (out / "results.md").read_text().startswith("#") and (out / "length_gen.png").stat().st_size


@pytest.mark.parametrize("args, words", [
    (["study.task=copy"], ["study.task", "tasks"]),
    (["model.position=rope"], ["model.position", "study.schemes"]),
    (["study.tasks=copy,multiply"], ["multiply", "addition"]),
    (["train.seq_len=8"], ["train.seq_len=8", "train_max_len"]),
])
def test_bad_config_exits_2_naming_it(capsys, args, words):
    assert length_gen.main(["--small", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and all(w in err for w in words), err


def small_config(task: str, seed: int, *overrides) -> length_gen.LengthGenConfig:
    """--small at one scheme and task, 4 steps logged every 2 (the reported loss is the mean
    of steps 3 and 4), seeds train.seed = `seed` and seed + 1."""
    return length_gen.load_config(str(length_gen.DEFAULT_CONFIG), [
        *length_gen.SMALL, "study.schemes=alibi", f"study.tasks={task}", "train.steps=4",
        "train.log_every=2", "study.seeds=2", f"train.seed={seed}", "study.eval_lengths=1,2",
        "study.progress=false", *overrides])


def separate_runs(mcfg, optim, steps: int, seeds, batch):
    """Each seed trained alone by the plain (not vmapped) train step on batch(seed, step):
    [(its final params, its loss at every step)], one per seed."""
    model = Transformer(mcfg)
    tx, schedule = make_optimizer(optim, mcfg, steps)
    step_fn = make_train_step(model, tx, schedule, grad_accum=optim.grad_accum)
    runs = []
    for seed in seeds:
        state, losses = init_state(model, tx, seed), []
        for step in range(steps):
            state, metrics = step_fn(state, batch(seed, step))
            losses.append(float(metrics["loss"]))
        runs.append((state.params, losses))
    return runs


def assert_each_seed_trained_alone(params, runs):
    """Seed i's slice of vmapped params equals the params of separate_runs' run i."""
    for i, (alone, _) in enumerate(runs):
        # atol 1e-5: a param whose gradient is ~0 takes Adam steps of sign(rounding) (seen
        # 2.7e-6 apart with JAXFORMER_TEST_SEED=118387609); another seed's batches move
        # params by ~1e-2
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-5),
                     seed_slice(params, i), alone)


def task_batches(cfg: length_gen.LengthGenConfig, task: str):
    """batch(seed, step): the training batch the study documents for a seed, drawn here."""
    t = cfg.run.train
    return lambda seed, step: tasks.train_batch(task, cfg.study.train_max_len, t.batch_size,
                                                t.seq_len, length_gen.train_rng(seed, task, step))


def training_batches(cfg, task, monkeypatch):
    """The study's own training-batch function for `task`, (seed, step) -> batch, as
    train_task hands it to train_seeds (captured there: nothing is trained)."""
    captured = {}

    def capture(mcfg, optim, steps, seeds, batch, **kwargs):
        captured["batch"] = batch
        return None, [None] * len(seeds)

    monkeypatch.setattr(length_gen, "train_seeds", capture)
    length_gen.train_task(cfg, cfg.model_config("alibi"), task, [0, 1], log=lambda *a: None)
    return captured["batch"]


def test_training_lengths_are_1_to_train_max_len_inclusive(rng, monkeypatch):
    """The study's training batches hold examples of every input length 1..train_max_len
    and of no other: each packed segment read back as an example of `task`."""
    task, max_len = str(rng.choice(tasks.TASKS)), int(rng.integers(2, 7))
    cfg = small_config(task, int(rng.integers(1000)), f"study.train_max_len={max_len}")
    batches = training_batches(cfg, task, monkeypatch)
    split = tasks.PLUS if task == "addition" else tasks.EQUALS  # after the first operand
    lengths = []
    for seed in rng.integers(0, 1 << 30, 3):
        for step in rng.integers(0, 1 << 20, 10):
            b = batches(int(seed), int(step))
            for seg, inputs, targets in zip(b["segment_ids"], b["inputs"], b["targets"]):
                for s in np.unique(seg[seg > 0]):
                    x, y = inputs[seg == s], targets[seg == s]
                    n = int(np.flatnonzero(x == split)[0]) - 1  # digits between marker and it
                    assert x[0] == tasks.MARKERS[task] and y[-1] == tasks.EOS
                    assert len(x) == tasks.example_tokens(task, n) - 1, (n, x)
                    lengths.append(n)
    assert set(lengths) == set(range(1, max_len + 1)), (max_len, np.bincount(lengths))


def test_study_reports_each_seeds_mean_loss_over_the_last_log_interval(rng):
    """results["train"][scheme][task]["loss"][i] is seed i's loss averaged over the steps of
    the last log interval (3 and 4), as the plain train step gives it for that seed alone
    on its own batches."""
    task, seed = str(rng.choice(tasks.TASKS)), int(rng.integers(1000))
    cfg = small_config(task, seed)
    results = length_gen.run_study(cfg)
    assert results["seeds"] == [seed, seed + 1]
    runs = separate_runs(cfg.model_config("alibi"), cfg.run.optim, cfg.run.train.steps,
                         results["seeds"], task_batches(cfg, task))
    want = [np.mean(losses[2:]) for _, losses in runs]
    # vmapped and alone agree to ~1e-7; the seeds differ by ~1e-2
    np.testing.assert_allclose(results["train"]["alibi"][task]["loss"], want, rtol=1e-5)


def test_each_vmapped_seed_trains_on_its_own_batches(rng):
    """Seed i of the study's vmapped training (train.seed first) has the params of seed i
    trained alone on seed i's batches, which differ from the other seed's."""
    task, seed = str(rng.choice(tasks.TASKS)), int(rng.integers(1000))
    cfg = small_config(task, seed)
    seeds, batch = [seed, seed + 1], task_batches(cfg, task)
    assert not np.array_equal(batch(seeds[0], 0)["inputs"], batch(seeds[1], 0)["inputs"])
    params, _ = length_gen.train_task(cfg, cfg.model_config("alibi"), task, seeds,
                                      log=lambda *a: None)
    runs = separate_runs(cfg.model_config("alibi"), cfg.run.optim, cfg.run.train.steps, seeds,
                         batch)
    assert_each_seed_trained_alone(params, runs)


# ---- task position ids (position coupling, Abacus) --------------------------------------

def test_coupled_and_abacus_ids_on_hand_written_examples():
    """A 9 1 7 + 2 3 4 = ... : the papers' ids written out by hand (Cho et al.: '+' and '='
    take start, digits of one significance share start + place; McLeish et al.: each
    digit's place in its number, non-digits 0), with a training offset of 5."""
    ids = lambda task, kind, offset=0: tasks.example_positions(task, 3, kind, offset).tolist()  # noqa: E731
    #            A  a1 a2 a3 +  b1 b2 b3 =  s1 s2 s3 s4 $
    assert ids("addition", "coupled") == [0, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 5, 0]
    assert ids("addition", "coupled", 5) == [0, 7, 8, 9, 6, 7, 8, 9, 6, 7, 8, 9, 10, 0]
    assert ids("addition", "abacus") == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 4, 0]
    assert ids("addition", "abacus", 5) == [0, 6, 7, 8, 0, 6, 7, 8, 0, 6, 7, 8, 9, 0]
    #            R  x1 x2 x3 =  x3 x2 x1 $
    assert ids("reverse", "coupled") == [0, 2, 3, 4, 1, 4, 3, 2, 0]
    assert ids("copy", "coupled") == [0, 2, 3, 4, 1, 2, 3, 4, 0]
    assert ids("copy", "abacus", 2) == [0, 3, 4, 5, 0, 3, 4, 5, 0]
    assert ids("copy", "index") == list(range(9))


@pytest.mark.parametrize("position, impl", [("rope", "blockwise"), ("learned", "chunked"),
                                            ("alibi", "xla")])
def test_ids_out_of_row_order_mask_by_index(rng, position, impl):
    """With coupled ids, '=' (id start) comes after digits of larger ids: a model with
    ordered_positions=False still sees them (changing an operand digit changes the logits
    at '='), and stays causal (a prefix's logits are the logits of the prefix alone)."""
    cfg = ModelConfig(vocab_size=tasks.VOCAB_SIZE, d_model=32, n_layers=2, n_heads=4,
                      max_seq_len=32, position=position, attention_impl=impl)
    model = Transformer(cfg, ordered_positions=False)
    ex = tasks.make_examples("addition", 4, 1, rng)[0]
    pos = tasks.example_positions("addition", 4, "coupled", int(rng.integers(0, 8)))
    tokens, pos = jnp.asarray(ex[None]), jnp.asarray(pos[None])
    params = model.init(jax.random.key(int(rng.integers(1 << 30))), tokens)["params"]
    logits = lambda x, p: np.asarray(model.apply({"params": params}, x, positions=p))  # noqa: E731
    full = logits(tokens, pos)
    eq = tasks.answer_start("addition", 4) - 1  # the '=' token
    digit = int(rng.integers(1, 5))  # an operand digit, its id above '=''s
    changed = tokens.at[0, digit].set(tasks.DIGIT + (int(ex[digit]) - tasks.DIGIT + 1) % 10)
    assert np.abs(logits(changed, pos)[0, eq] - full[0, eq]).max() > 1e-4
    p = int(rng.integers(2, len(ex)))
    np.testing.assert_allclose(logits(tokens[:, :p], pos[:, :p]), full[:, :p], rtol=1e-5,
                               atol=1e-5)
    with pytest.raises(ValueError, match="ordered_positions=False.*not with a KV cache"):
        model.apply({"params": params}, tokens, pos, cache=init_cache(cfg, 1, 32))


@pytest.mark.parametrize("args, words", [
    (["study.task_positions=coupled", "train.random_positions=64"],
     ["random_positions=64", "task_positions=coupled", "both set the position ids"]),
    (["study.schemes=learned", "study.task_positions=abacus", "study.position_offset=40"],
     ["position_offset=40", "learned table's 31 rows"]),
    (["study.task_positions=fixed"], ["task_positions", "coupled", "abacus"]),
    (["study.eval_random_positions=true"], ["eval_random_positions", "train.random_positions"]),
])
def test_bad_position_settings_exit_2_naming_them(capsys, args, words):
    assert length_gen.main(["--small", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and all(w in err for w in words), err


# ---- evaluation at random positions (Ruoss et al.) --------------------------------------

def test_eval_random_positions_are_sorted_distinct_draws_below_max(rng, monkeypatch):
    """study.eval_random_positions: the ids the evaluation scores each example at (those
    accuracy hands to exact_match) are, per example, one id per token, strictly increasing
    (so distinct), in [0, train.random_positions), and not one draw for all examples;
    the same ids for every scheme."""
    task, top = str(rng.choice(tasks.TASKS)), int(rng.integers(24, 48))
    longest = max(n for n in range(1, top) if tasks.example_tokens(task, n) <= top)
    lengths = sorted({int(rng.integers(1, longest)), longest})
    cfg = small_config(task, 0, f"train.random_positions={top}",
                       "study.eval_random_positions=true", "study.schemes=alibi,rope",
                       "study.eval_lengths=" + ",".join(map(str, lengths)))
    seen = []

    def capture(mcfg, params, examples, starts, row_len, batch_tokens, positions=None):
        seen.append((examples, positions))
        return np.ones((1, len(examples)), bool)

    monkeypatch.setattr(length_gen, "exact_match", capture)
    for scheme in ("alibi", "rope"):
        length_gen.accuracy(cfg, cfg.model_config(scheme), None, task)
    (examples, ids), (_, other) = seen
    assert ids is not None and len(ids) == len(examples) == len(lengths) * 16
    for ex, pos in zip(examples, ids):
        assert len(pos) == len(ex), (len(pos), len(ex))
        assert (np.diff(pos) > 0).all() and pos.min() >= 0 and pos.max() < top, (top, pos)
    assert len({tuple(p) for p in ids[:16]}) > 1  # a fresh draw per example (n < longest)
    for a, b in zip(ids, other):
        np.testing.assert_array_equal(a, b)


def hand_built_ids(task, example, kind, offset):
    """An example's coupled or abacus ids read off its tokens, as the papers define them:
    abacus, each digit's place in its run of digits (1, 2, ...) plus the offset, other
    tokens 0; coupled, start = 1 + offset for '+' and '=', the i-th digit of a run
    start + i, except reverse's answer, whose i-th digit copies input digit n + 1 - i;
    the marker and end 0."""
    start, ids, place, run = 1 + offset, [], 0, 0
    after_input = tasks.PLUS if task == "addition" else tasks.EQUALS
    n = int(np.flatnonzero(example == after_input)[0]) - 1  # the input length
    for tok in example:
        if tasks.DIGIT <= tok < tasks.DIGIT + 10:
            place += 1
            answer = run == (2 if task == "addition" else 1)  # the third or second run
            if kind == "abacus":
                ids.append(offset + place)
            else:
                ids.append(start + (n + 1 - place if task == "reverse" and answer else place))
        else:
            run, place = run + (place > 0), 0
            ids.append(start if kind == "coupled" and tok in (tasks.PLUS, tasks.EQUALS) else 0)
    return np.asarray(ids)


def segments(batch):
    """Each packed example of a batch: (its tokens, its input slots' position ids)."""
    for r, seg in enumerate(batch["segment_ids"]):
        for s in np.unique(seg[seg > 0]):
            where = seg == s
            example = np.append(batch["inputs"][r, where], batch["targets"][r, where][-1])
            yield example, batch["positions"][r, where]


@pytest.mark.parametrize("kind", ["coupled", "abacus"])
def test_training_batches_carry_each_examples_drawn_offset(rng, monkeypatch, kind):
    """study.position_offset=K: every example of the study's training batches has the
    hand-built ids of its tokens at one offset k in 0..K, drawn per example (every k
    occurs, and several within one batch); the evaluation's ids have offset 0."""
    task, most = str(rng.choice(tasks.TASKS)), int(rng.integers(2, 6))
    cfg = small_config(task, int(rng.integers(1000)), f"study.task_positions={kind}",
                       f"study.position_offset={most}")
    batches = training_batches(cfg, task, monkeypatch)
    offsets = []
    for step in rng.integers(0, 1 << 20, 6):
        drawn = []
        for ex, ids in segments(batches(int(rng.integers(1 << 30)), int(step))):
            fit = [k for k in range(most + 1)
                   if np.array_equal(ids, hand_built_ids(task, ex, kind, k)[:-1])]
            assert len(fit) == 1, (ex, ids)
            drawn += fit
        assert len(set(drawn)) > 1, drawn  # per example, not per batch
        offsets += drawn
    assert set(offsets) == set(range(most + 1)), np.bincount(offsets)
    n = int(rng.integers(1, 6))
    ex = tasks.make_examples(task, n, 1, rng)[0]
    np.testing.assert_array_equal(length_gen.eval_positions(cfg, task, [n])[0],
                                  hand_built_ids(task, ex, kind, 0))


def test_pack_gives_each_input_slot_its_tokens_id(rng):
    """tasks.pack with explicit coupled or abacus ids: the slot holding token p of an
    example (as input) holds that token's hand-built id, for examples of mixed lengths
    and offsets packed several to a row."""
    task, kind = str(rng.choice(tasks.TASKS)), str(rng.choice(["coupled", "abacus"]))
    lengths, offsets = rng.integers(1, 6, 12), rng.integers(0, 8, 12)
    examples = tasks.sample_examples(task, lengths, rng)
    ids = [tasks.example_positions(task, int(n), kind, int(k)) for n, k in zip(lengths, offsets)]
    b = tasks.pack(examples, tasks.answer_start(task, lengths), row_len=40, positions=ids)
    seen = 0
    for r in range(len(b["inputs"])):
        for s in np.unique(b["segment_ids"][r][b["segment_ids"][r] > 0]):
            where = b["segment_ids"][r] == s
            i = b["example"][r, where][0]
            np.testing.assert_array_equal(b["inputs"][r, where], examples[i][:-1])
            want = hand_built_ids(task, examples[i], kind, int(offsets[i]))[:-1]
            np.testing.assert_array_equal(b["positions"][r, where], want)
            seen += 1
    assert seen == len(examples)
