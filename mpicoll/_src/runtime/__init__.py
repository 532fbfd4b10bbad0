"""What mpicoll runs on: the extension and its MPI (native.py), communicators
(comm.py), dtypes and reduction ops (dtypes.py), and the MPICOLL_* settings
(settings.py).
"""
