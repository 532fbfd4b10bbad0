"""Settings read once from MPICOLL_* variables, thresholds changed through override(),
and the one list of collectives and of reduction ops shared with the extension."""

import dataclasses
import os
import subprocess
import sys

import pytest

import mpicoll
from mpicoll._src.ops import ranks_devices
from mpicoll._src.runtime import settings, dtypes
from mpicoll._src.primitive import spec
from mpicoll._src.runtime.native import extension
from conftest import serial_only


def test_defaults_when_nothing_is_set():
    values, sources = settings.from_environment({})
    assert values == settings.Settings()
    assert values.check == "first-run" and values.timeout == 600
    assert values.stall_report == 60
    assert values.local_combine_bytes == 1 << 20
    assert values.split_allreduce_bytes == 256 << 10
    # The flight records go to a folder of the job's own in the temporary directory
    # (the extension names it), never into the working directory.
    assert values.flight_dir == ""
    assert set(sources.values()) == {"default"}


@pytest.mark.parametrize("variable, raw, field, value", [
    ("MPICOLL_CHECK", "1", "check", "every-call"),
    ("MPICOLL_CHECK", "all", "check", "every-call"),
    ("MPICOLL_CHECK", "off", "check", "off"),
    ("MPICOLL_CHECK", "first", "check", "first-run"),
    ("MPICOLL_TIMEOUT", "2.5", "timeout", 2.5),
    ("MPICOLL_TIMEOUT", "10min", "timeout", 600.0),
    ("MPICOLL_TRACE_SKIP", "3", "trace_skip", 3),
    ("MPICOLL_ABORT_ON_ERROR", "0", "abort_on_error", False),
    ("MPICOLL_ABORT_ON_ERROR", "yes", "abort_on_error", True),
    ("MPICOLL_AUTODIFF", "Convention", "autodiff", "convention"),
    ("MPICOLL_DISPATCH", "tokens", "dispatch", "tokens"),
    ("MPICOLL_GPU_TRANSPORT", "staged", "gpu_transport", "staged"),
    ("MPICOLL_GPU_CHUNK_BYTES", "0", "gpu_chunk_bytes", 0),
    ("MPICOLL_GPU_CHUNK_BYTES", "8MiB", "gpu_chunk_bytes", 8 << 20),
    ("MPICOLL_LOCAL_COMBINE_BYTES", "4096", "local_combine_bytes", 4096),
    ("MPICOLL_SPLIT_ALLREDUCE_BYTES", " 65536 ", "split_allreduce_bytes", 65536),
    ("MPICOLL_FLIGHT_RECORDS", "0", "flight_records", 0),
    ("MPICOLL_FLIGHT_DIR", "/tmp/flight-here", "flight_dir", "/tmp/flight-here"),
])
def test_each_variable_sets_its_field_and_says_so(variable, raw, field, value):
    values, sources = settings.from_environment({variable: raw})
    assert getattr(values, field) == value
    assert sources[field] == f"{variable}={raw.strip()}"
    others = {f.name for f in dataclasses.fields(values)} - {field}
    assert all(sources[name] == "default" for name in others)


