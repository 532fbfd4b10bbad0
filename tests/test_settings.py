"""Settings read once from MPICOLL_* variables, thresholds changed through override(),
and the one list of collectives and of reduction ops shared with the extension."""

import dataclasses
import subprocess
import sys

import pytest

import mpicoll
from mpicoll.ops import ranks_devices as _ranks_devices
from mpicoll.runtime import settings as _settings, dtypes as _types
from mpicoll.primitive import spec as _spec
from mpicoll.runtime.native import extension
from conftest import serial_only


def test_defaults_when_nothing_is_set():
    settings, sources = _settings.from_environment({})
    assert settings == _settings.Settings()
    assert settings.check == "first-run" and settings.timeout == 600
    assert settings.stall_report == 60
    assert settings.local_combine_bytes == 1 << 20
    assert settings.split_allreduce_bytes == 256 << 10
    # The flight records go to a folder of the job's own in the temporary directory
    # (the extension names it), never into the working directory.
    assert settings.flight_dir == ""
    assert set(sources.values()) == {"default"}


@pytest.mark.parametrize("variable, raw, field, value", [
    ("MPICOLL_CHECK", "1", "check", "every-call"),
    ("MPICOLL_CHECK", "all", "check", "every-call"),
    ("MPICOLL_CHECK", "off", "check", "off"),
    ("MPICOLL_CHECK", "first", "check", "first-run"),
    ("MPICOLL_TIMEOUT", "2.5", "timeout", 2.5),
    ("MPICOLL_ABORT_ON_ERROR", "0", "abort_on_error", False),
    ("MPICOLL_ABORT_ON_ERROR", "yes", "abort_on_error", True),
    ("MPICOLL_AUTODIFF", "Convention", "autodiff", "convention"),
    ("MPICOLL_DISPATCH", "tokens", "dispatch", "tokens"),
    ("MPICOLL_GPU_TRANSPORT", "staged", "gpu_transport", "staged"),
    ("MPICOLL_GPU_CHUNK_BYTES", "0", "gpu_chunk_bytes", 0),
    ("MPICOLL_LOCAL_COMBINE_BYTES", "4096", "local_combine_bytes", 4096),
    ("MPICOLL_SPLIT_ALLREDUCE_BYTES", " 65536 ", "split_allreduce_bytes", 65536),
    ("MPICOLL_FLIGHT_RECORDS", "0", "flight_records", 0),
    ("MPICOLL_FLIGHT_DIR", "/tmp/flight-here", "flight_dir", "/tmp/flight-here"),
])
def test_each_variable_sets_its_field_and_says_so(variable, raw, field, value):
    settings, sources = _settings.from_environment({variable: raw})
    assert getattr(settings, field) == value
    assert sources[field] == f"{variable}={raw.strip()}"
    others = {f.name for f in dataclasses.fields(settings)} - {field}
    assert all(sources[name] == "default" for name in others)


@pytest.mark.parametrize("variable, raw, message", [
    ("MPICOLL_TIMEOUT", "soon", "MPICOLL_TIMEOUT must be a number of seconds"),
    ("MPICOLL_TIMEOUT", "-1", "MPICOLL_TIMEOUT must be >= 0"),
    ("MPICOLL_DISPATCH", "fifo", "MPICOLL_DISPATCH must be one of"),
    ("MPICOLL_AUTODIFF", "sometimes", "MPICOLL_AUTODIFF must be one of"),
    ("MPICOLL_GPU_TRANSPORT", "nvlink", "MPICOLL_GPU_TRANSPORT must be one of"),
    ("MPICOLL_GPU_CHUNK_BYTES", "4MiB", "MPICOLL_GPU_CHUNK_BYTES='4MiB' must be a non-negative"),
    ("MPICOLL_LOCAL_COMBINE_BYTES", "-5", "MPICOLL_LOCAL_COMBINE_BYTES='-5' must be"),
    ("MPICOLL_FLIGHT_RECORDS", "-1", "MPICOLL_FLIGHT_RECORDS='-1' must be a non-negative"),
    ("MPICOLL_FLIGHT_RECORDS", "many", "MPICOLL_FLIGHT_RECORDS='many' must be a non-negative"),
    ("MPICOLL_TRACE", "/proc/mpicoll-trace", "MPICOLL_TRACE='/proc/mpicoll-trace': mpicoll "
                                             "cannot write there"),
    ("MPICOLL_FLIGHT_DIR", "/no/such/parent/flight", "MPICOLL_FLIGHT_DIR='/no/such/parent/"
                                                     "flight': mpicoll cannot write there"),
])
def test_a_bad_value_names_its_variable(variable, raw, message):
    with pytest.raises(ValueError, match=message):
        _settings.from_environment({variable: raw})


