"""The report `python -m mpicoll info` prints: what each rank sees of itself
(rank_report: a dict of plain values, gathered on rank 0) and the text made of every
rank's (format_report: its sections, and a problem for whatever the ranks disagree on
or a rank has wrong).  It reads mpicoll as a user's program sees it (the public
names, the settings in force) and every layer under it (MPI, the install manifest,
the transports, the files); the command line (__main__.py) gathers and prints it."""


_THREAD_LEVELS = ("MPI_THREAD_SINGLE", "MPI_THREAD_FUNNELED", "MPI_THREAD_SERIALIZED",
                  "MPI_THREAD_MULTIPLE")


def rank_report():
    """What this rank knows about itself (a dict of plain values, sent to rank 0)."""
    import jax
    import jax.numpy as jnp
    from mpi4py import MPI

    import mpicoll
    from mpicoll import topology

    topo = topology.topology()
    check = topology.cross_check(topo)
    # One collective through XLA and the FFI extension: the installation works
    # end to end, not just MPI.  Not where the ranks' settings differ (compared
    # over mpi4py first): a check mode on one rank only would break it.
    settings = _settings_report()
    values = [value for _, value, _ in settings]
    if any(other != values for other in MPI.COMM_WORLD.allgather(values)):
        collective = "not run: the ranks' settings differ"
    else:
        try:
            total = int(jax.jit(mpicoll.allreduce)(jnp.ones((), jnp.int32)))
            collective = (None if total == topo.size
                          else f"allreduce of ones gave {total}, not {topo.size}")
        except Exception as error:  # reported, not raised: every rank must reach the gather
            collective = f"{type(error).__name__}: {error}"
    return {
        "topology": topo,
        "compared": check.compared,
        "problems": check.problems,
        "notes": check.notes,
        "local_ranks": check.local_ranks,
        "collective": collective,
        "thread_level": MPI.Query_thread(),
        "thread_mode": mpicoll.thread_mode(),
        "library": MPI.Get_library_version().strip(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.local_devices()],
        "settings": settings,
        "files": _files_report(),
        "jax_transport": _jax_transport(),
        **_mpi_build_report(),
        **_gpu_report(),
    }


# --- The settings in force -----------------------------------------------------------

def _settings_report():
    """[(name, value, where it came from)]: every setting as this rank has it now."""
    import dataclasses
    import tempfile

    import mpicoll
    from mpicoll._src.runtime import settings
    from mpicoll._src.observe import failures, tracing

    current, sources = settings.current(), settings.sources()
    tracing_to, started_by = tracing.tracing_to()
    # Those with a setter report their value now (a script may have changed it).
    now = {"check": mpicoll.check_mode(), "autodiff": mpicoll.autodiff_mode(),
           "dispatch": mpicoll.dispatch_mode()}
    rows = []
    for field in dataclasses.fields(current):
        value = getattr(current, field.name)
        where = sources[field.name]
        if field.name == "dispatch" and value == "default":
            value, where = now["dispatch"], "default (device-order where JAX allows it)"
        elif field.name in now and now[field.name] != value:
            value, where = now[field.name], f"set in the program ({where}: {value})"
        elif field.name == "trace" and started_by == "start_trace":
            value, where = tracing_to, "set in the program (mpicoll.start_trace)"
        elif field.name == "trace" and not value:
            value = "off"
        elif field.name == "gather_pieces" and not value:
            value, where = "auto", ("default (4 pieces where this process may run on two "
                                    "cores per local device, else whole)")
        elif field.name == "flight_dir" and not value:
            value, where = "per job", ("default (a folder of the job's own in this user's "
                                       f"private folder of {tempfile.gettempdir()}, named when "
                                       "the ranks meet; files: below)")
        elif field.name == "abort_on_error" and value is None:
            value, where = failures.abort_on_error_installed(), \
                "default (on with more than one rank)"
        elif field.name == "as_mpi4jax":
            where += _as_mpi4jax(value)
        if field.name == "dispatch" and value == "device-order":
            where += _multi_device_dispatch()
        rows.append((field.name, value, where))
    return rows


# --- Where a job's files go (docs/security.md) ----------------------------------------

def _jax_transport():
    """What carries JAX's own CPU collectives (the partitioner's) here: (transport, why)."""
    from ._src.over_ranks import jax_transport

    return jax_transport.transport()


def _files_report():
    """This rank's folders: its private folder in the temporary directory and whether
    it passes the rule (runtime/own_files.py), the flight folder, the timeline's."""
    import os

    from ._src.observe import tracing
    from ._src.runtime.native import extension

    root = extension.private_root()
    problem = extension.check_folder(root, root, False) if os.path.lexists(root) else ""
    return {"private_root": root, "problem": problem, "flight_dir": extension.flight_dir(),
            "trace": tracing.tracing_to()[0]}


