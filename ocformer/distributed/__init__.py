"""Many devices and many processes: the device mesh, sharded steps, joining a run of
several processes with ``jax.distributed``, and starting and stopping those processes
(on this machine, or as a SLURM job)."""

from ._launcher import (
    GRACE_S as GRACE_S,
    LaunchError as LaunchError,
    TrainTask as TrainTask,
    launch_local as launch_local,
    submit_training as submit_training,
    train_command as train_command,
    training_job as training_job,
)
from ._layout import (
    AXES as AXES,
    Layout as Layout,
    MeshError as MeshError,
    is_primary as is_primary,
    make_mesh as make_mesh,
    mesh_shape as mesh_shape,
)
from ._process import (
    PEER_LOST as PEER_LOST,
    DistributedError as DistributedError,
    initialize as initialize,
    lost_peer as lost_peer,
    process_environment as process_environment,
    process_settings as process_settings,
    wait_timeout_s as wait_timeout_s,
)
from ._processes import (
    SlurmJob as SlurmJob,
    slurm_job as slurm_job,
    stop_processes as stop_processes,
    supervised as supervised,
)
