"""Did the run learn? The verdicts a finished run's row carries (`learned`, `not_learned_why`,
with what they were judged against): a run can be `ok` as a run and still not have learned
(diverged, stuck at chance), and the row says so and why. The runner applies them after
training; the report draws a run that did not learn hollow and says why."""

from __future__ import annotations

import math
from typing import Any


def classifier(test_acc, train_loss, num_classes: int, n_test: int) -> dict[str, Any]:
    """Did a classifier learn? Its test accuracy above chance (1 / classes) by more than two
    binomial standard deviations of the samples evaluated, and its last training loss below
    ln(classes), the loss of predicting every class alike (the unigram loss of balanced
    classes). A diverged or stuck run is `ok` as a run but says here that it did not learn, and
    why."""
    chance = 1.0 / num_classes
    margin = 2 * math.sqrt(chance * (1 - chance) / max(1, n_test))
    out: dict[str, Any] = {"chance_acc": chance, "test_samples": n_test}
    why = []
    if test_acc is None or not math.isfinite(test_acc):
        return out  # never evaluated: nothing to say
    if test_acc <= chance + margin:
        why.append(f"test_acc {test_acc:.4f} is not above chance {chance:.4f} by 2 sigma "
                   f"({margin:.4f} over {n_test} samples)")
    uniform = math.log(num_classes)
    if train_loss is None or not math.isfinite(train_loss) or train_loss >= uniform:
        why.append(f"train loss {train_loss:.4g} is not below ln({num_classes}) = {uniform:.3f}, "
                   "the loss of predicting every class alike")
    out["learned"] = not why
    if why:
        out["not_learned_why"] = "; ".join(why)
    return out


def language_model(test_loss, unigram_loss: float | None) -> dict[str, Any]:
    """Did a language model learn? Its validation loss below the loss of the data's unigram
    distribution (the best a model that ignores context does on the same tokens)."""
    out: dict[str, Any] = {}
    if test_loss is None or not math.isfinite(test_loss) or unigram_loss is None:
        if test_loss is not None and not math.isfinite(test_loss):
            out.update(learned=False, not_learned_why=f"validation loss is {test_loss}")
        return out
    out["test_ppl"] = math.exp(test_loss) if test_loss < 700 else math.inf  # exp overflows
    out["learned"] = test_loss < unigram_loss
    if not out["learned"]:
        out["not_learned_why"] = (f"validation loss {test_loss:.4f} is not below the unigram "
                                  f"loss {unigram_loss:.4f} (a model that ignores context)")
    return out
