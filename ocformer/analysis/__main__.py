"""``python -m ocformer.analysis convergence ...``: measured orders of convergence.

Example:
    python -m ocformer.analysis convergence --schemes lie,strang --steps 4,8,16,32,64 \\
        --json orders.json --formulation projected --plot orders.png
    python -m ocformer.analysis convergence --formulation relaxed --relaxation-eps 0.01 \\
        --schemes kvaerno3,kencarp3 --steps 4,8,16,32,64
"""

# ruff: noqa: E402 (the imports after the first wait for the command's Ctrl-C handler)
from .._cli import record_interrupts

if __name__ == "__main__":  # before JAX loads: a Ctrl-C meanwhile is noted, not lost
    record_interrupts()

import argparse
import json
import math
import re
import sys

from .._cli import add_compile_cache_option, exit_with, fail
from ..checkpointing import atomic_write_text, output_problem
from ..training import enable_compile_cache

# Importing the study makes no array, so 64-bit JAX, enabled in main before anything
# is computed, still applies.
from ._convergence import (
    MAX_REFERENCE_STEPS_PER_LAYER,
    REFERENCE_FACTOR,
    STUDY_FORMULATIONS,
)

_PROGRAM = "ocformer.analysis"


def _option(match: re.Match) -> str:
    """``name=value`` of a keyword argument as the command line's ``--name value``."""
    return f"--{match.group(1).replace('_', '-')} {match.group(2)}"


def _listed(text: str, parse, what: str, example: str) -> list:
    """Comma-separated distinct values, each through ``parse``; at least one. Raises
    ``argparse.ArgumentTypeError`` (argparse names the option) for a value that does not
    parse, one given twice, or an empty list."""
    values = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        try:
            values.append(parse(item))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{item!r} is not {what}; give comma-separated values, e.g. {example}"
            ) from None
    if not values:
        raise argparse.ArgumentTypeError(f"no values given; give e.g. {example}")
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(
            f"{', '.join(map(str, repeated))} given twice; the points of a fit must differ, "
            f"e.g. {example}"
        )
    return values


# The finest grid a study takes: its reference solves REFERENCE_FACTOR times as many.
MAX_STEPS_PER_LAYER = MAX_REFERENCE_STEPS_PER_LAYER // REFERENCE_FACTOR


def _steps(text: str) -> list[int]:
    """Steps per layer: positive integers up to ``MAX_STEPS_PER_LAYER``."""

    def parse(item: str) -> int:
        value = int(item)
        if not 1 <= value <= MAX_STEPS_PER_LAYER:
            raise ValueError(item)
        return value

    what = (
        f"a whole number of steps from 1 to {MAX_STEPS_PER_LAYER} (the reference takes "
        f"{REFERENCE_FACTOR} times the finest)"
    )
    return _listed(text, parse, what, "4,8,16,32,64")


def _names(text: str) -> list[str]:
    """Comma-separated names; commas inside parentheses belong to the name, as in
    ``strang(1,0,2)``."""
    if text.count("(") != text.count(")"):
        raise argparse.ArgumentTypeError(
            f"unbalanced parentheses in {text!r}; a sequence is written e.g. strang(1,0,2)"
        )
    names = [m.strip() for m in re.findall(r"(?:[^,(]|\([^)]*\))+", text) if m.strip()]
    if not names:
        raise argparse.ArgumentTypeError("no scheme given; give e.g. lie,strang")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"{', '.join(twice)} given twice in {text!r}")
    return names


def _epsilons(text: str) -> list[float]:
    """Positive, finite epsilons."""

    def parse(item: str) -> float:
        value = float(item)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(item)
        return value

    return _listed(text, parse, "a finite number > 0", "0.1,0.03,0.01")


