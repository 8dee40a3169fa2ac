"""Tasks by name: the one table of the built-in tasks and the options each is built from."""

import dataclasses
from collections.abc import Callable

from ._base import AbstractTask
from ._digits import Digits
from ._synthetic import CopyTask, SortTask
from ._text import PythonStdlibChar, ShakespeareChar
from ._tokens import Tokens


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """A registered task.

    Attributes:
        make: its constructor.
        options: the keyword arguments ``make`` takes, named as the fields of the
            configuration's ``task`` section (``ocformer.config.TaskConfig``) they are
            read from.
    """

    make: Callable[..., AbstractTask]
    options: tuple[str, ...]


TASKS: dict[str, TaskSpec] = {
    "shakespeare_char": TaskSpec(ShakespeareChar, ("seq_len", "data_dir", "fallback")),
    "stdlib_char": TaskSpec(PythonStdlibChar, ("seq_len",)),
    "digits": TaskSpec(Digits, ("patch_size",)),
    "copy": TaskSpec(CopyTask, ("seq_len", "vocab_size")),
    "sort": TaskSpec(SortTask, ("seq_len", "vocab_size")),
    "tokens": TaskSpec(Tokens, ("path", "seq_len")),
}


def make_task(name: str, **kwargs) -> AbstractTask:
    """The task ``TASKS[name].make(**kwargs)``.

    Raises:
        ValueError: ``name`` is not a known task.
    """
    if name not in TASKS:
        raise ValueError(f"Unknown task {name!r}; expected one of {sorted(TASKS)}.")
    return TASKS[name].make(**kwargs)