@pytest.mark.parametrize("variable, raw, message", [
    ("MPICOLL_TIMEOUT", "soon", "MPICOLL_TIMEOUT='soon' must be a duration >= 0"),
    ("MPICOLL_TIMEOUT", "-1", "MPICOLL_TIMEOUT='-1' must be a duration >= 0"),
    ("MPICOLL_DISPATCH", "fifo", "MPICOLL_DISPATCH='fifo' must be one of: default, device-order, "
                                 "tokens$"),
    ("MPICOLL_AUTODIFF", "sometimes", "MPICOLL_AUTODIFF='sometimes' must be one of"),
    ("MPICOLL_GPU_TRANSPORT", "nvlink", "MPICOLL_GPU_TRANSPORT='nvlink' must be one of"),
    ("MPICOLL_GPU_CHUNK_BYTES", "4MB", "MPICOLL_GPU_CHUNK_BYTES='4MB' must be a size >= 0"),
    ("MPICOLL_LOCAL_COMBINE_BYTES", "-5", "MPICOLL_LOCAL_COMBINE_BYTES='-5' must be a size"),
    ("MPICOLL_FLIGHT_RECORDS", "-1", "MPICOLL_FLIGHT_RECORDS='-1' must be a whole number >= 0"),
    ("MPICOLL_FLIGHT_RECORDS", "many", "MPICOLL_FLIGHT_RECORDS='many' must be a whole number"),
    ("MPICOLL_TRACE", "/proc/mpicoll-trace", "MPICOLL_TRACE='/proc/mpicoll-trace': mpicoll "
                                             "cannot write there"),
    ("MPICOLL_FLIGHT_DIR", "/no/such/parent/flight", "MPICOLL_FLIGHT_DIR='/no/such/parent/"
                                                     "flight': mpicoll cannot write there"),
])
def test_a_bad_value_names_its_variable(variable, raw, message):
    with pytest.raises(ValueError, match=message):
        settings.from_environment({variable: raw})


# A value outside a setting's spellings is refused, never read as another
# (MPICOLL_CHECK=none gave every-call, the opposite).
@pytest.mark.parametrize("raw", ["none", "always", "never", "2", "every", "firstrun", "yes please"])
def test_an_unknown_check_mode_is_refused_with_the_valid_ones(raw):
    with pytest.raises(ValueError) as caught:
        settings.from_environment({"MPICOLL_CHECK": raw})
    assert str(caught.value) == (
        f"MPICOLL_CHECK={raw!r} must be one of: off (0, false, no), first-run (first), "
        "every-call (all, 1, true, yes, on)")


@pytest.mark.parametrize("variable", ["MPICOLL_ABORT_ON_ERROR", "MPICOLL_AS_MPI4JAX"])
@pytest.mark.parametrize("raw", ["maybe", "2", "enabled", "-1"])
def test_an_on_off_setting_takes_the_on_off_spellings_only(variable, raw):
    with pytest.raises(ValueError, match=rf"^{variable}='{raw}' must be on \(1, true, yes, on\) "
                                         r"or off \(0, false, no, off\)$"):
        settings.from_environment({variable: raw})


_ON_OFF = {"1": True, "TRUE": True, "yes": True, "On": True,
           "0": False, "false": False, "NO": False, "off": False}


@pytest.mark.parametrize("raw, on", _ON_OFF.items())
def test_every_on_off_setting_reads_the_same_spellings(raw, on):
    values, _ = settings.from_environment({"MPICOLL_ABORT_ON_ERROR": raw,
                                           "MPICOLL_AS_MPI4JAX": raw, "MPICOLL_CHECK": raw})
    assert values.abort_on_error is on and values.as_mpi4jax is on
    assert values.check == ("every-call" if on else "off")


# One rule for every duration: seconds alone, or with ms, s, min or h.
_DURATIONS = {"10": 10.0, "10s": 10.0, "10min": 600.0, "2.5": 2.5, "250ms": 0.25, "1h": 3600.0,
              "0": 0.0, " 3 S ": 3.0, "1.5MIN": 90.0, ".5s": 0.5}


@pytest.mark.parametrize("variable, field", [("MPICOLL_TIMEOUT", "timeout"),
                                             ("MPICOLL_STALL_REPORT", "stall_report")])
def test_every_duration_setting_reads_the_same_spellings(variable, field):
    for raw, seconds in _DURATIONS.items():
        values, sources = settings.from_environment({variable: raw})
        assert getattr(values, field) == pytest.approx(seconds), raw
        assert sources[field] == f"{variable}={raw.strip()}"
    for raw in ("10m", "10 minutes", "1e3", "inf", "nan", "10sec", "5d", "1:30", "-2s"):
        with pytest.raises(ValueError, match=rf"^{variable}='{raw}' must be a duration >= 0: "
                                             r"seconds \(10, 2\.5\) or with a unit "
                                             r"\(500ms, 10s, 10min, 2h\)$"):
            settings.from_environment({variable: raw})


