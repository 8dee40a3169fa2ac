"""Joining a run of many processes: ``jax.distributed.initialize`` with bounded waits.

A process learns its place in the run from flags (``--coordinator``,
``--num-processes``, ``--process-id``), from the variables ``OCFORMER_COORDINATOR``,
``OCFORMER_NUM_PROCESSES`` and ``OCFORMER_PROCESS_ID`` (what ``ocformer.launch local``
sets), or from a cluster: a SLURM step of more than one task, or a TPU pod slice of more
than one host, which JAX detects itself. Every wait is bounded: a coordinator that cannot
be reached, or processes started with different counts of which process 0's is the
smaller, end in a ``DistributedError`` that names the address, the counts and the
timeout. When process 0 waits for processes that never join, JAX's coordination service
ends the waiting processes with its own fatal error after the timeout (it cannot be
caught); each process has said beforehand what it waits for.
"""

import os
import re
import socket
import sys
import time

import jax

from .._compat import jax_distributed_state

ENV_COORDINATOR = "OCFORMER_COORDINATOR"
ENV_NUM_PROCESSES = "OCFORMER_NUM_PROCESSES"
ENV_PROCESS_ID = "OCFORMER_PROCESS_ID"
ENV_TIMEOUT = "OCFORMER_DISTRIBUTED_TIMEOUT_S"
ENV_HEARTBEAT = "OCFORMER_HEARTBEAT_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 120
DEFAULT_HEARTBEAT_S = 60
# How long a finishing process waits for the others at exit (JAX's default is 300 s; a
# process that stops on an error should end promptly, so that launchers see it).
SHUTDOWN_S = 15

PEER_LOST = 5
"""The exit code of a training process whose collective with the other processes failed
because another of them ended (it is the consequence, not the cause: the launcher
reports the process that ended first)."""
# What XLA's collectives say when a peer has gone: gloo (CPU) and NCCL (GPU) transport
# errors, and the coordination service's.
_LOST_PEER = re.compile(
    r"gloo|nccl|connection reset|connection refused|socket closed|broken pipe|"
    r"UNAVAILABLE|heartbeat",
    re.IGNORECASE,
)

# An XLA status code, as runtime errors start: "UNKNOWN: ...", "UNAVAILABLE: ...".
_XLA_STATUS = re.compile(r"^[A-Z][A-Z_]+: ")

_ADDRESS = re.compile(r"^\[?[A-Za-z0-9_.:-]+\]?:\d{1,5}$")


class DistributedError(RuntimeError):
    """A run of many processes that cannot start or cannot go on."""


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise DistributedError(f"{name}={text!r} is not an integer") from None
    if value < 1:
        raise DistributedError(f"{name}={text!r} must be >= 1 (seconds)")
    return value


def _cluster() -> str | None:
    """The cluster JAX can read this process's place from, if the run spans processes."""
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS") or os.environ.get("SLURM_NTASKS")
    if os.environ.get("SLURM_JOB_ID") and tasks and int(tasks) > 1:
        return "SLURM"
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    if "," in hosts:
        return "TPU"
    return None


def wait_timeout_s() -> int:
    """How long a process waits for the others (to join, or to show their files in a
    shared directory): ``OCFORMER_DISTRIBUTED_TIMEOUT_S``, default 120 s."""
    return _env_int(ENV_TIMEOUT, DEFAULT_TIMEOUT_S)


def process_environment(coordinator: str, num_processes: int, process_id: int) -> dict[str, str]:
    """The variables that give a process its place in a run (what ``process_settings``
    reads back): set them in a process's environment instead of passing the flags."""
    return {
        ENV_COORDINATOR: coordinator,
        ENV_NUM_PROCESSES: str(num_processes),
        ENV_PROCESS_ID: str(process_id),
    }