@serial_only
def test_a_bad_variable_stops_the_import():
    env = {"MPICOLL_SPLIT_ALLREDUCE_BYTES": "lots", "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, "-c", "import mpicoll"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "MPICOLL_SPLIT_ALLREDUCE_BYTES='lots' must be a non-negative integer" in run.stderr


def test_the_trace_directory_is_made_at_import_and_given_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    settings, _ = _settings.from_environment({"MPICOLL_TRACE": "timeline/run1"})
    assert settings.trace == str(tmp_path / "timeline" / "run1")
    assert (tmp_path / "timeline" / "run1").is_dir()
    assert _settings.from_environment({})[0].trace == ""


@serial_only
def test_an_unwritable_trace_directory_stops_the_import_on_every_rank():
    from conftest import run_mpiexec
    # Each rank catches and prints its own error: a launcher may kill the other ranks as soon
    # as one exits non-zero (Open MPI 5 does), before they print theirs.  One write each
    # (print writes its pieces apart, which the launcher may interleave between ranks).
    program = ("import os\ntry:\n    import mpicoll\nexcept ValueError as error:\n"
               "    os.write(1, f'refused: {error}\\n'.encode())\nelse:\n"
               "    os.write(1, b'imported\\n')")
    result = run_mpiexec(2, [sys.executable, "-c", program], timeout=120,
                         env={"MPICOLL_TRACE": "/proc/mpicoll-trace"})
    assert result.returncode == 0, result.summary()
    assert "imported" not in result.output, result.summary()
    assert result.output.count("refused: MPICOLL_TRACE='/proc/mpicoll-trace': mpicoll cannot "
                               "write there") == 2, result.summary()


def test_override_changes_the_thresholds_inside_only():
    before = _ranks_devices.local_combine_bytes(2), _ranks_devices.split_allreduce_bytes(8)
    with _settings.override(local_combine_bytes=0, split_allreduce_bytes=7000) as inside:
        assert inside is _settings.current()
        assert _ranks_devices.local_combine_bytes(2) == 0
        assert _ranks_devices.split_allreduce_bytes(8) == 1000  # scaled by 1 / (L - 1)
        assert _settings.sources()["split_allreduce_bytes"] == "override"
        with _settings.override(local_combine_bytes=None):  # None keeps a field
            assert _ranks_devices.local_combine_bytes(2) == 0
    assert (_ranks_devices.local_combine_bytes(2), _ranks_devices.split_allreduce_bytes(8)) \
        == before
    assert _settings.sources()["split_allreduce_bytes"] != "override"


def test_every_collective_of_the_extension_has_one_spec_that_agrees_with_its_row():
    native = extension.collectives()
    assert set(native) == set(_spec.SPECS), "the Python specs and csrc/ops.def disagree"
    for name, spec in _spec.SPECS.items():
        assert bool(native[name]["reduces"]) == spec.reduces, name
        assert bool(native[name]["rooted"]) == spec.has_root, name


def test_the_dtype_table_is_the_extensions_and_every_docstring_lists_it():
    import mpicoll
    from mpicoll.runtime import dtypes as _types
    assert [str(d) for d in _types.DTYPE_FAMILIES] == list(extension.dtypes())
    for name in ("bfloat16", "complex128", "uint64", "bool"):
        assert name in extension.dtypes()
    listed = " ".join(mpicoll.allreduce.__doc__.split())
    assert _types.dtype_names() in listed, "allreduce's docstring lists the dtypes"
    assert _types.dtype_names() in " ".join(mpicoll.gatherv.__doc__.split())


def test_a_spec_the_extension_does_not_know_is_refused():
    from mpicoll.primitive.define import define
    unknown = _spec.Collective("allmean", out_shape=lambda shape, params: shape,
                               transpose=lambda ct, params: ct, reduces=True)
    with pytest.raises(AssertionError, match="no collective 'allmean'"):
        define(unknown)
    disagreeing = dataclasses.replace(_spec.SPECS["bcast"], has_root=False)
    with pytest.raises(AssertionError, match="disagrees"):
        define(disagreeing)


def test_the_reduction_ops_are_the_extensions():
    native = extension.reduction_ops()
    assert list(_types.OP_FAMILIES) == sorted(native, key=lambda name: native[name][0])
    assert _types.OP_CODES == {name: code for name, (code, _) in native.items()}
    # ... and every one is valid by name and as mpi4py's op (MPI.SUM for "sum").
    from mpi4py import MPI
    for name in native:
        assert _types.op_name(getattr(MPI, name.upper()), "test") == name
