"""Where this process runs: rank, size, local rank, local size and node count, from MPI itself.

Launchers export their own view of the job (SLURM_PROCID, OMPI_COMM_WORLD_RANK,
PMI_RANK, ...), but those describe what the *launcher* started, which is what MPI
sees only when the launcher belongs to the MPI library mpi4py loaded.  An mpiexec
of another MPI, or `srun` without `--mpi=pmi2` for the PyPI MPICH, starts N
independent one-rank jobs that each believe they are alone.  So the numbers here
come from MPI (a shared-memory split of the communicator gives the ranks on each
node), and `cross_check` compares them with the launcher's variables and says in
words what a disagreement means.

    from mpicoll import topology
    t = topology.topology()            # collective: call it on every rank
    os.environ["CUDA_VISIBLE_DEVICES"] = str(t.local_rank)   # one GPU per rank,
                                       # before JAX first touches a device
    problems = topology.cross_check(t).problems

Only mpi4py is used here (no JAX), so the topology can be known before JAX
initializes its backends.
"""

import dataclasses
import os

from mpi4py import MPI


@dataclasses.dataclass(frozen=True)
class Topology:
    """This process's place in a communicator, as MPI sees it."""
    rank: int
    size: int
    # local_rank: index among the ranks on this node, in rank order (a launcher's
    # own local rank may order them otherwise: see cross_check)
    local_rank: int
    local_size: int   # how many ranks share this node
    node: int         # index of this node, nodes numbered by their lowest rank
    node_count: int
    hostname: str     # MPI_Get_processor_name


def topology(comm=None):
    """The Topology of this process in comm (default COMM_WORLD).  Collective over comm.

    MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) groups the ranks that can share
    memory, i.e. that run on one node; its rank and size are the local rank and
    local size.  Nodes are counted by their local rank 0.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        local_rank, local_size = node_comm.Get_rank(), node_comm.Get_size()
        leader = int(local_rank == 0)
        node_count = comm.allreduce(leader)
        # Leaders number their nodes in rank order (exscan: leaders before me),
        # then each node's leader tells its ranks.
        before = comm.exscan(leader)
        node = node_comm.bcast(before or 0, root=0)
    finally:
        node_comm.Free()
    return Topology(rank=comm.Get_rank(), size=comm.Get_size(), local_rank=local_rank,
                    local_size=local_size, node=node, node_count=node_count,
                    hostname=MPI.Get_processor_name())


_world = None


def world():
    """topology() of COMM_WORLD, computed once (collective the first time) and cached."""
    global _world
    if _world is None:
        _world = topology()
    return _world


# ---------------------------------------------------------------------------
# Cross-check against the launchers' variables.

@dataclasses.dataclass(frozen=True)
class CrossCheck:
    """What cross_check compared and found."""
    compared: tuple   # names of the variables compared with MPI's values
    problems: tuple   # one sentence per disagreement, with its likely cause
    notes: tuple      # variables present but not comparable, and why
    # (variable, value) of the launchers' local ranks, for a caller that gathers
    # them from every rank to check they are distinct
    local_ranks: tuple = ()

    @property
    def ok(self):
        return not self.problems


# Which variable each launcher sets for which Topology field.  Only the variables
# that are set are compared.  Local ranks are the exception: MPI numbers a node's
# ranks in rank order, but a launcher may number them in its own order (Open MPI
# does when oversubscribed), so a launcher's local rank need only be in range.
_LAUNCHER_VARIABLES = {
    "Open MPI's mpirun": {"OMPI_COMM_WORLD_RANK": "rank", "OMPI_COMM_WORLD_SIZE": "size",
                          "OMPI_COMM_WORLD_LOCAL_RANK": "local_rank",
                          "OMPI_COMM_WORLD_LOCAL_SIZE": "local_size"},
    "PMIx": {"PMIX_RANK": "rank"},
    "PMI (MPICH's hydra mpiexec, srun --mpi=pmi2)": {"PMI_RANK": "rank", "PMI_SIZE": "size"},
    "MPICH's hydra mpiexec": {"MPI_LOCALRANKID": "local_rank", "MPI_LOCALNRANKS": "local_size"},
}

_SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def _expand_tasks_per_node(spec):
    """SLURM's compressed tasks-per-node list, e.g. '2(x3),1' -> [2, 2, 2, 1]."""
    counts = []
    for item in spec.split(","):
        count, _, repeat = item.partition("(x")
        counts += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
    return counts


