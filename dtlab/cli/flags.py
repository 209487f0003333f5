"""Command-line flags generated from config dataclasses: one source of truth for names, defaults and help.

`add_arguments(parser, RunConfig)` adds `--field-name` for every field, with the field's default and the first
sentence of its attribute docstring as help. A nested config dataclass (an option group of RunConfig) gets its
fields' flat names where dtlab.config.options.FLAT gives them (`--microbatches`, `--pp-schedule`,
`--comm-hook`), prefixed flags otherwise (`--zero-reduce-bucket-size`). `from_args(args, RunConfig)` builds the
config back. Pure: no torch.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import math
import textwrap
import typing
from functools import cache

from dtlab.config.calibration import DEFAULT_SIZES, CalibConfig
from dtlab.config.options import FLAT_NAME


@cache
def field_docs(cls) -> dict[str, str]:
    """{field: docstring} from the string literal that follows each field in the class body (a base dataclass's
    fields, e.g. JobConfig's, from its own body; a subclass's docstring wins)."""
    docs = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or "__dataclass_fields__" not in vars(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, nxt in zip(body, body[1:] + [None]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(getattr(nxt, "value", None), ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def own_fields_first(cls) -> list:
    """The dataclass's fields, its own before those it inherits (so `dtlab run --help` opens with the run's)."""
    own = set(vars(cls).get("__annotations__", {}))
    fields = dataclasses.fields(cls)
    return [f for f in fields if f.name in own] + [f for f in fields if f.name not in own]


def _base_type(cls, f):
    hint = typing.get_type_hints(cls)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _nested(cls, f) -> bool:
    t = _base_type(cls, f)
    return dataclasses.is_dataclass(t)


def _default(f):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def _number(kind):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if kind is float and not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        return v

    parse.__name__ = kind.__name__
    return parse


def _dest(prefix: str, name: str) -> str:
    """The argparse name of field `name` of the group `prefix` names ('zero_', '' at the top): its flat name where
    dtlab.config.options.FLAT has one (('parallel', 'schedule') -> 'pp_schedule'), else prefix + name."""

    return FLAT_NAME.get((prefix.rstrip("_-"), name), prefix.replace("-", "_") + name)


def add_arguments(
    parser, cls, prefix: str = "", skip: tuple = (), group_titles: dict | None = None, aliases: dict | None = None
) -> None:
    """Add one flag per field of dataclass `cls` (recursing into nested config dataclasses). `aliases` maps a
    field to extra flag spellings kept for compatibility (e.g. {"timeout_s": ["--timeout"]})."""
    docs = field_docs(cls)
    for f in own_fields_first(cls):
        if f.name in skip:
            continue
        if _nested(cls, f):
            sub = _base_type(cls, f)
            about = " ".join((sub.__doc__ or sub.__name__).split()).split(" (")[0].rstrip(".")
            title = (group_titles or {}).get(f.name, f"{f.name} ({sub.__name__}): {about}")
            add_arguments(parser.add_argument_group(title), sub, prefix=f"{prefix}{f.name}-", aliases=aliases)
            continue
        dest = _dest(prefix, f.name)
        flag = ["--" + dest.replace("_", "-"), *(aliases or {}).get(prefix + f.name, [])]
        default = _default(f)
        doc = docs.get(f.name, "")
        help_text = f"{doc} (default: {default})".replace("%", "%%")
        t = _base_type(cls, f)
        if t is bool:
            parser.add_argument(
                *flag, dest=dest, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
        elif t in (int, float):
            parser.add_argument(*flag, dest=dest, type=_number(t), default=default, help=help_text)
        else:
            parser.add_argument(*flag, dest=dest, type=str, default=default, help=help_text)


def from_args(args, cls, prefix: str = "", skip: tuple = ()):
    """Build `cls` from parsed args (the inverse of `add_arguments`; `skip` as given there)."""
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        if _nested(cls, f):
            values[f.name] = from_args(args, _base_type(cls, f), prefix=f"{prefix}{f.name}_")
            continue
        dest = _dest(prefix, f.name)
        if hasattr(args, dest):
            values[f.name] = getattr(args, dest)
    return cls(**values)


#: Old flag spellings kept working (the flags themselves are generated from RunConfig's fields).
RUN_ALIASES = {
    "timeout_s": ["--timeout"],
    "stall_s": ["--stall"],
    "zero-stage3_prefetch_bucket_size": ["--zero-prefetch-bucket-size"],
    "zero-stage3_param_persistence_threshold": ["--zero-persistence-threshold"],
    "zero-stage3_max_reuse_distance": ["--zero-max-reuse-distance"],
}


#: CalibConfig fields whose flags parse sizes and lists by hand (4K, 16M; comma lists)
CALIB_MANUAL = ("ops", "sizes", "fit_min_bytes", "fit_max_bytes")


def parse_bytes(text: str, field: str) -> int:
    """'4096', '64K', '16M', '1G' -> bytes (binary units); ValueError naming the field otherwise."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise ValueError(f"{field}: {text!r} is not a size in bytes (examples: 4096, 64K, 16M)") from None


def add_calib_arguments(parser) -> None:
    """`dtlab calibrate`'s flags: one per CalibConfig field, sizes and op lists parsed by hand (4K, 16M; commas)."""

    add_arguments(parser, CalibConfig, skip=CALIB_MANUAL)
    parser.add_argument(
        "--ops",
        default=",".join(CalibConfig().ops),
        help="comma list of all_reduce, reduce_scatter, all_gather, ps (default: %(default)s)",
    )
    parser.add_argument(
        "--sizes",
        default=None,
        help="comma list of message sizes in bytes (suffixes K, M: KiB, MiB); default 4K,8K,...,64M (powers of 2)",
    )
    parser.add_argument("--fit-min-bytes", default=None, help="fit only sizes >= this (e.g. 1M)")
    parser.add_argument("--fit-max-bytes", default=None, help="fit only sizes <= this (e.g. 64M)")
    parser.add_argument("--no-progress", action="store_true")


def calib_from_args(args):
    """The CalibConfig that `add_calib_arguments`' flags describe (ValueError naming a bad size)."""

    base = from_args(args, CalibConfig, skip=CALIB_MANUAL)  # every scalar field, from its generated flag
    sizes = tuple(parse_bytes(s, "--sizes") for s in args.sizes.split(",")) if args.sizes else DEFAULT_SIZES
    return dataclasses.replace(
        base,
        ops=args.ops,
        sizes=sizes,
        fit_min_bytes=parse_bytes(args.fit_min_bytes, "--fit-min-bytes") if args.fit_min_bytes else None,
        fit_max_bytes=parse_bytes(args.fit_max_bytes, "--fit-max-bytes") if args.fit_max_bytes else None,
    )