@pytest.mark.parametrize("variable, field", [("MPICOLL_GPU_CHUNK_BYTES", "gpu_chunk_bytes"),
                                             ("MPICOLL_LOCAL_COMBINE_BYTES", "local_combine_bytes"),
                                             ("MPICOLL_SPLIT_ALLREDUCE_BYTES",
                                              "split_allreduce_bytes")])
def test_every_size_setting_reads_the_same_spellings(variable, field):
    for raw, size in {"4194304": 4 << 20, "4MiB": 4 << 20, "4096kib": 4 << 20, "1GiB": 1 << 30,
                      "0": 0, "512B": 512}.items():
        assert getattr(settings.from_environment({variable: raw})[0], field) == size, raw
    for raw in ("4MB", "4M", "1.5MiB", "lots", "-1"):
        with pytest.raises(ValueError, match=rf"^{variable}='{raw}' must be a size >= 0"):
            settings.from_environment({variable: raw})


@pytest.mark.parametrize("variable", ["MPICOLL_FLIGHT_RECORDS", "MPICOLL_GATHER_PIECES",
                                      "MPICOLL_TRACE_SKIP"])
def test_every_count_setting_reads_the_same_spellings(variable):
    field = next(f for f, (v, _) in settings._VARIABLES.items() if v == variable)
    assert getattr(settings.from_environment({variable: "12"})[0], field) == 12
    for raw in ("1.0", "1e3", "-1", "ten", "10s"):
        with pytest.raises(ValueError, match=rf"^{variable}='{raw}' must be a whole number >= 0$"):
            settings.from_environment({variable: raw})


# Misspellings on purpose, in these tests and in docs/settings.md.
_MISSPELT = {"MPICOLL_TIMOUT", "MPICOLL_STALLREPORT", "MPICOLL_CHEK", "MPICOLL_ZEBRA"}


def test_a_misspelt_prefix_is_named_with_the_setting_it_means():
    unknown = settings.unknown_variables({"MPICOL_TIMEOUT": "10", "MPI_COLL_CHECK": "1",
                                          "MPICOLLSTALL_REPORT": "5", "MPICH_PORT_RANGE": "1",
                                          "MPIEXEC_PORT": "1", "OMPI_MCA_btl": "tcp",
                                          "MPICOLL_TIMEOUT": "5"})
    assert unknown == [("MPICOLLSTALL_REPORT", "MPICOLL_STALL_REPORT"),
                       ("MPICOL_TIMEOUT", "MPICOLL_TIMEOUT"),
                       ("MPI_COLL_CHECK", "MPICOLL_CHECK")], unknown


def test_an_unknown_variable_is_named_with_the_closest_known_one():
    unknown = settings.unknown_variables({"MPICOLL_TIMOUT": "10", "MPICOLL_STALLREPORT": "5",
                                          "MPICOLL_CHEK": "1", "MPICOLL_ZEBRA": "1",
                                          "MPICOLL_TIMEOUT": "5", "PATH": "/bin"})
    assert unknown == [("MPICOLL_CHEK", "MPICOLL_CHECK"),
                       ("MPICOLL_STALLREPORT", "MPICOLL_STALL_REPORT"),
                       ("MPICOLL_TIMOUT", "MPICOLL_TIMEOUT"), ("MPICOLL_ZEBRA", None)]
    assert settings.unknown_variable_message("MPICOLL_TIMOUT", "MPICOLL_TIMEOUT") == (
        "mpicoll: MPICOLL_TIMOUT is not a variable mpicoll reads; did you mean MPICOLL_TIMEOUT? "
        "(the settings: docs/settings.md)")


