"""Making a collective a JAX primitive: what a collective is (spec.py), the one
mechanism that defines its primitives (define.py), their typing over the ranks
(varying.py), argument checks (validate.py), binding and eager calls
(dispatch.py), how programs are ordered (device_order.py) and overlapped calls
(overlap.py).
"""
