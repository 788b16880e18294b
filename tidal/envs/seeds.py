"""The seeds of the episodes an embodied run, ``tidal sft`` and ``tidal eval`` reset, in one place
(all after ``runner.seed``), so that what must show the same episodes does and what must not
does not:

- training env ``i``: ``seed + i // env.group_size`` (the envs of a group share one);
- evaluation env ``i`` (numbered over all env ranks): ``seed + EVALUATION + i``, the evaluation
  after epoch ``e`` offset by ``e * EVALUATION_STRIDE``; ``tidal sft`` evaluates on the first
  evaluation's episodes, so its number and the training run's first one are comparable;
- ``tidal eval``'s episodes: ``seed + HELD_OUT + i``, far from both, so two policies (after
  ``tidal sft`` and after ``tidal train``) are compared on episodes neither has seen.
"""

EVALUATION = 10**6
EVALUATION_STRIDE = 7919  # a prime: the offsets of later evaluations never meet training's
HELD_OUT = 5 * 10**6


def training_seeds(seed: int, first: int, count: int, group_size: int = 1) -> list[int]:
    """Training envs ``first .. first + count - 1`` (numbered over all env ranks): the envs of a
    group of ``group_size`` share their group's seed."""
    return [seed + (first + i) // group_size for i in range(count)]


def evaluation_seeds(seed: int, count: int, first: int = 0) -> list[int]:
    """The first evaluation's seeds of eval envs ``first .. first + count - 1``."""
    return [seed + EVALUATION + first + i for i in range(count)]


def evaluation_offset(epoch: int) -> int:
    """What the evaluation after ``epoch`` training epochs adds to every eval env's seed."""
    return epoch * EVALUATION_STRIDE


def held_out_seeds(seed: int, count: int) -> list[int]:
    """``tidal eval``'s episodes."""
    return [seed + HELD_OUT + i for i in range(count)]