def _files_lines(reports):
    """The files section, a line per distinct value with the ranks it holds for, and a
    problem per rank whose private folder is refused."""
    def grouped(key, shown):
        values = {}
        for r in reports:
            values.setdefault(shown(r["files"][key]), []).append(r["topology"].rank)
        if len(values) == 1:
            return [next(iter(values))]
        return [f"{value}  (ranks {_ranges(sorted(ranks))})" for value, ranks in values.items()]

    lines = ["files:         (docs/security.md: what other users of the node can reach)"]
    for label, key, shown in (
            ("private folder", "private_root",
             lambda v: f"{v} (this user's, 0700, made when first needed; files 0600)"),
            ("flight records", "flight_dir",
             lambda v: f"{v}/rank<r>.json" if v else "off"),
            ("stacks report", "private_root", lambda v: f"{v}/stacks-<pid>.txt (removed once read)"),
            ("timeline", "trace", lambda v: f"{v}/rank<r>.json" if v else "off")):
        for i, value in enumerate(grouped(key, shown)):
            lines.append(f"  {label + ':' if i == 0 else '':<16}{value}")
    problems = [f"rank {r['topology'].rank}: {r['files']['problem']}: its stacks report and "
                "flight records are not written there" for r in reports if r["files"]["problem"]]
    return lines, problems


def _as_mpi4jax(on):
    """What `import mpi4jax` gives in this process (docs/mpi4jax.md)."""
    import importlib.util

    import _mpicoll_as_mpi4jax as switch

    if switch.installed():
        return ": import mpi4jax gives mpicoll.mpi4jax"
    if on:
        return (f" (but {switch.PTH} is not in this Python's site-packages, so import "
                "mpi4jax is not redirected: make install)")
    spec = importlib.util.find_spec("mpi4jax")
    return (f" (import mpi4jax gives {spec.origin})" if spec
            else " (no mpi4jax installed; MPICOLL_AS_MPI4JAX=1: mpicoll.mpi4jax)")


def _multi_device_dispatch():
    """How device order dispatches programs over several CPU devices here (docs/design.md)."""
    from mpicoll._src.primitive import device_order

    devices = device_order.cpu_device_count()
    if devices < 2:
        return ""
    threads = device_order.xla_cpu_pool_threads()
    if device_order.chain_safe():
        return f"; shard_map/pmap on the fast path too (XLA's pool: {threads} threads)"
    return (f"; shard_map/pmap keep runtime tokens (XLA's pool: {threads} threads for "
            f"{devices} devices; PJRT_NPROC={2 * devices} puts them on the fast path)")


def settings_lines(reports):
    """The settings of rank 0, and a problem for each setting the ranks disagree on."""
    from ._src.runtime import settings

    lines = ["settings:      (MPICOLL_* variables, read at import; docs/settings.md)"]
    width = max(len(name) for name, _, _ in reports[0]["settings"])
    for name, value, where in reports[0]["settings"]:
        lines.append(f"  {name:<{width}}  {value!s:<12} {where}")
    # Set on rank 0 but read by nothing (the import warned): a misspelling, most likely.
    for name, closest in settings.unknown_variables():
        guess = f"; did you mean {closest}?" if closest else ""
        lines.append(f"  {name} is set but mpicoll reads no such variable{guess}")
    problems = []
    for index, (name, value, _) in enumerate(reports[0]["settings"]):
        differ = sorted({r["topology"].rank for r in reports
                         if r["settings"][index][1] != value})
        if differ:
            problems.append(f"setting {name} differs from rank 0's ({value!s}) on rank(s) "
                            f"{_ranges(differ)}: ranks that disagree on it can hang or fail")
    return lines, problems


# --- The MPI mpicoll was built with ------------------------------------------------

def _mpi_build_report():
    """This rank's view of the MPI builds: mpicoll's extension, mpi4py's library."""
    from mpi4py import MPI

    from ._src.runtime.native import extension

    built = extension.build_info()
    vendor, version = MPI.get_vendor()
    return {
        "mpicoll_mpi": f"{built['mpi_vendor']} {'.'.join(map(str, built['mpi_version']))}",
        "mpi4py_mpi": f"{vendor} {'.'.join(map(str, version))}",
        "mpi4py_libmpi": _loaded_libmpi(),
        "cuda_aware": extension.cuda_aware_mpi(),
        "survives": _survival(),
    }


