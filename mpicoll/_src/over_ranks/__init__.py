"""JAX's own vocabulary across MPI ranks: jax.lax collectives over mpicoll.RANKS or a
global mesh's process axes (lax.py), which devices a mesh's axes group
(mesh_groups.py), and jax.experimental.multihost_utils on MPI (multihost.py).
"""
