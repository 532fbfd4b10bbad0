"""Making a collective a JAX primitive, machinery only: what a collective is
(spec.py), the one mechanism that defines its primitives (define.py), their
typing over the ranks (varying.py), argument checks (validate.py), binding,
eager and overlapped calls (dispatch.py), arrays over several local devices
(sharded.py) and how programs are ordered (device_order.py).  The public
choices these read are set in ops/ (typed_ranks.py, scheduling.py).
"""