def _survival():
    """'yes (why)' or 'no (why not)': whether this job survives a lost rank (survive.py)."""
    from ._src.survive import can_survive

    ok, why = can_survive()
    return f"{'yes' if ok else 'no'} ({why})"


def _loaded_libmpi():
    """The path of the libmpi this process has mapped (Linux), or 'path unknown'."""
    import os

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libmpi" in line}
    except OSError:
        paths = set()
    libmpi = sorted(p for p in paths if os.path.basename(p).startswith(("libmpi.so", "libmpich.so")))
    return ", ".join(libmpi) or "path unknown"


def _mpi_build_lines(reports):
    """The summary lines about MPI builds (every rank's view; differences are problems)."""
    first = reports[0]
    cuda = {None: "unknown (this MPI has no query for it)", True: "yes", False: "no"}
    lines = [f"built with:    {first['mpicoll_mpi']} (mpicoll's extension)",
             f"mpi4py loads:  {first['mpi4py_mpi']} ({first['mpi4py_libmpi']})",
             f"CUDA-aware:    {cuda[first['cuda_aware']]}",
             f"survives a lost rank: {first['survives']}"]
    problems = []
    for key, what in (("mpicoll_mpi", "mpicoll built with"), ("mpi4py_mpi", "mpi4py loads"),
                      ("cuda_aware", "CUDA-aware")):
        if len({repr(r[key]) for r in reports}) > 1:
            problems.append(f"{what} differs between ranks: "
                            + ", ".join(f"rank {r['topology'].rank}: {r[key]}" for r in reports))
    return lines, problems


# --- GPUs --------------------------------------------------------------------------

def _gpu_report():
    """This rank's GPU view: the build's platforms, the CUDA driver, the transport."""
    import jax

    from ._src.runtime import native

    try:
        gpus = [str(d) for d in jax.devices("cuda")]
    except RuntimeError:
        gpus = []
    driver = native.extension.cuda_driver() if "cuda" in native.PLATFORMS else None
    return {"platforms": native.PLATFORMS, "gpus": gpus, "cuda_driver": driver,
            "gpu_transport": native.GPU_TRANSPORT, "gpu_reason": native.GPU_TRANSPORT_REASON,
            "gpu_chunk": native.GPU_CHUNK_BYTES}


def _gpu_lines(reports):
    """The summary lines about GPUs; a GPU without a CUDA build is a problem."""
    first = reports[0]
    lines = [f"platforms:     {', '.join(first['platforms'])} (handlers in this build)"]
    problems = []
    if "cuda" in first["platforms"]:
        driver = first["cuda_driver"]
        lines.append("CUDA driver:   " + (driver["error"] if driver["error"] else
                                          f"{driver['version'] // 1000}."
                                          f"{driver['version'] % 1000 // 10}, "
                                          f"{driver['devices']} GPU(s) visible to rank 0"))
        chunk = first["gpu_chunk"]
        lines.append(f"GPU transport: {first['gpu_transport']} ({first['gpu_reason']}"
                     + (f"; pipeline chunk {chunk} B" if first["gpu_transport"] == "staged"
                        else "") + ")")
    for r in reports:
        if r["gpus"] and "cuda" not in r["platforms"]:
            problems.append(f"rank {r['topology'].rank} has GPUs ({', '.join(r['gpus'])}) but "
                            "mpicoll was built without CUDA: rebuild with MPICOLL_CUDA=1")
    if len({r["gpu_transport"] for r in reports}) > 1:
        problems.append("the GPU transport differs between ranks: "
                        + ", ".join(f"rank {r['topology'].rank}: {r['gpu_transport']}"
                                    for r in reports))
    return lines, problems

# ----------------------------------------------------------------------------------


