"""Classification of scikit-learn's bundled 8x8 handwritten digits."""

import functools
from typing import ClassVar, Literal, cast, final

import numpy as np

from .._counts import whole_number
from ._base import AbstractTask, batch_rng, check_batch_args, check_rows, check_split

NUM_VALIDATION = 297  # 1797 images: 1500 for training, 297 held out.
_SPLIT_SEED = 20240601  # fixed: the split never depends on a run's seed


@functools.lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits
    from sklearn.utils import Bunch

    # The default return_X_y=False returns a Bunch; sklearn leaves the union untyped.
    data = cast(Bunch, load_digits())
    images = (data.images / 16.0).astype(np.float32)  # pixel values 0..16 -> [0, 1]
    labels = data.target.astype(np.int32)
    order = np.random.default_rng(_SPLIT_SEED).permutation(len(labels))
    return images[order], labels[order]


@final
class Digits(AbstractTask):
    """8x8 digit images, ten classes, tokens are non-overlapping patches (ViT style).

    ``load_digits`` ships with scikit-learn, so the task needs no download. The images
    are shuffled once with a fixed seed; the last 297 are the validation split. A batch
    draws ``batch_size`` distinct images of its split; the validation set
    (``eval_batches``) takes the held-out images in turn, each once.

    Args:
        patch_size: side of the square patches; must divide 8. The transformer sees
            (8 / patch_size)^2 patch tokens plus a class token.
    """

    kind: ClassVar[Literal["classification"]] = "classification"
    vocab_size: None = None
    image_shape: ClassVar[tuple[int, int]] = (8, 8)

    def __init__(self, patch_size: int = 4):
        if (whole := whole_number(patch_size)) is None or whole < 1 or 8 % whole:
            raise ValueError(
                f"patch_size must be a positive integer dividing 8 (1, 2, 4 or 8), got "
                f"{patch_size!r}."
            )
        self.patch_size = whole
        self.num_classes = 10
        self.seq_len = (8 // whole) ** 2 + 1
        images, labels = _digits()
        cut = len(labels) - NUM_VALIDATION
        self.splits = {
            "train": (images[:cut], labels[:cut]),
            "validation": (images[cut:], labels[cut:]),
        }

    def batch(self, split: str, index: int, batch_size: int, seed: int) -> dict[str, np.ndarray]:
        return self.batch_rows(split, index, batch_size, seed, slice(None))

    def batch_rows(
        self, split: str, index: int, batch_size: int, seed: int, rows: slice
    ) -> dict[str, np.ndarray]:
        check_split(split)
        check_batch_args(index, batch_size, seed)
        rows = check_rows(rows, batch_size)
        images, labels = self.splits[split]
        if batch_size > len(labels):
            raise ValueError(
                f"batch_size={batch_size} exceeds the {len(labels)} images of the {split} split."
            )
        pick = batch_rng(split, index, seed).choice(len(labels), size=batch_size, replace=False)
        pick = pick[rows]
        return {"inputs": images[pick], "targets": labels[pick]}

    def eval_batches(self, batch_size: int, num_batches: int, seed: int = 0) -> list[dict]:
        """The held-out images themselves: in an order fixed by ``seed``, batch after
        batch, each image once until all 297 are taken (3 batches of 99 are the split
        exactly); past 297 the order starts again, and the training command warns that
        images repeat. (Independent random batches covered 205 of the 297, some three
        times.)"""
        if (whole_number(num_batches) or 0) < 1:
            raise ValueError(f"num_batches must be an integer >= 1, got {num_batches!r}.")
        check_batch_args(0, batch_size, seed)
        images, labels = self.splits["validation"]
        if batch_size > len(labels):
            raise ValueError(
                f"batch_size={batch_size} exceeds the {len(labels)} images of the validation split."
            )
        order = batch_rng("validation", 0, seed).permutation(len(labels))
        picks = np.resize(order, (num_batches, batch_size))  # cycles through the order
        return [{"inputs": images[p], "targets": labels[p]} for p in picks]
