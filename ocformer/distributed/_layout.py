r"""Where the arrays of a run live: a device mesh of ``data`` x ``model`` x ``depth``
devices.

The batch is split over ``data`` (each device takes an equal slice of the rows); the
controls are copied over ``data`` and, when ``model > 1``, split over ``model`` the way
tensor-parallel Transformers are: the query, key and value kernels (and biases) by
output columns, i.e. by heads, $W^O$ by input rows; the first feed-forward kernel by
hidden columns and the last by hidden rows. The optimiser state follows the controls.
The compiled step is a ``jax.jit`` with these input and output shardings; XLA inserts
the collectives (an all-reduce of the gradients over ``data``, and of the partial
attention and feed-forward outputs over ``model``). With ``depth > 1`` the chunks of
a depth-parallel solve (``discretisation.depth_parallel``) are split over ``depth``:
the built model's solve is given the mesh (``ocformer.training.build(config, mesh)``),
and each depth device runs the fine solves of its chunks. The arithmetic is the
one-device step's, so the losses agree with one device up to the order of
floating-point sums.
"""

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from ..config import Config, ConfigError

AXES: tuple[str, str, str] = ("data", "model", "depth")
# The leaves split over `model`, by the name of the field that holds them: the axis
# (counted from the end) that carries heads or hidden units.
_COLUMNS = frozenset({"wq", "wk", "wv", "bq", "bk", "bv"})


class MeshError(ConfigError):
    """A mesh that does not fit the devices (found at start, once they are known).
    ``field`` is the config field to change."""


def mesh_shape(config: Config, num_devices: int) -> tuple[int, int, int]:
    """``(data, model, depth)`` of ``config.mesh`` on ``num_devices`` devices, ``-1``
    resolved (the devices a ``-1`` takes are those the other two leave).

    Raises:
        MeshError: more devices asked for than there are, a ``-1`` that leaves no whole
            number of devices, or a resolved ``data`` that does not divide the batch.
    """
    data, model, depth = config.mesh.data, config.mesh.model, config.mesh.depth
    if depth > num_devices:
        raise MeshError(
            "mesh.depth",
            f"mesh.depth={depth} needs more devices than the {num_devices} there are "
            f"({jax.process_count()} process(es), platform {jax.devices()[0].platform}); "
            f"choose mesh.depth <= {num_devices}",
        )
    for name, fixed, other in (("mesh.data", data, model), ("mesh.model", model, data)):
        if other == -1 and fixed * depth > num_devices:
            times = f" x mesh.depth={depth}" if depth > 1 else ""
            raise MeshError(
                name,
                f"{name}={fixed}{times} needs more devices than the {num_devices} there are; "
                f"lower {name}" + (" or mesh.depth" if depth > 1 else ""),
            )
    if data == -1:
        if num_devices % (model * depth):
            raise MeshError(
                "mesh.model",
                f"mesh.model={model}{_times_depth(depth)} does not divide the {num_devices} "
                "devices, so mesh.data=-1 has no whole number of them; give mesh.data "
                "explicitly",
            )
        data = num_devices // (model * depth)
    if model == -1:
        if num_devices % (data * depth):
            raise MeshError(
                "mesh.data",
                f"mesh.data={data}{_times_depth(depth)} does not divide the {num_devices} "
                "devices, so mesh.model=-1 has no whole number of them; give mesh.model "
                "explicitly",
            )
        model = num_devices // (data * depth)
    if data * model * depth > num_devices:
        axes, sizes = "mesh.data x mesh.model", f"{data} x {model}"
        if depth > 1:
            axes, sizes = f"{axes} x mesh.depth", f"{sizes} x {depth}"
        raise MeshError(
            "mesh.data",
            f"the mesh {axes} = {sizes} = {data * model * depth} devices "
            f"is larger than the {num_devices} device{'s' if num_devices > 1 else ''} of this "
            f"run ({jax.process_count()} "
            f"process(es), platform {jax.devices()[0].platform}); lower mesh.data or "
            f"mesh.model{' or mesh.depth' if depth > 1 else ''}, or use -1 for the rest",
        )
    if config.task.batch_size % data:
        raise MeshError(
            "mesh.data",
            f"mesh.data={data} devices must divide task.batch_size="
            f"{config.task.batch_size} (each takes an equal slice of the batch); choose a "
            "divisor of the batch size",
        )
    for what, size in (
        ("model.num_heads", config.model.num_heads),
        ("model.hidden", config.model.hidden),
    ):
        if size % model:
            raise MeshError(
                "mesh.model",
                f"mesh.model={model} devices must divide {what}={size} (the controls are "
                "split by attention heads and feed-forward hidden width); choose a common "
                f"divisor of model.num_heads={config.model.num_heads} and model.hidden="
                f"{config.model.hidden}",
            )
    return data, model, depth


def _times_depth(depth: int) -> str:
    return "" if depth == 1 else f" x mesh.depth={depth}"