def _slurm_expected(topo, env):
    """The SLURM variables that describe MPI ranks here, with MPI's values.

    SLURM's per-task variables describe the ranks only when srun itself started
    them: then the step has exactly `size` tasks.  When mpiexec runs inside an
    allocation, srun starts one launcher daemon per node and the ranks inherit
    that daemon's SLURM_PROCID (0 on every rank of a node): not comparable.
    """
    tasks = env.get("SLURM_STEP_NUM_TASKS")
    if "SLURM_PROCID" not in env or tasks is None or not tasks.isdigit():
        return {}, None
    if int(tasks) != topo.size:
        return {}, (f"SLURM_PROCID etc. describe the {tasks} task(s) srun started, not the "
                    f"{topo.size} MPI rank(s) (mpiexec inside an allocation): not compared")
    expected = {"SLURM_PROCID": topo.rank, "SLURM_LOCALID": topo.local_rank}
    if env.get("SLURM_STEP_NUM_NODES", "").isdigit():
        expected["SLURM_STEP_NUM_NODES"] = topo.node_count
    per_node, node_id = env.get("SLURM_STEP_TASKS_PER_NODE"), env.get("SLURM_NODEID", "")
    if per_node and node_id.isdigit():
        try:
            counts = _expand_tasks_per_node(per_node)
            if int(node_id) < len(counts):
                expected[f"SLURM_STEP_TASKS_PER_NODE[{node_id}]"] = (topo.local_size,
                                                                     counts[int(node_id)])
        except ValueError:
            pass  # a format this parser does not know: nothing to compare
    return expected, None


def cross_check(topo=None, environ=None):
    """Compare topo (default world()) with every launcher variable that is set.

    Returns a CrossCheck; .ok is True when everything set agrees with MPI.  The
    typical disagreement -- a launcher that started N processes while MPI sees
    one rank -- means the launcher belongs to another MPI than the one mpi4py
    loaded, or srun was run without --mpi=pmi2.
    """
    topo = world() if topo is None else topo
    env = os.environ if environ is None else environ
    compared, problems, notes = [], [], []

    local_ranks = []

    def compare(name, mpi_value, launcher_value, launcher):
        compared.append(name)
        if str(launcher_value).strip() != str(mpi_value):
            problems.append(f"{name}={launcher_value} ({launcher}) but MPI says {mpi_value}")

    def compare_local_rank(name, launcher_value, launcher):
        compared.append(name)
        value = str(launcher_value).strip()
        if not value.isdigit() or int(value) >= topo.local_size:
            problems.append(f"{name}={launcher_value} ({launcher}) but MPI sees "
                            f"{topo.local_size} rank(s) on this node")
        else:
            local_ranks.append((name, int(value)))

    def result():
        return CrossCheck(tuple(compared), tuple(problems), tuple(notes), tuple(local_ranks))

    # A launcher that started several processes while MPI sees a single rank: the
    # one mistake that produces no error at all, so it gets its own explanation.
    for name in _SIZE_VARIABLES:
        value = env.get(name, "")
        if value.isdigit() and int(value) > 1 and topo.size == 1:
            problems.append(
                f"{name}={value}: the launcher started {value} processes, but MPI sees a single "
                f"rank, so each process is a separate 1-rank job. The mpiexec in use belongs to a "
                f"different MPI than the library mpi4py loaded ({_library()}); use the venv's "
                f"mpiexec (launch/mpirun.sh)")
            return result()
    tasks = env.get("SLURM_STEP_NUM_TASKS", "")
    if "SLURM_PROCID" in env and tasks.isdigit() and int(tasks) > 1 and topo.size == 1 \
            and "PMI_SIZE" not in env and "OMPI_COMM_WORLD_SIZE" not in env:
        problems.append(
            f"SLURM_STEP_NUM_TASKS={tasks}: srun started {tasks} tasks, but MPI sees a single "
            f"rank, so each task is a separate 1-rank job. Tell srun how to wire up this MPI "
            f"(`srun --mpi=pmi2` for the PyPI MPICH), or run mpiexec inside the allocation")
        return result()

    for launcher, variables in _LAUNCHER_VARIABLES.items():
        for name, field in variables.items():
            if name not in env:
                continue
            if field == "local_rank":
                compare_local_rank(name, env[name], launcher)
            else:
                compare(name, getattr(topo, field), env[name], launcher)

    slurm, note = _slurm_expected(topo, env)
    if note:
        notes.append(note)
    for name, value in slurm.items():
        if name == "SLURM_LOCALID":
            compare_local_rank(name, env[name], "srun")
        elif isinstance(value, tuple):  # (MPI's value, SLURM's value) already looked up
            compare(name, value[0], value[1], "srun")
        else:
            compare(name, value, env[name], "srun")
    return result()


def _library():
    return MPI.Get_library_version().splitlines()[0].strip()