def _positive(text: str) -> float:
    """A finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def _finite(tree):
    """``tree`` with every NaN or infinite float replaced by None."""
    if isinstance(tree, dict):
        return {k: _finite(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return [_finite(v) for v in tree]
    if isinstance(tree, float) and not math.isfinite(tree):
        return None
    return tree


_LIST_OPTIONS = ("--steps", "--epsilons")


def _joined_lists(argv: list[str]) -> list[str]:
    """``--steps -4,8`` as ``--steps=-4,8``: argparse takes a value that starts with a
    dash and is not a plain number for an option, and would say only "expected one
    argument" instead of the list's own message on its first entry."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in _LIST_OPTIONS and i + 1 < len(argv) and argv[i + 1].startswith("-"):
            value = argv[i + 1]
            if len(value) > 1 and (value[1].isdigit() or value[1] == "."):
                out.append(f"{argv[i]}={value}")
                i += 2
                continue
        out.append(argv[i])
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ocformer.analysis")
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser(
        "convergence",
        help="errors against a fine reference and fitted orders, in float64",
    )
    conv.add_argument(
        "--schemes",
        default=None,
        type=_names,
        help="comma-separated names; strang(1,0,2) is Strang with that sequence "
        "(default lie,strang)",
    )
    conv.add_argument(
        "--steps",
        default=None,
        type=_steps,
        help="steps per layer, each >= 1 (default 4,8,16,32,64)",
    )
    conv.add_argument("--formulation", default="pre", choices=STUDY_FORMULATIONS)
    conv.add_argument("--seed", type=int, default=0)
    conv.add_argument(
        "--epsilons",
        default=None,
        type=_epsilons,
        help="with --formulation relaxed (and no --relaxation-eps): the epsilons of the "
        "error in epsilon (default 0.1,0.03,0.01,0.003,0.001)",
    )
    conv.add_argument(
        "--relaxation-eps",
        type=_positive,
        default=None,
        help="with --formulation relaxed: study the schemes over --steps on the relaxed "
        "equation with this epsilon (instead of the error in epsilon)",
    )
    conv.add_argument("--json", dest="json_path", default=None, help="write the result here")
    conv.add_argument(
        "--plot",
        default=None,
        help="write a log-log plot here, in the format of its extension (.png, .pdf, .svg)",
    )
    add_compile_cache_option(conv)
    try:
        args = parser.parse_args(_joined_lists(sys.argv[1:] if argv is None else list(argv)))
    except SystemExit as e:  # --help (0), or a bad argument: argparse named it (2)
        return int(e.code or 0)
    if args.epsilons is not None and (
        args.formulation != "relaxed" or args.relaxation_eps is not None
    ):
        return fail(
            _PROGRAM,
            2,
            "--epsilons are the epsilons of the error in epsilon of --formulation relaxed "
            "without --relaxation-eps; this study does not read them: drop --epsilons",
        )
    unread = [o for o, v in (("--schemes", args.schemes), ("--steps", args.steps)) if v is not None]
    if unread and args.formulation == "relaxed" and args.relaxation_eps is None:
        return fail(
            _PROGRAM,
            2,
            "the error in epsilon of --formulation relaxed solves the relaxed model alone "
            f"and does not read {' or '.join(unread)}: drop {'them' if len(unread) > 1 else 'it'}, "
            "or add --relaxation-eps "
            "EPS to study the schemes over --steps on the relaxed equation",
        )
    schemes = _names("lie,strang") if args.schemes is None else args.schemes
    steps = _steps("4,8,16,32,64") if args.steps is None else args.steps
    from ._convergence import convergence_study, format_table, plot_format, plot_study

    for path, option in ((args.json_path, "--json"), (args.plot, "--plot")):
        problem = None if path is None else output_problem(path, option)
        if problem is None and option == "--plot" and path is not None:
            try:
                plot_format(path)
            except ValueError as err:
                problem = f"--plot {err}"
        if problem is not None:
            return fail(_PROGRAM, 2, f"{problem} (checked before computing; nothing was computed)")

    import jax

    jax.config.update("jax_enable_x64", True)
    enable_compile_cache(off=args.no_compile_cache)  # before anything is compiled

    try:
        result = convergence_study(
            schemes,
            steps,
            formulation=args.formulation,
            seed=args.seed,
            **({} if args.epsilons is None else {"epsilons": args.epsilons}),
            relaxation_eps=args.relaxation_eps,
        )
    except ValueError as err:  # the library's words for its arguments, as options
        text = re.sub(r"\b(relaxation_eps|formulation)='?([\w.+-]+)'?", _option, str(err))
        return fail(_PROGRAM, 2, text)
    print(format_table(result))
    if args.json_path:
        # Strict JSON: a non-finite number (the local slope of an exact scheme) as null.
        text = json.dumps(_finite(result), indent=2, allow_nan=False)
        try:
            atomic_write_text(args.json_path, text)
        except OSError as e:  # checked writable before; a disk that filled since, say
            return fail(
                _PROGRAM, 1, f"--json {args.json_path}: the table (above) could not be written: {e}"
            )
    if args.plot:
        import matplotlib.pyplot as plt

        try:
            plt.close(plot_study(result, args.plot))
        except (OSError, RuntimeError, ValueError) as e:  # a disk that filled since, say
            plt.close("all")
            return fail(_PROGRAM, 1, f"--plot {args.plot}: the plot could not be written: {e}")
    return 0


if __name__ == "__main__":
    exit_with(main, _PROGRAM, "no --json or --plot file is left half-written")