def make_mesh(config: Config, devices=None) -> Mesh:
    """The ``("data", "model", "depth")`` mesh of ``config.mesh`` over ``devices``
    (default: all devices of all processes). A mesh smaller than the devices uses the
    first ones, which a run of several processes refuses: every process must hold part
    of it."""
    devices = list(jax.devices() if devices is None else devices)
    data, model, depth = mesh_shape(config, len(devices))
    size = data * model * depth
    if size < len(devices) and jax.process_count() > 1:
        raise MeshError(
            "mesh.data",
            f"the mesh {data} x {model} x {depth} leaves devices of this "
            f"{jax.process_count()}-process run idle ({len(devices)} devices); with several "
            "processes the mesh must use them all (mesh.data=-1 does)",
        )
    chosen = np.asarray(devices[:size], dtype=object).reshape(data, model, depth)
    return Mesh(chosen, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def _name(entry) -> str | int | None:
    if isinstance(entry, jtu.GetAttrKey):
        return entry.name
    if isinstance(entry, jtu.SequenceKey):
        return entry.idx
    if isinstance(entry, jtu.DictKey):
        return entry.key
    return None


def _model_axis(path, leaf, num_weights: dict) -> int | None:
    """The axis of ``leaf`` split over ``model`` (negative, from the end), or None."""
    names = [_name(e) for e in path]
    if "attention" in names:
        last = names[-1]
        if last in _COLUMNS:
            return -1
        if last == "wo":
            return -2
        return None
    if "feedforward" in names:
        i = names.index("feedforward")
        rest = names[i + 1 :]
        if len(rest) >= 2 and rest[0] in ("weights", "biases") and isinstance(rest[1], int):
            layers = num_weights.get(tuple(names[: i + 1]), 0)
            if layers < 2:
                return None
            if rest[1] == 0:
                return -1
            if rest[0] == "weights" and rest[1] == layers - 1:
                return -2
    return None


class Layout:
    """A run's mesh and the shardings of its batch, controls and optimiser state.

    ``active`` is False for one device of one process: everything is then left to
    JAX's defaults, exactly as without a mesh.
    """

    def __init__(self, config: Config, devices=None):
        self.mesh = make_mesh(config, devices)
        self.data, self.model, self.depth = (int(n) for n in self.mesh.devices.shape)
        self.processes = jax.process_count()
        self.active = self.mesh.size > 1 or self.processes > 1
        self.replicated = NamedSharding(self.mesh, P())
        self.rows = NamedSharding(self.mesh, P("data"))

    def __repr__(self) -> str:
        return (
            f"Layout(data={self.data}, model={self.model}, depth={self.depth}, "
            f"processes={self.processes}, "
            f"platform={self.mesh.devices.flat[0].platform})"
        )

    # -- shardings -----------------------------------------------------------------

    def param_shardings(self, params):
        """One ``NamedSharding`` per array of ``params`` (None elsewhere)."""
        flat = jtu.tree_flatten_with_path(params)[0]
        num_weights: dict = {}
        for path, _ in flat:
            names = [_name(e) for e in path]
            if "feedforward" in names:
                i = names.index("feedforward")
                if names[i + 1 : i + 2] == ["weights"]:
                    key = tuple(names[: i + 1])
                    num_weights[key] = max(num_weights.get(key, 0), int(str(names[i + 2])) + 1)

        def sharding(path, leaf):
            axis = _model_axis(path, leaf, num_weights) if self.model > 1 else None
            if axis is None or leaf.ndim < -axis or leaf.shape[axis] % self.model:
                return self.replicated
            spec = [None] * leaf.ndim
            spec[leaf.ndim + axis] = "model"
            return NamedSharding(self.mesh, P(*spec))

        return jtu.tree_map_with_path(sharding, params)

    def state_shardings(self, state, params):
        """Shardings of an optimiser state: every sub-tree shaped like ``params`` (the
        moments) takes the controls' shardings; counters are replicated."""
        structure = jtu.tree_structure(params)
        shardings = self.param_shardings(params)

        def is_params(node) -> bool:
            return jtu.tree_structure(node) == structure

        return jtu.tree_map(
            lambda node: shardings if is_params(node) else self.replicated, state, is_leaf=is_params
        )

    # -- placing arrays ------------------------------------------------------------

    def put(self, tree, shardings):
        """``tree``'s arrays as global arrays with ``shardings``. Every process holds
        the same values (a pure function of the seed or a checkpoint) and transfers
        only the pieces its own devices hold."""

        def one(x, s):
            if x is None:
                return None
            if self.processes == 1:
                return jax.device_put(x, s)
            host = np.asarray(x)
            return jax.make_array_from_callback(host.shape, s, lambda index: host[index])

        return jtu.tree_map(one, tree, shardings)

    def put_model(self, model):
        params, static = eqx.partition(model, eqx.is_array)
        return eqx.combine(self.put(params, self.param_shardings(params)), static)

    def put_state(self, state, model):
        params = eqx.filter(model, eqx.is_inexact_array)
        return self.put(state, self.state_shardings(state, params))

    def put_batch(self, batch: dict) -> dict:
        """A global batch (the same rows on every process), split by rows over ``data``:
        each process transfers only the rows of its own devices."""
        return {k: self.put(np.asarray(v), self.rows) for k, v in batch.items()}

    def process_rows(self, batch_size: int) -> slice:
        """The rows of a global batch of ``batch_size`` rows that this process's devices
        hold: all of them in one process. ``make_mesh`` lays the devices out in order,
        so a process's rows are consecutive; if a device order interleaved them, this is
        the smallest range that covers them, and ``put_rows`` still places them."""
        indices = self.rows.addressable_devices_indices_map((batch_size,)).values()
        spans = [(index or (slice(None),))[0].indices(batch_size)[:2] for index in indices]
        return slice(min(a for a, _ in spans), max(b for _, b in spans))

    def put_rows(self, batch: dict, rows: slice, batch_size: int) -> dict:
        """The global batch of ``batch_size`` rows, split by rows over ``data``, from the
        rows ``rows`` of it (``process_rows(batch_size)``) that this process made: each
        of its devices takes its slice of them, and no process holds the whole batch."""
        start, stop, _ = rows.indices(batch_size)

        def one(x):
            host = np.asarray(x)
            if len(host) != stop - start:
                raise ValueError(
                    f"rows {start}..{stop - 1} of the batch are {stop - start} rows, but "
                    f"the task made {len(host)}; a task's batch_rows must make exactly "
                    "the rows asked for"
                )
            if self.processes == 1 and len(host) == batch_size:
                return jax.device_put(host, self.rows)

            def piece(index):
                first, last, _ = index[0].indices(batch_size)
                return host[(slice(first - start, last - start), *index[1:])]

            shape = (batch_size, *host.shape[1:])
            return jax.make_array_from_callback(shape, self.rows, piece)

        return {k: one(v) for k, v in batch.items()}

    def put_replicated(self, batch: dict) -> dict:
        return {k: self.put(np.asarray(v), self.replicated) for k, v in batch.items()}

    # -- compiled steps ------------------------------------------------------------

    def compile_train_step(self, step, model, opt_state):
        """``step(model, opt_state, batch) -> (model, opt_state, metrics, finite)`` as
        one ``jax.jit`` with the layout's input and output shardings."""
        params, static = eqx.partition(model, eqx.is_array)
        ps = self.param_shardings(params)
        ss = self.state_shardings(opt_state, eqx.filter(model, eqx.is_inexact_array))

        def arrays_step(params, opt_state, batch):
            new_model, new_opt, metrics, finite = step(
                eqx.combine(params, static), opt_state, batch
            )
            return eqx.filter(new_model, eqx.is_array), new_opt, metrics, finite

        compiled = jax.jit(
            arrays_step,
            in_shardings=(ps, ss, self.rows),
            out_shardings=(ps, ss, self.replicated, self.replicated),
        )

        def call(model, opt_state, batch):
            new_params, new_opt, metrics, finite = compiled(
                eqx.filter(model, eqx.is_array), opt_state, batch
            )
            return eqx.combine(new_params, static), new_opt, metrics, finite

        call.lower = lambda model, opt_state, batch: compiled.lower(  # type: ignore[attr-defined]
            eqx.filter(model, eqx.is_array), opt_state, batch
        )
        return call

    def compile_eval_step(self, evaluate, model):
        """``evaluate(model, batch) -> metrics`` with a replicated batch and replicated
        metrics."""
        return self._compile_metrics(evaluate, model, self.replicated)

    def compile_bias_step(self, bias, model):
        """``bias(model, batch) -> metrics`` (the depth-parallel gradient's bias checks)
        with the batch split by rows, as the training step's, and replicated metrics."""
        return self._compile_metrics(bias, model, self.rows)

    def _compile_metrics(self, fn, model, batch_sharding):
        # fn(model, batch) -> metrics, one jax.jit: parameters sharded as the training
        # step's, the batch as given, the metrics replicated.
        params, static = eqx.partition(model, eqx.is_array)
        compiled = jax.jit(
            lambda params, batch: fn(eqx.combine(params, static), batch),
            in_shardings=(self.param_shardings(params), batch_sharding),
            out_shardings=self.replicated,
        )
        return lambda model, batch: compiled(eqx.filter(model, eqx.is_array), batch)

    # -- between processes ---------------------------------------------------------

    def to_host(self, tree):
        """The arrays of ``tree`` as whole NumPy arrays on every process."""
        if self.processes == 1:
            return jtu.tree_map(np.asarray, tree)
        return multihost_utils.process_allgather(tree, tiled=True)

    def any_process(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any process (every process must call it)."""
        if self.processes == 1:
            return flag
        flags = multihost_utils.process_allgather(np.asarray([flag], np.int32))
        return bool(np.asarray(flags).any())

    def barrier(self, name: str) -> None:
        if self.processes > 1:
            multihost_utils.sync_global_devices(name)


def is_primary() -> bool:
    """Whether this is process 0: the one that writes logs, samples and markers."""
    return jax.process_index() == 0