def test_every_mpicoll_variable_the_repository_uses_is_known():
    """Nothing legitimate warns: every MPICOLL_* name in the code, scripts and docs
    is a setting, one of OTHER_VARIABLES, or a C macro of csrc/ (defined, tested or
    called there; a name in a comment only is not one)."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent
    name = re.compile(r"\bMPICOLL_[A-Z0-9_]*[A-Z0-9]\b")
    macro = re.compile(r"(?:#\s*(?:define|ifdef|ifndef|undef)\s+|defined\s*\(\s*)"
                       r"(MPICOLL_\w+)|\b(MPICOLL_\w+)\(")
    macros = set()
    for path in (root / "mpicoll" / "csrc").rglob("*"):
        if path.suffix in (".h", ".cc", ".def", ".cu"):
            macros.update(a or b for a, b in macro.findall(path.read_text(errors="replace")))
    used = {}
    for folder in ("mpicoll", "tests", "launch", "tools", "examples", "benchmarks", "docs"):
        for path in (root / folder).rglob("*"):
            if path.is_file() and path.suffix in (".py", ".sh", ".sbatch", ".md", ".toml", ".cfg"):
                for found in name.findall(path.read_text(errors="replace")):
                    used.setdefault(found, path.relative_to(root))
    for path in (root / "Makefile", root / "setup.py", root / "README.md"):
        for found in name.findall(path.read_text(errors="replace")):
            used.setdefault(found, path.relative_to(root))
    known = set(settings.known_variables())
    strays = {n: str(where) for n, where in used.items()
              if n not in known and n not in macros and n not in _MISSPELT}
    assert not strays, f"MPICOLL_* names used but unknown to settings.py: {strays}"
    assert set(settings.OTHER_VARIABLES) <= set(used), "an OTHER_VARIABLES entry nothing uses"


@serial_only
def _bare_environment(**variables):
    """No MPICOLL_* variable but `variables`; what an MPI needs to start a singleton
    (Open MPI reads HOME and, as root, its run-as-root pair)."""
    env = {"PATH": "/usr/bin:/bin", **variables}
    env.update({key: value for key, value in os.environ.items()
                if key in ("HOME", "TMPDIR") or key.startswith("OMPI_ALLOW_RUN_AS_ROOT")})
    return env


def test_an_unknown_variable_warns_once_at_import_pointing_at_it():
    program = "import mpicoll\nimport mpicoll._src.runtime.settings\nimport mpicoll\n"
    env = _bare_environment(MPICOLL_TIMOUT="10")
    run = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stderr.count("UnknownVariableWarning") == 1, run.stderr
    assert ("<string>:1: UnknownVariableWarning: mpicoll: MPICOLL_TIMOUT is not a variable "
            "mpicoll reads; did you mean MPICOLL_TIMEOUT?") in run.stderr


@serial_only
def test_a_bad_variable_stops_the_import():
    env = _bare_environment(MPICOLL_SPLIT_ALLREDUCE_BYTES="lots")
    run = subprocess.run([sys.executable, "-c", "import mpicoll"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "MPICOLL_SPLIT_ALLREDUCE_BYTES='lots' must be a size >= 0" in run.stderr
    # In the user's terms: the import line and the sentence, no frames of mpicoll's.
    assert run.stderr.count('File "') == 2, run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith(
        "ValueError: mpicoll: MPICOLL_SPLIT_ALLREDUCE_BYTES='lots' must be"), run.stderr


def test_the_trace_directory_is_made_at_import_and_given_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    values, _ = settings.from_environment({"MPICOLL_TRACE": "timeline/run1"})
    assert values.trace == str(tmp_path / "timeline" / "run1")
    assert (tmp_path / "timeline" / "run1").is_dir()
    assert settings.from_environment({})[0].trace == ""


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
    assert result.output.count("refused: mpicoll: MPICOLL_TRACE='/proc/mpicoll-trace': mpicoll cannot "
                               "write there") == 2, result.summary()


def test_override_changes_the_thresholds_inside_only():
    before = ranks_devices.local_combine_bytes(2), ranks_devices.split_allreduce_bytes(8)
    with settings.override(local_combine_bytes=0, split_allreduce_bytes=7000) as inside:
        assert inside is settings.current()
        assert ranks_devices.local_combine_bytes(2) == 0
        assert ranks_devices.split_allreduce_bytes(8) == 1000  # scaled by 1 / (L - 1)
        assert settings.sources()["split_allreduce_bytes"] == "override"
        with settings.override(local_combine_bytes=None):  # None keeps a field
            assert ranks_devices.local_combine_bytes(2) == 0
    assert (ranks_devices.local_combine_bytes(2), ranks_devices.split_allreduce_bytes(8)) \
        == before
    assert settings.sources()["split_allreduce_bytes"] != "override"


def test_every_collective_of_the_extension_has_one_spec_that_agrees_with_its_row():
    native = extension.collectives()
    assert set(native) == set(spec.SPECS), "the Python specs and csrc/ops.def disagree"
    for name, collective in spec.SPECS.items():
        assert bool(native[name]["reduces"]) == collective.reduces, name
        assert bool(native[name]["rooted"]) == collective.has_root, name


def test_the_dtype_table_is_the_extensions_and_every_docstring_lists_it():
    import mpicoll
    assert [str(d) for d in dtypes.DTYPE_FAMILIES] == list(extension.dtypes())
    for name in ("bfloat16", "complex128", "uint64", "bool"):
        assert name in extension.dtypes()
    listed = " ".join(mpicoll.allreduce.__doc__.split())
    assert dtypes.dtype_names() in listed, "allreduce's docstring lists the dtypes"
    assert dtypes.dtype_names() in " ".join(mpicoll.gatherv.__doc__.split())


def test_a_spec_the_extension_does_not_know_is_refused():
    from mpicoll._src.primitive.define import define
    unknown = spec.Collective("allmean", out_shape=lambda shape, params: shape,
                              transpose=lambda ct, params: ct, reduces=True)
    with pytest.raises(AssertionError, match="no collective 'allmean'"):
        define(unknown)
    disagreeing = dataclasses.replace(spec.SPECS["bcast"], has_root=False)
    with pytest.raises(AssertionError, match="disagrees"):
        define(disagreeing)


def test_the_reduction_ops_are_the_extensions():
    native = extension.reduction_ops()
    assert list(dtypes.OP_FAMILIES) == sorted(native, key=lambda name: native[name][0])
    assert dtypes.OP_CODES == {name: code for name, (code, _) in native.items()}
    # ... and every one is valid by name and as mpi4py's op (MPI.SUM for "sum").
    from mpi4py import MPI
    for name in native:
        assert dtypes.op_name(getattr(MPI, name.upper()), "test") == name


@serial_only
def test_a_misread_setting_stops_the_import_on_every_rank_and_a_misspelt_one_warns():
    from conftest import run_mpiexec
    program = ("import os, warnings\nwarnings.simplefilter('always')\n"
               "try:\n    import mpicoll\nexcept ValueError as error:\n"
               "    os.write(1, f'refused: {error}\\n'.encode())\nelse:\n"
               "    os.write(1, b'imported\\n')")
    refused = run_mpiexec(3, [sys.executable, "-c", program], timeout=120,
                          env={"MPICOLL_CHECK": "none"})
    assert refused.returncode == 0, refused.summary()
    assert "imported" not in refused.output, refused.summary()
    assert refused.output.count("refused: mpicoll: MPICOLL_CHECK='none' must be one of: off (0, false, "
                                "no), first-run (first), every-call (all, 1, true, yes, on)") \
        == 3, refused.summary()
    warned = run_mpiexec(2, [sys.executable, "-c", program], timeout=120,
                         env={"MPICOLL_TIMOUT": "10"})
    assert warned.returncode == 0, warned.summary()
    assert warned.output.count("imported") == 2, warned.summary()
    assert warned.output.count("MPICOLL_TIMOUT is not a variable mpicoll reads; did you mean "
                               "MPICOLL_TIMEOUT?") == 2, warned.summary()