def _ranges(ranks):
    """[0, 1, 2, 5] -> '0-2,5'."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(parts)


def duplicate_local_ranks(reports):
    """A launcher's local ranks must number each node's ranks 0..n-1, each once.

    cross_check sees one rank and can only check the range; with every rank's
    report at hand, duplicates show (e.g. a launcher whose idea of the nodes is
    not MPI's).
    """
    seen = {}
    for r in reports:
        for name, value in r["local_ranks"]:
            seen.setdefault((r["topology"].node, name), []).append(value)
    return [f"node {node}: {name} values {sorted(values)} are not distinct"
            for (node, name), values in seen.items() if len(set(values)) != len(values)]


def install_lines():
    """What mpicoll changed in JAX, XLA and the process at import, in order (the same
    on every rank)."""
    from ._src.install import FIRST_USE_OF_RANKS, installed, installed_later, on_first_use
    steps, later, pending = installed(), installed_later(), on_first_use()
    width = max(len(entry[0]) for entry in steps + later + pending)
    lines = ["changes:       (made at import, in this order: mpicoll/_src/install.py)"]
    for name, changes, outcome in steps:
        lines.append(f"  {name:<{width}}  {changes}")
        lines.append(f"  {'':<{width}}    here: {outcome}")
    heading = None
    for name, changes, outcome, by in later:
        if by != heading:
            lines.append(f"  and since, by {by}:")
            heading = by
        lines.append(f"  {name:<{width}}  {changes}")
        lines.append(f"  {'':<{width}}    here: {outcome}")
    if pending:
        lines.append(f"  not made in this process (nothing asked yet): at {FIRST_USE_OF_RANKS}")
    for name, changes in pending:
        lines.append(f"  {name:<{width}}  {changes}")
    return lines


def format_report(reports):
    """The report rank 0 prints, from every rank's rank_report()."""
    import mpi4py
    from mpi4py import MPI

    import mpicoll

    first = reports[0]
    topo = first["topology"]
    vendor, version = MPI.get_vendor()
    lines = [
        f"mpicoll {mpicoll.__version__} ({mpicoll.__path__[0]})",
        f"MPI library:   {' '.join(first['library'].splitlines()[0].split())}",
        f"               {vendor} {'.'.join(map(str, version))}, MPI standard "
        f"{'.'.join(map(str, MPI.Get_version()))}, mpi4py {mpi4py.__version__}",
    ]
    build_lines, build_problems = _mpi_build_lines(reports)
    lines += build_lines
    gpu_lines, gpu_problems = _gpu_lines(reports)
    lines += gpu_lines
    build_problems += gpu_problems
    shown_settings, settings_problems = settings_lines(reports)
    build_problems += settings_problems
    from ._src.runtime.native import extension
    replaced = extension.replaced_sums()
    if replaced:
        lines.append(f"workaround:    this MPI's MPI_SUM saturates for {', '.join(replaced)} "
                     "(open-mpi/ompi#8045); mpicoll sums them with its own wrapping operator")
    levels = sorted({r["thread_level"] for r in reports})
    modes = sorted({r["thread_mode"] for r in reports})
    lines.append("thread level:  " + ", ".join(_THREAD_LEVELS[lv] for lv in levels)
                 + ("" if len(levels) == 1 else "  (differs between ranks!)")
                 + f"; mpicoll's mode: {', '.join(modes)}")
    hosts = {}
    for r in reports:
        hosts.setdefault(r["topology"].hostname, []).append(r["topology"].rank)
    lines.append(f"ranks:         {topo.size} on {topo.node_count} node(s)")
    for host, ranks in hosts.items():
        lines.append(f"  {host}: {len(ranks)} rank(s) [{_ranges(sorted(ranks))}]")

    compared = sorted({name for r in reports for name in r["compared"]})
    problems = [f"rank {r['topology'].rank}: {p}" for r in reports for p in r["problems"]]
    problems += [f"rank {r['topology'].rank}: mpicoll collective failed: {r['collective']}"
                 for r in reports if r["collective"]]
    problems += duplicate_local_ranks(reports)
    problems += build_problems
    verdict = "see PROBLEMS below" if problems else "all agree with MPI"
    if compared:
        lines.append(f"launcher vars: {', '.join(compared)}: {verdict}")
    else:
        lines.append("launcher vars: " + (
            "none comparable, see PROBLEMS below" if problems
            else "none set (a singleton, or a launcher that sets none)"))
    for note in sorted({n for r in reports for n in r["notes"]}):
        lines.append(f"               note: {note}")
    if not any(r["collective"] for r in reports):
        lines.append(f"mpicoll:       allreduce over {topo.size} rank(s) inside jax.jit: ok")
    transport, why = first["jax_transport"]
    lines.append(f"JAX's own:     CPU collectives (a plain jit's) on "
                 + (f"{transport}: {why}" if transport else why))

    lines += shown_settings
    lines += install_lines()
    files_lines, files_problems = _files_lines(reports)
    lines += files_lines
    problems += files_problems
    lines.append("per rank:")
    width = len(str(topo.size - 1))
    for r in reports:
        t = r["topology"]
        lines.append(f"  rank {t.rank:>{width}}  node {t.node} local {t.local_rank}/{t.local_size}"
                     f"  jax {r['jax']} {r['backend']}: {', '.join(r['devices'])}")
    if problems:
        lines.append("PROBLEMS:")
        lines += [f"  {p}" for p in problems]
    return "\n".join(lines), not problems