def process_settings(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> tuple[str, int, int] | None:
    """The explicit ``(coordinator, num_processes, process_id)`` of this process, from
    the arguments or else the ``OCFORMER_*`` variables; None if neither gives any.

    Raises:
        DistributedError: some but not all three given, a malformed address, a count
            below 1, or a process id outside ``0 .. num_processes - 1``.
    """
    given = (coordinator, num_processes, process_id)
    source = "--coordinator, --num-processes and --process-id"
    if all(v is None for v in given):
        env = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
        if all(os.environ.get(n) is None for n in env):
            return None
        source = ", ".join(env)
        coordinator = os.environ.get(ENV_COORDINATOR)
        try:
            num_processes = int(os.environ[ENV_NUM_PROCESSES])
            process_id = int(os.environ[ENV_PROCESS_ID])
        except (KeyError, ValueError):
            raise DistributedError(
                f"{source} must all be set, the last two to integers (got "
                f"{ENV_NUM_PROCESSES}={os.environ.get(ENV_NUM_PROCESSES)!r}, "
                f"{ENV_PROCESS_ID}={os.environ.get(ENV_PROCESS_ID)!r})"
            ) from None
    if coordinator is None or num_processes is None or process_id is None:
        raise DistributedError(
            f"{source} go together: got coordinator={coordinator!r}, "
            f"num_processes={num_processes!r}, process_id={process_id!r}"
        )
    if not _ADDRESS.match(coordinator):
        raise DistributedError(
            f"coordinator address {coordinator!r} is not HOST:PORT (e.g. 10.0.0.1:1234)"
        )
    port = int(coordinator.rsplit(":", 1)[1])
    if not 1 <= port <= 65535:
        raise DistributedError(
            f"coordinator address {coordinator!r}: port {port} is not a port number (1..65535)"
        )
    if num_processes < 1:
        raise DistributedError(f"the number of processes must be >= 1, got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise DistributedError(
            f"process id {process_id} is out of range for {num_processes} processes "
            f"(ids 0..{num_processes - 1})"
        )
    return coordinator, num_processes, process_id


def _wait_for_coordinator(address: str, timeout_s: int) -> None:
    """Wait until ``address`` accepts a connection (JAX itself would abort the process
    when the coordinator is missing)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise DistributedError(
                    f"the coordinator at {address} could not be reached within {timeout_s}s "
                    f"({e.strerror or e}); start process 0 first, on that address, or "
                    "check --coordinator (and the timeout, OCFORMER_DISTRIBUTED_TIMEOUT_S)"
                ) from None
            time.sleep(0.5)


def _check_counts(num_processes: int, process_id: int, timeout_s: int) -> None:
    """Every process was started with the same number of processes: each publishes its
    count in the coordinator's key-value store and reads the others' (bounded wait)."""

    client = jax_distributed_state.client
    if client is None:  # pragma: no cover - initialize succeeded, so there is one
        return
    client.key_value_set(f"ocformer/num_processes/{process_id}", str(num_processes))
    for other in range(num_processes):
        if other == process_id:
            continue
        try:
            theirs = client.blocking_key_value_get(
                f"ocformer/num_processes/{other}", timeout_s * 1000
            )
        except Exception as e:  # the store's timeout, or a coordinator gone
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DistributedError(
                f"process {other} of {num_processes} did not join within {timeout_s}s "
                f"({first}); every process must be started with the same --num-processes "
                f"({num_processes} here)"
            ) from None
        if int(theirs) != num_processes:
            raise DistributedError(
                f"mismatched process counts: process {other} was started with "
                f"--num-processes {theirs}, process {process_id} with {num_processes}; "
                "start every process with the same count"
            )


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout_s: int | None = None,
) -> bool:
    """Join the run's processes, if this process is one of many; returns whether it did.

    Explicit settings (the arguments, else the ``OCFORMER_*`` variables) come first;
    otherwise a SLURM step of several tasks or a multi-host TPU slice is detected and
    JAX reads the settings from it; otherwise the process runs alone and nothing
    happens. Collectives between CPU processes use gloo.

    Args:
        coordinator: ``HOST:PORT`` of process 0's coordination service.
        num_processes: how many processes the run has.
        process_id: this process, ``0 .. num_processes - 1``.
        timeout_s: how long to wait for the coordinator and the other processes
            (default ``OCFORMER_DISTRIBUTED_TIMEOUT_S`` or 120 s).

    Raises:
        DistributedError: bad settings, an unreachable coordinator (with its address
            and the timeout), or mismatched counts (process 0's the smaller; for
            processes that never join, see the module's note).
    """
    settings = process_settings(coordinator, num_processes, process_id)
    cluster = None if settings is not None else _cluster()
    if settings is None and cluster is None:
        return False
    if jax.distributed.is_initialized():
        return True
    timeout = timeout_s if timeout_s is not None else wait_timeout_s()
    heartbeat = _env_int(ENV_HEARTBEAT, DEFAULT_HEARTBEAT_S)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if settings is None:
        try:
            jax.distributed.initialize(
                initialization_timeout=timeout,
                heartbeat_timeout_seconds=heartbeat,
                shutdown_timeout_seconds=SHUTDOWN_S,
            )
        except Exception as e:
            raise DistributedError(
                f"joining the {cluster} run failed within {timeout}s: {str(e).splitlines()[0]}"
            ) from None
        return True
    address, count, pid = settings
    if pid == 0 and (taken := _port_taken(address)):
        # Checked first: JAX's coordination service, failing to bind, may end the
        # process in a segmentation fault, or say only "Failed to start RPC server".
        raise DistributedError(
            f"process 0 of {count} hosts the coordinator at {address}, and its port is "
            f"taken on this machine ({taken}); give every process another --coordinator "
            "port"
        )
    # JAX ends a process that waits in vain with a fatal error of its own (no
    # exception to catch): this line says beforehand what it waits for.
    print(
        f"ocformer: process {pid} of {count} joins the coordinator at {address}, waiting "
        f"up to {timeout}s for the others",
        file=sys.stderr,
        flush=True,
    )
    if pid != 0:  # process 0 hosts the coordinator
        _wait_for_coordinator(address, timeout)
    try:
        jax.distributed.initialize(
            address,
            num_processes=count,
            process_id=pid,
            initialization_timeout=timeout,
            heartbeat_timeout_seconds=heartbeat,
            shutdown_timeout_seconds=SHUTDOWN_S,
        )
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DistributedError(
            f"process {pid} of {count} could not join the coordinator at {address} within "
            f"{timeout}s ({first}); start process 0 on that address, or check "
            "--coordinator"
        ) from None
    _check_counts(count, pid, timeout)
    return True


def _port_taken(address: str) -> str | None:
    """Why the port of ``address`` (HOST:PORT) cannot be bound on this machine (the
    error's text), or None if it can (or the address has no port number)."""
    port = address.rpartition(":")[2]
    if not port.isdigit():
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As JAX's server binds: a port whose last connections linger in TIME_WAIT (a
        # run that just ended) is free to it.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", int(port)))
        except OSError as e:
            return e.strerror or str(e)
    return None


def lost_peer(error: BaseException) -> bool:
    """Whether ``error`` is a collective of a run of several processes that failed
    because another process ended: a JAX runtime error naming a transport failure, or
    the ``ValueError`` carrying XLA's status (``UNKNOWN: Gloo AllGather failed: ...``)
    that a jitted gather raises, as ``multihost_utils.sync_global_devices`` does in a
    checkpoint's barrier."""
    runtime = isinstance(error, jax.errors.JaxRuntimeError) or (
        isinstance(error, ValueError) and bool(_XLA_STATUS.match(str(error)))
    )
    return jax.process_count() > 1 and runtime and bool(_LOST_PEER.search(str(error)))
