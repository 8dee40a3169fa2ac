"""Tasks by name."""

from collections.abc import Callable

from ._base import AbstractTask
from ._digits import Digits
from ._synthetic import CopyTask, SortTask
from ._text import PythonStdlibChar, ShakespeareChar
from ._tokens import Tokens

TASKS: dict[str, Callable[..., AbstractTask]] = {
    "shakespeare_char": ShakespeareChar,
    "stdlib_char": PythonStdlibChar,
    "digits": Digits,
    "copy": CopyTask,
    "sort": SortTask,
    "tokens": Tokens,
}


def make_task(name: str, **kwargs) -> AbstractTask:
    """The task ``TASKS[name](**kwargs)``.

    Raises:
        ValueError: ``name`` is not a known task.
    """
    if name not in TASKS:
        raise ValueError(f"Unknown task {name!r}; expected one of {sorted(TASKS)}.")
    return TASKS[name](**kwargs)
