"""What a collective is: a `Collective` spec (which owns its primitives), the registry
of every spec, and the docstring filler of the public functions.

A spec gives what differs between collectives (the output shape rule, whether
it takes a root and a reduction op, its vmap and autodiff hooks); one mechanism
(define.py) turns it into a JAX primitive.  The families:
"blocks" (ops/collectives.py: equal rank blocks, pytrees fuse), "vector" (vector.py:
counts per rank) and "peer" (p2p.py: point-to-point).  The extension's own table
of collectives (csrc/ops.def) is the other half of a row; `define` checks that
the two agree.
"""

import dataclasses
import textwrap
from typing import Callable

from .. import _compat
from ..runtime import comm as comm_layer


@dataclasses.dataclass(frozen=True)
class Collective:
    """The specification of one collective; everything else is shared.

    out_shape(shape, params): output shape from the input shape and the
        primitive's params (params["size"] is the comm size).
    transpose(ct, params): cotangent of x from the output's cotangent; for a
        reduction this is the op="sum" case (the other ops are not linear).
    reduction_jvp(x, y, t, params): tangent for the non-linear reduction ops
        (prod, min, max); None: only op="sum" is differentiable.
    family: "blocks" (equal rank blocks; pytrees fuse), "vector" (counts per
        rank) or "peer" (point-to-point); the last two carry `ffi_args` (ints the
        handler reads: counts, peers and tags) and have no fused form.
    check(x, info, **static): validates a family's static arguments (counts,
        peers) like the common checks, and returns the params they add.
    batch(x, dim, params): -> (x, params, out_dim) for the batched call, where a
        family's params depend on the shape; the default moves the rank axis first.
    not_differentiable: a reason; the JVP raises it (only zero tangents pass).
    replicates: the output is the same on every rank of comm (allreduce,
        allgather, bcast): typed invariant over RANKS when comm spans every rank.

    Every primitive carries the static params comm (table slot), size, root,
    op (code, -1 if none) and transpose_sums: False for mpicoll's convention
    (a replicated output is one value); True where the cotangents of a
    replicated output are summed over ranks, which the ranks x devices
    collectives need to reproduce psum/all_gather under pmap.
    """
    name: str
    out_shape: Callable
    transpose: Callable
    has_root: bool = False
    reduces: bool = False
    leading_axis_is_size: bool = False  # x must have shape (size, ...)
    in_place: bool = False  # output aliases the input buffer (MPI_IN_PLACE)
    family: str = "blocks"
    check: Callable = None
    batch: Callable = None
    reduction_jvp: Callable = None
    not_differentiable: str = None
    replicates: bool = False  # the output is identical on every rank of comm
    # Set once by define.define: the primitive of one array, and (blocks
    # family) the fused one of n arrays of one dtype in one message.
    primitive: object = dataclasses.field(default=None, compare=False, repr=False)
    fused: object = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def target(self):
        return f"mpicoll_{self.name}"

    def run(self, x, params, **changes):
        """Bind this collective with params (for rules that call another collective)."""
        return self.primitive.bind(x, **{**params, **changes, "ordered": True, "alias": True})

    def owns(self, primitive, fused=None):
        """Record the primitives define.define made for this spec (once)."""
        assert self.primitive is None, f"{self.name} is defined twice"
        object.__setattr__(self, "primitive", primitive)  # frozen: set once, here
        object.__setattr__(self, "fused", fused)


# name -> spec, for the checks against the extension's table (csrc/ops.def); code
# reaches a collective through its spec object, never by name.
SPECS = {}


def rank(params):
    """This process's rank in the communicator of a primitive's params."""
    return comm_layer.info_for_slot(params["comm"]).rank


def paragraph(text):
    """text as a docstring field's paragraph: wrapped, its lines after the first
    indented under the field (Google style, as napoleon reads it)."""
    indent = " " * 12
    return textwrap.fill(" ".join(text.split()), 84, initial_indent=indent,
                         subsequent_indent=indent).lstrip()


def documented(fields, *, boundary=True):
    """A decorator completing a public function's docstring with what its family
    has in common: each {field} of `fields` replaced by its text, then {name} by
    the function's name, and {{ }} unescaped.  With boundary, an error raised
    inside shows the caller's frames, not mpicoll's (as JAX's own API does)."""
    def fill(function):
        doc = function.__doc__
        for field, text in fields.items():
            doc = doc.replace("{" + field + "}", text)
        function.__doc__ = (doc.replace("{name}", function.__name__)
                            .replace("{{", "{").replace("}}", "}"))
        return _compat.api_boundary(function) if boundary else function
    return fill
