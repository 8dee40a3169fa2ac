"""Tasks: offline data as pure functions (split, index, batch_size, seed) -> batch."""

from ._base import (
    AbstractTask as AbstractTask,
    AbstractTextTask as AbstractTextTask,
    DataNotFoundError as DataNotFoundError,
)
from ._corpus import (
    SHAKESPEARE_SHA256 as SHAKESPEARE_SHA256,
    default_data_dir as default_data_dir,
)
from ._dataset import (
    CorpusError as CorpusError,
    DatasetError as DatasetError,
    dataset_identity as dataset_identity,
    open_dataset as open_dataset,
    prepare_text as prepare_text,
    sha256_file as sha256_file,
    verify_dataset as verify_dataset,
)
from ._digits import Digits as Digits
from ._registry import TASKS as TASKS, TaskSpec as TaskSpec, make_task as make_task
from ._synthetic import CopyTask as CopyTask, SortTask as SortTask
from ._text import (
    FALLBACKS as FALLBACKS,
    PythonStdlibChar as PythonStdlibChar,
    ShakespeareChar as ShakespeareChar,
)
from ._tokenizer import TOKENIZER_FILE as TOKENIZER_FILE, bpe_tokenizer as bpe_tokenizer
from ._tokens import Tokens as Tokens
