"""GRPO's task rewards (jaxformer.training.rewards): task:copy's target on prompts full of
spaces, newlines and '=' signs, built here around a known word."""

import numpy as np

from jaxformer.training.rewards import Reward, copy_target

rng = np.random.default_rng()  # reseeded for each test by conftest's rng fixture

FILLER = "ab= \n=x"  # a prompt's text before the word: spaces, newlines and '=' signs
WORD = "abcxyz=+-"  # the copied word: no space or newline, '=' signs in it


def text(alphabet: str, low: int, high: int) -> str:
    """A random string of alphabet's characters, its length in [low, high)."""
    return "".join(rng.choice(list(alphabet), int(rng.integers(low, high))))


def test_copy_takes_the_text_after_the_last_space_or_newline_before_the_final_equals():
    """A prompt FILLER + (space or newline) + WORD + '=' targets WORD, whatever spaces,
    newlines and '=' signs FILLER and WORD hold; a completion equal to it scores 1, one
    with a character more or less 0; a prompt not ending in '=' has no target."""
    prompts, words = [], []
    for _ in range(200):
        filler = text(FILLER, 1, 30) + " \n=" * int(rng.integers(1, 3))  # several of each
        word = text(WORD, 1, 8)
        word += "=" * (word.count("=") == 0 and rng.random() < 0.5)  # '=' ending it, too
        prompts.append(filler + rng.choice([" ", "\n"]) + word + "=")
        words.append(word)
        assert copy_target(prompts[-1]) == word, (prompts[-1], word)
        assert copy_target(prompts[-1] + text("ab \n", 1, 4).strip() + "x") is None
    scores = Reward("task:copy")(prompts * 3, [*words, *(w + "x" for w in words),
                                               *(w[:-1] for w in words)], [None] * 600)
    assert scores == [1.0] * 200 + [0.0] * 400
